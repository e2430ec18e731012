"""``RankSpeculator``: the engine's speculator contract over a speculator hosted on the ranks.

:meth:`TensorParallelExecutor.speculator_on_ranks` builds a speculator (a DFlash
draft) on every rank, replicated: each rank holds the draft and its per-block
state on its own device and drafts with its share of the target's embedding and
head (:class:`~.rank.RankTarget`), so every rank computes the same drafts from
the same requests and no drafts cross between ranks. The engine's side holds
nothing of it; this class turns each call of the contract into a request on the
channel, in the order the engine makes them, so the ranks see the calls a
speculator beside a one-device executor sees:

* ``propose_on_device`` writes the requests and returns at once: the drafts stay
  on the ranks' devices, and the step that verifies them names them
  (:class:`~.messages.RankDrafts`); their rows and counts follow from the
  requests alone (:func:`~.rank.hosted_rows`), so nothing is waited for;
* ``propose`` (a step whose masks or penalties the host computes from the
  drafts) waits for rank 0's drafts;
* a request's ``tokens`` cross as the speculator's ``token_tail`` trailing ids
  and their count (:class:`~.messages.TokenTail`), where it declares one;
* ``observe`` names the step whose tapped rows the ranks kept (rank 0's answer
  carries a :class:`~.messages.RankRows` for them, not the rows);
* ``allocate_kv``, ``copy_blocks``, ``release_sequence`` go to every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import attrs

from musegl_core.engine.executor import Step, StepOutput
from musegl_core.engine.speculator import DeviceDrafts, DraftRequest
from musegl_cuda.parallel import messages as msg
from musegl_cuda.parallel.messages import RankFailure
from musegl_cuda.parallel.rank import hosted_rows

class RankChannel(Protocol):
    """What the hosted speculator needs of the tensor-parallel executor: the
    ranks' request channel (:class:`~.executor.TensorParallelExecutor` provides it)."""

    spec: Any  # the ranks' layout: ``size``, ``device``
    failure: str | None  # set once a rank failed

    @property
    def closing(self) -> bool: ...

    def send(self, request: Any) -> None: ...

    def ask(self, make: Callable[[int], Any]) -> Any: ...


class RankSpeculator:
    """See the module docstring."""

    def __init__(self, executor: RankChannel, loaded: msg.SpeculatorLoaded) -> None:
        self.executor = executor
        self.taps = tuple(loaded.taps)
        self.max_draft = loaded.max_draft
        self.per_rank_kv = loaded.kv_bytes_per_block
        self.token_tail = loaded.token_tail
        #: the hosted speculator's (``--sliding-window-kv``: DFlash's store follows the pages)
        self.follows_sliding_pages = loaded.follows_sliding_pages
        self._keys = 0

    def kv_bytes_per_block(self) -> int:
        """As the executor counts its own: the ranks' sum on the CPU (one host's memory),
        one rank's on CUDA (each device holds a replica)."""
        ex = self.executor
        return self.per_rank_kv * (ex.spec.size if ex.spec.device == "cpu" else 1)

    def allocate_kv(self, num_blocks: int) -> None:
        ex = self.executor
        ex.ask(lambda number: msg.DraftAllocate(number, num_blocks))

    def _key(self) -> int:
        key, self._keys = self._keys, self._keys + 1
        return key

    def _wire(self, requests: list[DraftRequest]) -> list[DraftRequest]:
        """The requests as they cross: only the trailing ids the speculator reads (a long
        context's every id pickled per step would cost more than the draft)."""
        tail = self.token_tail
        if tail is None:
            return requests
        return [attrs.evolve(r, tokens=msg.TokenTail(len(r.tokens), tuple(r.tokens[len(r.tokens) - tail:])))
                if len(r.tokens) > tail else r for r in requests]

    def propose(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]:
        ex = self.executor
        return ex.ask(lambda number: msg.Propose(number, self._key(), self._wire(list(requests))))

    def propose_on_device(self, requests: Sequence[DraftRequest]) -> DeviceDrafts:
        requests = list(requests)
        rows, counts = hosted_rows(requests, self.max_draft)
        if not rows:
            return DeviceDrafts(None, {}, {})
        key = self._key()
        self.executor.send(msg.Propose(None, key, self._wire(requests)))
        return DeviceDrafts(msg.RankDrafts(key), rows, counts)

    def write_drafts(self, found: DeviceDrafts, rows: list[int], cols: list[int], values: list[int]) -> None:
        """Overwrite ids of drafts :meth:`propose_on_device` left on the ranks (``values[i]`` at
        ``rows[i]``, ``cols[i]``), on every rank alike: the benchmark's replay."""
        if values and isinstance(found.ids, msg.RankDrafts):
            self.executor.send(msg.WriteDrafts(found.ids.key, list(rows), list(cols), list(values)))

    def observe(self, step: Step, output: StepOutput, committed: dict[int, int]) -> None:
        kept = next((h for h in output.hidden.values() if isinstance(h, msg.RankRows)), None)
        if kept is not None:
            self.executor.send(msg.Observe(kept.number, dict(committed)))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self.executor.send(msg.DraftCopyBlocks([tuple(p) for p in pairs]))

    def release_sequence(self, seq: int) -> None:
        """As the executor's: nothing is left to release once a rank has failed."""
        ex = self.executor
        if ex.failure is not None or ex.closing:
            return
        try:
            ex.send(msg.DraftRelease(seq))
        except RankFailure:
            pass

    def close(self) -> None:
        pass  # the hosted speculator ends with the ranks (the executor's close)
