"""BENCHMARK ONLY: DFlash at a fixed acceptance length, by replaying the target's own output.

A draft with random weights (``--load-format dummy`` shapes) proposes tokens the target almost
never accepts, so served DFlash cannot be timed at the acceptance lengths a trained draft
reaches. With the environment variable ``MUSEGL_DFLASH_BENCHMARK_ACCEPT=K`` set for
``musegl serve --dflash DRAFT`` (a variable, not a flag: no ``--help`` line invites it), the
loader wraps the DFlash speculator in :class:`ReplaySpeculator`, which

* still runs the real draft forward on every step (``DFlashSpeculator.propose``: same batch,
  same block width, same context store), so the draft's cost is the real one;
* records the tokens each sequence ends up with (its prompt and the target's tokens, from the
  engine's requests and the committed rows of every step) when the sequence is released;
* on a later request whose tokens are a prefix of a recorded sequence, replaces the draft's
  proposals: the first ``K - 1`` are the recorded continuation (which the target, greedy or
  with the same seed, produces again, so they are accepted), the ``K``-th is a token the
  recorded continuation does not have there (so it is rejected), the rest stay the draft's.
  Each verify block then commits exactly ``K`` tokens (``K - 1`` drafts and the target's own).

So: run a workload once (it is recorded, at the random draft's acceptance), then again with
the same prompts (replayed at acceptance length ``K``). ``K`` is an integer, or the path of a
file holding one, re-read whenever the file changes, so that one server measures several
lengths (``0``: record only, propose the draft's own tokens). Where the target's output
differs from the recording (numerics of another batch mix), the replay stops for that
sequence and the draft's own proposals are used; the engine's counters
(``musegl_spec_mean_acceptance_length``) say what acceptance was measured, and
:class:`ReplayCounts` where the replay stopped: with ``K`` in a file, they are written beside
it (``<file>.stats``, JSON, rewritten whenever a sequence is released).

The served output is the target's either way (verification decides every token): this changes
only which drafts are proposed, never what is returned. It exists to time the speculative path
and must not be enabled for serving: the recordings grow without bound.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

import attrs

from musegl_core.engine.executor import Step, StepOutput
from musegl_core.engine.speculator import DraftRequest
from musegl_core.errors import ConfigError

log = logging.getLogger("musegl.dflash")

#: The variable that turns the replay on (unset or empty: off).
ENV = "MUSEGL_DFLASH_BENCHMARK_ACCEPT"

#: Leading tokens that index the recordings (a lookup compares the whole prefix after it).
KEY_TOKENS = 32


class AcceptanceSource:
    """The acceptance length to replay: a fixed integer, or the integer in a file (re-read
    when its modification time changes)."""

    def __init__(self, spec: str | int) -> None:
        self.path: str | None = None
        self.value = 0
        self.stamp: float | None = None
        text = str(spec).strip()
        if text.isdigit():
            self.value = int(text)
        else:
            self.path = text
            self._reload()

    def _reload(self) -> None:
        assert self.path is not None
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except OSError:
            return  # keep the last value while the file is being replaced
        if stamp == self.stamp:
            return
        text = open(self.path, encoding="utf-8").read().strip()
        if not text.isdigit():
            return  # a half-written file: read again at the next change
        self.stamp = stamp
        self.value = int(text)
        log.warning("dflash benchmark replay: acceptance length %d (from %s)", self.value, self.path)

    def current(self) -> int:
        if self.path is not None:
            self._reload()
        return self.value


def wrong_token(token: int) -> int:
    """A token id other than ``token`` (inside any vocabulary holding ``token`` and one more)."""
    return token - 1 if token > 0 else token + 1


def replace_drafts(recorded: Sequence[int], tokens_so_far: int, drafted: Sequence[int], room: int,
                   accept: int) -> list[int]:
    """The proposals that make a verify block commit ``accept`` tokens: ``accept - 1`` tokens of
    ``recorded`` after the ``tokens_so_far`` tokens the sequence holds, then one that differs from
    the recording, then the draft's own (``drafted``); ``room`` drafts at most."""
    start = tokens_so_far  # the target's token after the pending one sits here in the recording
    out = list(recorded[start:start + min(accept - 1, room)])
    if len(out) == accept - 1 and len(out) < room and start + len(out) < len(recorded):
        out.append(wrong_token(recorded[start + len(out)]))
        out.extend(drafted[len(out):room])
    return out


class ContinuationBook:
    """Finished sequences' tokens, found again by any prefix of them."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        self.short: list[tuple[int, ...]] = []

    def add(self, tokens: tuple[int, ...]) -> None:
        if len(tokens) < KEY_TOKENS:
            self.short.insert(0, tokens)
            return
        self.by_key.setdefault(tokens[:KEY_TOKENS], []).insert(0, tokens)  # newest first

    def find(self, prefix: Sequence[int]) -> tuple[int, ...] | None:
        """The newest recording that starts with ``prefix`` and goes on past it."""
        prefix = tuple(prefix)
        n = len(prefix)
        if n >= KEY_TOKENS:
            candidates = self.by_key.get(prefix[:KEY_TOKENS], [])
        else:
            candidates = [t for ts in self.by_key.values() for t in ts] + self.short
        for tokens in candidates:
            if len(tokens) > n and tokens[:n] == prefix:
                return tokens
        return None


@attrs.define
class ReplayCounts:
    """What the replay did since the server started (for the benchmark's diagnosis). Sequences are
    counted at their first proposal while ``K >= 1``: ``followed`` found a recording then,
    ``unmatched`` found none, ``first_token_differs`` of those found one of the prompt alone (so the
    target's first token, from the prefill, is not the recorded one). ``left`` counts the times a
    followed recording stopped matching the target's tokens with no other recording matching, and
    ``left_after`` the sequence's tokens after its first proposal's at each of those times."""

    replayed_blocks: int = 0
    drafted_blocks: int = 0
    followed: int = 0
    unmatched: int = 0
    first_token_differs: int = 0
    left: int = 0
    left_after: list[int] = attrs.Factory(list)


def stats_path(accept: AcceptanceSource) -> str | None:
    """Where the counts are written: beside the file holding ``K`` (None for a fixed ``K``)."""
    return None if accept.path is None else accept.path + ".stats"


class ReplaySpeculator:
    """A DFlash speculator whose proposals are replaced by recorded target output (module doc).

    Delegates the speculator contract to ``inner`` (the real draft runs every step); other
    attributes (``taps``, ``max_draft``, counters) are the inner speculator's."""

    def __init__(self, inner: Any, accept: AcceptanceSource) -> None:
        self.inner = inner
        self.accept = accept
        self.book = ContinuationBook()
        #: seq -> (tokens at its last proposal, tokens committed since)
        self.seen: dict[int, tuple[tuple[int, ...], list[int]]] = {}
        #: released sequences, recorded at the next observe (the engine may release a sequence
        #: before it shows the speculator the step that finished it)
        self.closing: dict[int, tuple[tuple[int, ...], list[int]]] = {}
        #: seq -> the recording it follows
        self.following: dict[int, tuple[int, ...]] = {}
        #: seq -> its token count at its first proposal while K >= 1 (see ReplayCounts)
        self.first_seen: dict[int, int] = {}
        self.counts = ReplayCounts()
        log.warning("dflash benchmark replay is ON (MUSEGL_DFLASH_BENCHMARK_ACCEPT): drafts are replaced by recorded "
                    "target output; for timing the speculative path only, never for serving")

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, pickle): no recursion through it
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- the contract ----------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return self.inner.kv_bytes_per_block()

    def allocate_kv(self, num_blocks: int) -> None:
        self.inner.allocate_kv(num_blocks)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.inner.copy_blocks(pairs)

    def close(self) -> None:
        self.inner.close()

    def propose(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]:
        drafts = self.inner.propose(requests)  # the real draft forward: its cost is what is timed
        accept = self.accept.current()
        for r in requests:
            tokens = tuple(r.tokens)
            self.seen[r.seq] = (tokens, [])
            if accept < 1:
                continue
            recorded = self._recording(r.seq, tokens)
            if recorded is None:
                self.counts.drafted_blocks += 1
                continue
            drafts[r.seq] = replace_drafts(recorded, len(tokens), drafts.get(r.seq, []), r.max_draft, accept)
            self.counts.replayed_blocks += 1
        return drafts

    def observe(self, step: Step, output: StepOutput, committed: dict[int, int]) -> None:
        self.inner.observe(step, output, committed)
        for chunk in step.chunks:
            entry = self.seen.get(chunk.seq) or self.closing.get(chunk.seq)
            kept = committed.get(chunk.seq, 0)
            if entry is None or kept <= 0:
                continue
            entry[1].extend(output.tokens.get(chunk.seq, [])[:kept])  # the tokens those rows sampled
        for tokens, tail in self.closing.values():
            self.book.add(tokens + tuple(tail))
        self.closing.clear()

    def release_sequence(self, seq: int) -> None:
        entry = self.seen.pop(seq, None)
        self.following.pop(seq, None)
        self.first_seen.pop(seq, None)
        if entry is not None:
            self.closing[seq] = entry
        self.inner.release_sequence(seq)
        self._write_counts()

    def _write_counts(self) -> None:
        path = stats_path(self.accept)
        if path is None:
            return
        try:
            with open(path + ".tmp", "w", encoding="utf-8") as out:
                json.dump(attrs.asdict(self.counts), out)
            os.replace(path + ".tmp", path)
        except OSError as exc:  # a diagnosis only: the replay goes on without it
            log.warning("dflash benchmark replay: cannot write %s: %s", path, exc)

    # -- lookup ----------------------------------------------------------------------
    def _recording(self, seq: int, tokens: tuple[int, ...]) -> tuple[int, ...] | None:
        followed = self.following.get(seq)
        n = len(tokens)
        if followed is not None and len(followed) > n and followed[n - 1] == tokens[-1] \
                and followed[max(0, n - 64):n] == tokens[max(0, n - 64):]:
            return followed  # still on it (the engine's tokens only grow while decoding)
        recorded = self.book.find(tokens)
        first = seq not in self.first_seen
        if first:
            self.first_seen[seq] = n
            if recorded is not None:
                self.counts.followed += 1
            else:
                self.counts.unmatched += 1
                self.counts.first_token_differs += self.book.find(tokens[:-1]) is not None
        elif recorded is None and followed is not None and len(followed) > n:
            self.counts.left += 1  # the target's tokens went another way than every recording's
            self.counts.left_after.append(n - self.first_seen[seq])
        if recorded is None:
            self.following.pop(seq, None)
        else:
            self.following[seq] = recorded
        return recorded


def benchmark_replay(speculator: Any, n_draft: int, environ: dict[str, str] | None = None) -> Any:
    """``speculator`` itself, or wrapped in a :class:`ReplaySpeculator` when ``MUSEGL_DFLASH_BENCHMARK_ACCEPT``
    is set. A fixed ``K`` must fit the drafts per step (``1 <= K <= n_draft + 1``); a file must exist."""
    spec = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not spec:
        return speculator
    if spec.isdigit():
        if not 0 <= int(spec) <= n_draft + 1:
            raise ConfigError(f"{ENV}={spec}: the acceptance length must be between 1 and {n_draft + 1} "
                              f"(drafts per step + 1), or 0 to record only")
    elif not os.path.isfile(spec):
        raise ConfigError(f"{ENV}={spec}: neither an acceptance length nor a file holding one")
    from musegl_core.engine.speculator import proposes_on_device

    cls = ReplayOnDevice if proposes_on_device(speculator) else ReplaySpeculator
    return cls(speculator, AcceptanceSource(spec))


class ReplayOnDevice(ReplaySpeculator):
    """The replay over a speculator that leaves its drafts on the device (``propose_on_device``):
    the draft forward runs as it does, then the replayed ids overwrite the leading columns of
    each sequence's row there (one small copy to the device per step), so the step keeps the
    executor's device-draft path."""

    def propose_on_device(self, requests: Sequence[DraftRequest]) -> Any:
        import torch

        found = self.inner.propose_on_device(requests)
        accept = self.accept.current()
        rows, cols, values = [], [], []
        for r in requests:
            tokens = tuple(r.tokens)
            self.seen[r.seq] = (tokens, [])
            if accept < 1 or r.seq not in found.rows:
                continue
            recorded = self._recording(r.seq, tokens)
            if recorded is None:
                self.counts.drafted_blocks += 1
                continue
            lead = replace_drafts(recorded, len(tokens), [], found.counts[r.seq], accept)
            rows += [found.rows[r.seq]] * len(lead)
            cols += range(len(lead))
            values += lead
            self.counts.replayed_blocks += 1
        write = getattr(self.inner, "write_drafts", None)  # drafts on tensor-parallel ranks
        if values and write is not None:
            write(found, rows, cols, values)
        elif values:
            ids = found.ids
            with torch.inference_mode():  # one copy to the device (three cost ~0.9 ms a step on an H200's host)
                at = torch.tensor([rows, cols, values], dtype=torch.long).to(ids.device)
                ids[at[0], at[1]] = at[2].to(ids.dtype)
        return found
