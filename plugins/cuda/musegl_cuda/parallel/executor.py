"""``TensorParallelExecutor``: the executor the engine sees, its model spread over N rank processes.

The engine's process holds no model and no device state: it writes each request
(a step, a block copy, the KV allocation, an image) once into the shared-memory
:class:`~.channel.StepChannel` that every rank reads, and reads rank 0's answers
from a second one. :meth:`launch` returns as soon as the step is written, so the
engine plans the next step (and launches it, where it follows this one's ids)
while the ranks compute.

A rank that dies is noticed at once (a thread waits on the rank processes):
the steps in flight and every later call raise :class:`RankFailure`, the other
ranks are stopped (a collective with a dead peer would wait forever), and
``on_failure`` is called with the reason; the cuda plugin passes one that ends
the process a second after its failed requests are answered (exit status 3):
under ``musegl serve`` that is the worker, and the front restarts it with
fresh ranks (the KV cache died with the ranks: nothing short of a new worker
starts from a clean state); ``musegl generate`` ends with that status.

A speculator may live on the ranks too (:meth:`speculator_on_ranks`, a DFlash
draft: :mod:`.speculator`), replicated on every rank; or beside the engine,
borrowing the target's embedding and head through the ranks (TargetAccess:
:meth:`embedding_rows`, :meth:`head_logits`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from multiprocessing.connection import wait as wait_for_processes
from typing import Any, Callable, Sequence

import attrs

from musegl_core.engine.executor import PromptImage, Step, StepOutput
from musegl_core.engine.memory import available_ram
from musegl_cuda.parallel import messages as msg
from musegl_cuda.parallel.messages import RankFailure
from musegl_cuda.parallel.channel import PeerGone, StepChannel
from musegl_cuda.parallel.rank import RankSpec, run_rank, text_config

log = logging.getLogger("musegl.cuda")

#: bytes per slot of the request ring (a step of 4096 rows with masks fits; larger ones get a segment)
REQUEST_SLOT = 4 << 20
#: bytes per slot of the answer ring (decode answers are small; logits of many rows get a segment)
REPLY_SLOT = 1 << 20


def wire_step(step: Step) -> Step:
    """``step`` as it crosses to the ranks: grammar masks computed (a :class:`PendingMasks`
    waits for its task here), and only the rows of an image embedding the step uses, as a
    :class:`~.messages.HostTensor` (one copy of their bytes)."""
    import torch

    chunks = []
    for chunk in step.chunks:
        if not chunk.masks and not chunk.embeds:
            chunks.append(chunk)
            continue
        masks = list(chunk.masks) if chunk.masks else chunk.masks
        embeds = []
        for span in chunk.embeds:
            rows = span.embedding[span.first:span.first + span.count]
            if isinstance(rows, torch.Tensor):
                rows = msg.HostTensor.of(rows)
            embeds.append(attrs.evolve(span, embedding=rows, first=0))
        chunks.append(attrs.evolve(chunk, masks=masks, embeds=tuple(embeds)))
    return attrs.evolve(step, chunks=chunks)


class RankPending:
    """A step written to the ranks; :meth:`result` waits for rank 0's answer."""

    def __init__(self, executor: "TensorParallelExecutor", number: int) -> None:
        self.executor, self.number = executor, number

    def result(self) -> StepOutput:
        return self.executor._answer(self.number)


class TensorParallelExecutor:
    """The :class:`~musegl_core.engine.executor.AsyncExecutor` (and TargetAccess) contract
    over ``spec.size`` rank processes; see the module docstring."""

    def __init__(self, spec: RankSpec, on_failure: Callable[[str], None] | None = None) -> None:
        import torch.multiprocessing as tmp

        self.spec = spec
        self.on_failure = None  # a rank that dies while loading fails the load (below), nothing more
        self.failure: str | None = None
        self._closing = False
        ctx = tmp.get_context("spawn")
        self.requests = StepChannel.create(ctx, spec.size, slot_bytes=REQUEST_SLOT)
        self.replies = StepChannel.create(ctx, 1, slot_bytes=REPLY_SLOT)
        self._store = tempfile.mkdtemp(prefix="musegl-tp-")
        self._numbers = 0
        self._answers: dict[int, msg.Reply] = {}
        self._lock = threading.Lock()  # one reader of the answer ring at a time
        store = os.path.join(self._store, "store")
        self.ranks = [ctx.Process(target=run_rank, args=(r, spec, store, self.requests, self.replies, os.getpid()),
                                  name=f"musegl-rank-{r}", daemon=True) for r in range(spec.size)]
        for process in self.ranks:
            process.start()
        self._watcher = threading.Thread(target=self._watch, name="musegl-tp-watch", daemon=True)
        self._watcher.start()
        try:
            loaded: msg.Loaded = self._answer(0)
        except BaseException:
            self.close()
            raise
        self._numbers = 1
        self.info = loaded.info
        self.config = text_config(spec)  # the whole model's (each rank's layers hold a share of its heads)
        self.limits = loaded.limits
        self.block_size = loaded.block_size
        self.loaded = loaded
        self.weight_bytes = loaded.weight_bytes
        self.on_failure = on_failure
        log.info("tensor parallel: %d ranks on %s (pids %s)", spec.size, spec.device,
                 ", ".join(map(str, loaded.pids)))

    # -- the ranks ---------------------------------------------------------------------

    def _watch(self) -> None:
        """Wait on the rank processes; the first to end before :meth:`close` is a failure."""
        sentinels = {p.sentinel: r for r, p in enumerate(self.ranks)}
        ended = wait_for_processes(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ended[0]]
        self.ranks[rank].join(1.0)  # reaped: its exit status (or -signal) is known
        code = self.ranks[rank].exitcode
        self._fail(f"tensor-parallel rank {rank} (pid {self.ranks[rank].pid}) exited with status {code}")

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        log.error("%s; stopping the other ranks", reason)
        self._stop_ranks()
        if self.on_failure is not None:
            self.on_failure(reason)

    def _alive(self) -> bool:
        return self.failure is None

    def _stop_ranks(self, grace: float = 2.0) -> None:
        for process in self.ranks:
            if process.is_alive():
                process.terminate()
        for process in self.ranks:
            process.join(grace)
            if process.is_alive():
                process.kill()
                process.join(grace)

    def _send(self, request: Any) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)
        try:
            self.requests.write(request, self._alive)
        except PeerGone:
            raise RankFailure(self.failure or "a tensor-parallel rank is gone") from None

    def _number(self) -> int:
        number, self._numbers = self._numbers, self._numbers + 1
        return number

    def _answer(self, number: int) -> Any:
        """Rank 0's answer to request ``number`` (answers come in request order; earlier
        ones are kept for their own callers)."""
        with self._lock:
            while number not in self._answers:
                if self.failure is not None:
                    raise RankFailure(self.failure)
                try:
                    reply = self.replies.read(0, self._alive)
                except PeerGone:
                    raise RankFailure(self.failure or "a tensor-parallel rank is gone") from None
                self._answers[reply.number] = reply
            reply = self._answers.pop(number)
        if reply.error is not None:
            raise reply.error
        return msg.unpack(reply.value)

    def _call(self, request: Any) -> Any:
        self._send(request)
        return self._answer(request.number)

    # -- the ranks' channel, for what the ranks host beside the model (RankSpeculator) --

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` has begun (nothing more is sent to release)."""
        return self._closing

    def send(self, request: Any) -> None:
        """Write a request that has no answer (``number`` None) to every rank."""
        self._send(request)

    def ask(self, make: Callable[[int], Any]) -> Any:
        """Write ``make(number)``, a request numbered for its answer, and return rank 0's answer."""
        return self._call(make(self._number()))

    # -- the executor contract ---------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        """On the CPU the ranks share the host's memory: the sum of their blocks; on CUDA
        each device holds its own: the largest."""
        per_rank = self.loaded.kv_bytes_per_block
        return sum(per_rank) if self.spec.device == "cpu" else max(per_rank)

    def kv_memory_available(self) -> int | None:
        if self.spec.device == "cpu":
            return available_ram()
        free = [f for f in self.loaded.free_memory if f is not None]
        return min(free) if free else None

    def expect_taps(self, taps: Sequence[int]) -> None:
        """The speculator's taps, before :meth:`allocate_kv` (the ranks capture their graphs with them)."""
        self._call(msg.ExpectTaps(self._number(), tuple(taps)))

    def use_sliding_pages(self) -> tuple[int, int, int] | None:
        """Every rank keeps its sliding layers' window in pages of layer groups (its share of
        the heads; ``TorchExecutor.use_sliding_pages``); the steps carry the group tables."""
        return self._call(msg.UseSlidingPages(self._number()))

    def allocate_kv(self, num_blocks: int) -> None:
        limits = self._call(msg.AllocateKV(self._number(), num_blocks))
        if limits is not None:  # rank 0's, after its cache: on CUDA the lone-prompt chunk fits the memory left
            self.limits = limits

    def step(self, step: Step) -> StepOutput:
        return self.launch(step).result()

    def launch(self, step: Step) -> RankPending:
        number = self._number()
        self._send(msg.RunStep(number, wire_step(step)))
        return RankPending(self, number)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self._send(msg.CopyBlocks([tuple(p) for p in pairs]))

    def embed_image(self, image: PromptImage) -> Any:
        return self._call(msg.EmbedImage(self._number(), image))

    def embedding_rows(self, ids: Any) -> Any:
        """TargetAccess (a draft's input embedding), computed by the ranks; a CPU tensor."""
        return self._call(msg.EmbeddingRows(self._number(), ids))

    def head_logits(self, hidden: Any) -> Any:
        """TargetAccess (a draft's head), computed by the ranks; a CPU tensor."""
        import torch

        return self._call(msg.HeadLogits(self._number(), msg.HostTensor.of(torch.as_tensor(hidden))))

    def speculator_on_ranks(self, factory: str, args: tuple = ()) -> Any:
        """A speculator hosted on the ranks (replicated: each builds it on its device with
        ``factory(RankTarget, *args)``, ``factory`` a ``"module:function"`` name), as the
        :class:`~.speculator.RankSpeculator` the engine talks to. The ranks' free memory is
        measured again once it is loaded (the KV pool is sized from what is left)."""
        from musegl_cuda.parallel.speculator import RankSpeculator

        loaded: msg.SpeculatorLoaded = self._call(msg.HostSpeculator(self._number(), factory, tuple(args)))
        self.loaded = attrs.evolve(self.loaded, free_memory=list(loaded.free_memory))
        log.info("tensor parallel: speculator %s on every rank (%d taps, %d drafts per step)", factory,
                 len(loaded.taps), loaded.max_draft)
        return RankSpeculator(self, loaded)

    def release_sequence(self, seq: int) -> None:
        """The ranks' sampler graphs keep a penalized sequence's counts: drop them. Once a
        rank has failed there is nothing left to release (and the engine is ending this
        sequence because of that failure), so nothing is raised."""
        if self.failure is not None or self._closing:
            return
        try:
            self._send(msg.ReleaseSequence(seq))
        except RankFailure:
            pass

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.failure is None and any(p.is_alive() for p in self.ranks):
            try:
                self.requests.write(msg.Shutdown(), lambda: all(p.is_alive() for p in self.ranks))
            except PeerGone:
                pass
            for process in self.ranks:
                process.join(10.0)
        self._stop_ranks()
        self.requests.close()
        self.replies.close()
        shutil.rmtree(self._store, ignore_errors=True)


def exit_worker_after(seconds: float = 1.0) -> Callable[[str], None]:
    """An ``on_failure`` that ends this process (status 3) ``seconds`` after a rank died:
    time for the engine to answer the requests that failed, then the front restarts
    the worker with fresh ranks."""

    def exit_soon(reason: str) -> None:
        def end() -> None:
            log.error("ending the worker: %s (the front starts a new one)", reason)
            os._exit(3)

        timer = threading.Timer(seconds, end)
        timer.daemon = True
        timer.start()

    return exit_soon
