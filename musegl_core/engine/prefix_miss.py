"""Why a prompt prefix missed: the cause of a request reusing less than the server held (issue 45 item 6).

Users blame servers for cache misses that their client or template caused.
When a request reuses fewer prompt positions than a sequence the server held
for it would have given, the engine names the cause (:class:`PrefixMiss`),
which the front counts (``musegl_prefix_cache_miss_total{cause=...}``), logs
on the request's summary line and returns in the ``X-Prefix-Cache-Miss``
response header (docs/sessions.md, "Why a prefix missed").

What the server held for a request:

* its session's (named or soft) transcript, when the session is still open;
* the transcript of the session of that name that was evicted or expired
  (:class:`PrefixHistory` remembers the last few, with the reason);
* the recent prompts of other requests (the prefix cache's content), for a
  request that starts from the prefix cache.

The causes:

* ``evicted`` / ``expired``: the held sequence matches the prompt further
  than what was reused, and it is gone (a session evicted for a slot or idled
  out; prefix-cache blocks evicted for memory: ``evicted``);
* ``salt``: the matching sequence was computed under another ``cache_salt``;
* the prompt itself diverges from the held sequence before its end, and the
  two join again shortly after (a local difference, not another conversation).
  Classified by where the difference lies: ``reasoning`` (inside an assistant
  reasoning message: reasoning dropped or changed), ``template`` (at a control
  token, or in a template-written line: date, reasoning strength), ``nonce``
  (a short run of hex or digits that differs, such as a per-request id in a
  system prompt), else ``history_edited``.
"""

from __future__ import annotations

import collections
import re
from typing import Any, Sequence

import attrs


CAUSES = ("history_edited", "reasoning", "nonce", "salt", "evicted", "expired", "template")
#: characters of text shown on each side of the divergence
CONTEXT_CHARS = 48
#: how far (tokens) after the divergence the two sequences are searched for joining again
REJOIN_WINDOW = 64
#: a rejoin counts when this many tokens agree again
REJOIN_RUN = 16
_NONCE = re.compile(r"[0-9A-Fa-f._:-]{1,40}")
_TEMPLATE_LINES = ("Current date: ", "Knowledge cutoff: ", "Reasoning strength: ")


@attrs.frozen
class PrefixMiss:
    """A request reused ``reused`` positions where the server held ``held`` matching ones
    (``held`` may be smaller than the held sequence: it is what this prompt could have used).
    ``position`` is the first position where the prompt and the held sequence differ
    (for ``evicted`` / ``expired`` / ``salt``: where reuse stopped); ``before``, the text
    just before it; ``held_text`` and ``prompt_text``, the text after it on each side."""

    cause: str
    position: int
    held: int
    reused: int
    before: str = ""
    held_text: str = ""
    prompt_text: str = ""




def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share: slices of doubling length are compared (C loops),
    so an early difference costs microseconds and a long shared prefix a few slice compares."""
    n = min(len(a), len(b))
    lo, step = 0, 64
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            while a[lo] == b[lo]:
                lo += 1
            return lo
        lo, step = hi, step * 2
    return n


def _rejoin_at(held: Sequence[int], prompt: Sequence[int], at: int, run: int) -> tuple[int, int] | None:
    """Where the two sequences agree again on ``run`` tokens within REJOIN_WINDOW after ``at``:
    ``(index in held, index in prompt)``, or None."""
    grams: dict[tuple, int] = {}
    for j in range(at + 1, min(len(prompt) - run + 1, at + REJOIN_WINDOW)):
        grams.setdefault(tuple(prompt[j:j + run]), j)
    for i in range(at + 1, min(len(held) - run + 1, at + REJOIN_WINDOW)):
        j = grams.get(tuple(held[i:i + run]))
        if j is not None:
            return i, j
    return None


def _rejoins(held: Sequence[int], prompt: Sequence[int], at: int) -> bool:
    return _rejoin_at(held, prompt, at, REJOIN_RUN) is not None


class PrefixHistory:
    """What the engine held and lost, kept to explain later misses: the transcripts of
    the last ``keep`` sessions that were evicted or expired, and the last ``keep``
    prompts that ran (with their salt), for requests that start from the prefix cache."""

    def __init__(self, tokenizer: Any, keep: int = 8):
        self.tokenizer = tokenizer
        self.dropped: collections.OrderedDict[str, tuple[str, tuple, str | None]] = collections.OrderedDict()
        self.recent: collections.deque[tuple[tuple, str | None]] = collections.deque(maxlen=keep)
        self.keep = keep

    # -- what the engine tells it ----------------------------------------------------------
    def lost(self, name: str | None, reason: str, tokens: Sequence[int], salt: str | None) -> None:
        """Session ``name`` was dropped (``evicted`` or ``expired``) holding ``tokens``."""
        if name is None or not tokens:
            return
        self.dropped[name] = (reason, tuple(tokens), salt)
        self.dropped.move_to_end(name)
        while len(self.dropped) > self.keep:
            self.dropped.popitem(last=False)

    def ran(self, prompt: Sequence[int], salt: str | None) -> None:
        """A prompt ran (its blocks went to the prefix cache). The same prompt again replaces its entry."""
        prompt = tuple(prompt)
        if self.recent and self.recent[-1][0] == prompt and self.recent[-1][1] == salt:
            return
        self.recent.append((prompt, salt))

    # -- the diagnosis ---------------------------------------------------------------------
    def diagnose(self, *, name: str | None, new: bool, held: Sequence[int], salt: str | None,
                 prompt: Sequence[int], reused: int, block_size: int) -> PrefixMiss | None:
        """The miss of a request on session ``name`` (None: anonymous; ``new``: opened for
        this request) whose session held ``held`` before it, that reused ``reused``."""
        prompt, held = tuple(prompt), tuple(held)  # compared many times: tuples are not copied again
        limit = len(prompt) - 1  # the last prompt position always runs
        if not new and held:
            return self._diverged(held, prompt, reused, limit)
        if name is not None and name in self.dropped:
            reason, tokens, old_salt = self.dropped.pop(name)
            if old_salt == salt:
                matched = min(common_prefix(tokens, prompt), limit)
                if matched >= reused + block_size:
                    return self._miss(reason, reused, matched, reused, tokens, prompt)
                diverged = self._diverged(tokens, prompt, reused, limit)
                if diverged is not None:
                    return diverged
        same, same_tokens, other, other_tokens = 0, (), 0, ()
        for tokens, old_salt in self.recent:
            matched = min(common_prefix(tokens, prompt), limit)
            if old_salt == salt and matched > same:
                same, same_tokens = matched, tokens
            elif old_salt != salt and matched > other:
                other, other_tokens = matched, tokens
        if same >= reused + block_size:  # it ran here, its blocks are gone
            return self._miss("evicted", reused, same, reused, same_tokens, prompt)
        if other >= reused + block_size:  # computed under another cache_salt
            return self._miss("salt", reused, other, reused, other_tokens, prompt)
        for tokens, old_salt in reversed(self.recent):
            if old_salt == salt:
                diverged = self._diverged(tokens, prompt, reused, limit, rejoin=True)
                if diverged is not None:
                    return diverged
        return None

    def _diverged(self, held: Sequence[int], prompt: Sequence[int], reused: int, limit: int,
                  rejoin: bool = False) -> PrefixMiss | None:
        """The prompt departs from ``held`` before ``held`` ends (a session's next turn must
        extend its history); ``rejoin``: only when the two join again shortly after (for
        other requests' prompts: a local difference, not another conversation)."""
        at = common_prefix(held, prompt)
        if at >= len(held) or at >= limit or reused > at:  # extends it, or reused more from elsewhere
            return None
        if rejoin and not _rejoins(held, prompt, at):
            return None
        return self._miss(self._cause(held, prompt, at), at, len(held), reused, held, prompt)

    def _cause(self, held: Sequence[int], prompt: Sequence[int], at: int) -> str:
        text = self._text
        specials = self._special_ids()
        if held[at] in specials or (at < len(prompt) and prompt[at] in specials):
            return "template"
        window = text(held[max(0, at - 1024):at])
        line = window.rsplit("\n", 1)[-1]
        if any(marker in line for marker in _TEMPLATE_LINES):
            return "template"
        opened = window.rfind("<|start|>assistant")
        header = (window + text(held[at:at + 8]))[opened:opened + 64]
        if opened >= 0 and "to=self" in header and not any(end in window[opened:] for end in ("<|eom|>", "<|eot|>")):
            return "reasoning"  # inside (or at the header of) a reasoning message the prompt no longer has
        held_run, prompt_run = self._differing(held, prompt, at)
        if held_run and prompt_run and _NONCE.fullmatch(held_run.strip()) and _NONCE.fullmatch(prompt_run.strip()):
            return "nonce"
        return "history_edited"

    def _differing(self, held: Sequence[int], prompt: Sequence[int], at: int) -> tuple[str, str]:
        """The text that differs on each side, up to where the two join again (empty: no join)."""
        found = _rejoin_at(held, prompt, at, 4)
        if found is None:
            return "", ""
        i, j = found
        return self._text(held[at:i]), self._text(prompt[at:j])

    def _miss(self, cause: str, position: int, held: int, reused: int, held_tokens: Sequence[int],
              prompt: Sequence[int]) -> PrefixMiss:
        text = self._text
        before = text(prompt[max(0, position - 16):position])[-CONTEXT_CHARS:]
        return PrefixMiss(cause, position, held, reused, before,
                          text(held_tokens[position:position + 16])[:CONTEXT_CHARS],
                          text(prompt[position:position + 16])[:CONTEXT_CHARS])

    def _text(self, ids: Sequence[int]) -> str:
        # image rows are negative keys (engine/identity.py): shown as one placeholder each
        return b"".join(self.tokenizer.token_bytes(int(i)) if i >= 0 else b"\xef\xbf\xbc"
                        for i in ids).decode("utf-8", "replace")

    def _special_ids(self) -> frozenset[int]:
        cached = getattr(self, "_specials", None)
        if cached is None:
            special = getattr(self.tokenizer, "special_ids", None)
            cached = self._specials = frozenset(special()) if special is not None else frozenset()
        return cached
