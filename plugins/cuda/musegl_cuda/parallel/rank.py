"""The process of one tensor-parallel rank: a sharded :class:`~musegl_cuda.executor.TorchExecutor`.

Spawned by :class:`~musegl_cuda.parallel.executor.TensorParallelExecutor`, one per
device (``cuda:R``; on the CPU every rank shares the host, with its share of the
cores). The ranks join one ``torch.distributed`` group through a file store:
NCCL for the device collectives on CUDA with a gloo group beside it for
control; gloo for both on the CPU. Each rank opens the checkpoint itself and
keeps only its rows and columns of each weight (:mod:`.shard`), one tensor at a
time, so no process ever holds the whole model.

Then every rank runs the same requests in the same order (:mod:`.messages`, read
from the :class:`~.channel.StepChannel`): the same step, the same sampler over
the same gathered logits, the same ids. Rank 0 answers. A speculator hosted on
the ranks (:class:`~.messages.HostSpeculator`, a DFlash draft) is replicated the
same way: every rank holds it and its per-block state on its own device, drafts
with its share of the target's embedding and head (:class:`RankTarget`), keeps
the drafts for the step that verifies them, and keeps each step's tapped rows
for the speculator's :class:`~.messages.Observe`. A rank whose request
fails on its input (``ValueError`` and the like, raised before any collective,
alike on every rank) answers with the error and carries on; any other failure
ends the rank, which the engine's side sees as a dead rank.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import sys
import time
from typing import Any

import attrs

from musegl_cuda.parallel import messages as msg
from musegl_cuda.parallel.channel import PeerGone, StepChannel

log = logging.getLogger("musegl.cuda")

#: errors a request's input causes on every rank alike (before any collective): answered, not fatal
INPUT_ERRORS = (ValueError, KeyError, IndexError, TypeError)
#: seconds between two looks at the device and the requests while a launched step runs
IDLE_POLL = 20e-6


@attrs.frozen
class RankSpec:
    """How every rank builds its executor (the serve options that reach the ranks)."""

    model: str
    device: str  # "cpu" or "cuda"
    size: int
    dtype: str | None = None
    weights: str | None = None
    forward_sizes: tuple[int, ...] | None = None
    async_steps: bool | None = None
    dummy: bool = False  # --load-format dummy: random weights (seeded), a config only
    mmproj: str | None = None
    log_level: str = "info"
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: every rank stores its KV heads alike

    def device_of(self, rank: int) -> str:
        return f"cuda:{rank}" if self.device == "cuda" else "cpu"


def build_executor(spec: RankSpec, rank: int, shard):
    """This rank's :class:`TorchExecutor` over its part of the checkpoint."""
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.checkpoint.vision import load_vision
    from musegl_cuda.executor import TorchExecutor
    from musegl_cuda.config_only import read_config_only

    device = spec.device_of(rank)
    if spec.dummy:
        return TorchExecutor(read_config_only(spec.model), device=device, dtype=spec.dtype,  # type: ignore[arg-type]
                             forward_sizes=spec.forward_sizes, dummy_seed=rank, async_steps=spec.async_steps,
                             shard=shard, kv_cache_dtype=spec.kv_cache_dtype)
    checkpoint = load_checkpoint(spec.model)
    vision = None
    try:
        vision = load_vision(spec.model, spec.mmproj, checkpoint.config.hidden_size)
        return TorchExecutor(checkpoint, device=device, dtype=spec.dtype, forward_sizes=spec.forward_sizes,
                             vision=vision, weights=spec.weights, async_steps=spec.async_steps, shard=shard,
                             kv_cache_dtype=spec.kv_cache_dtype)
    finally:
        checkpoint.close()
        if vision is not None:
            vision.close()


def text_config(spec: RankSpec):
    from musegl_cuda.config_only import read_config_only

    return read_config_only(spec.model).config


def portable(error: BaseException) -> BaseException:
    """``error`` as it can cross to the engine's process (its own type where it pickles)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class RankTarget:
    """What a speculator hosted on a rank sees of the target: the rank's executor's
    model facts and its TargetAccess, the embedding rows (a vocabulary-parallel lookup,
    summed over the ranks) and the head (logits gathered over the ranks), and
    :meth:`head_argmax`, the head's argmax without gathering the logits. Every method
    is a collective: every rank calls it with the same arguments (a factory building a
    speculator calls none of them: a rank that fails to build it must not leave the
    others waiting in one)."""

    def __init__(self, executor, shard) -> None:
        self.executor, self.shard = executor, shard
        self.info = executor.info
        self.block_size = executor.block_size
        self.device = executor.device
        self.dtype = executor.dtype  # the activation dtype, which embedding_rows returns

    def embedding_rows(self, ids):
        return self.executor.embedding_rows(ids)

    def head_logits(self, hidden):
        return self.executor.head_logits(hidden)

    def head_argmax(self, hidden):
        """The argmax over the whole vocabulary of the raw head product of ``(n, hidden)``
        rows: ``(n,)`` int64 on the device, the same ids on every rank."""
        import torch

        model = self.executor.model
        hidden = torch.as_tensor(hidden, device=self.device)
        local = model.lm_head(hidden.float() if model.stored else hidden.to(model.dtype))
        return self.shard.argmax_vocab(local)


def load_factory(name: str):
    """``"module:function"`` as the function."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


class Rank:
    """One rank's loop over the requests; see the module docstring."""

    def __init__(self, spec: RankSpec, rank: int, requests: StepChannel, replies: StepChannel,
                 parent: int, control, executor, shard=None) -> None:
        self.spec, self.rank = spec, rank
        self.requests, self.replies = requests, replies
        self.parent = parent
        self.control = control  # the gloo group for control (barriers, gathering small objects)
        self.executor = executor
        self.shard = shard
        # (number, pending, step) of a step launched, not answered
        self.inflight: tuple[int, Any, Any] | None = None
        self.speculator: Any = None  # a hosted speculator (HostSpeculator), if any
        self.drafts: dict[int, Any] = {}  # Propose key -> the drafts on the device (or the error making them)
        self.tapped: dict[int, tuple[Any, Any]] = {}  # step number -> (step, output) until its Observe

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent

    def answer(self, number: int, value: Any = None, error: BaseException | None = None) -> None:
        if self.rank == 0:
            self.replies.write(msg.Reply(number, msg.pack(value), None if error is None else portable(error)),
                               self.parent_alive)

    def loaded(self) -> None:
        import torch
        import torch.distributed as dist

        ex = self.executor
        free = None
        if ex.device.type == "cuda":
            free = int(torch.cuda.mem_get_info(ex.device)[0])
        mine = (ex.kv_bytes_per_block(), free, ex.weight_bytes, os.getpid())
        every: list = [None] * self.spec.size
        dist.all_gather_object(every, mine, group=self.control)
        weights: dict[str, int] = {}
        for _, _, part, _ in every:
            for k, v in part.items():
                weights[k] = weights.get(k, 0) + v
        self.answer(0, msg.Loaded(ex.info, ex.limits, ex.block_size, [e[0] for e in every],
                                  [e[1] for e in every], weights, [e[3] for e in every]))

    def serve(self) -> None:
        """Run the requests in order. On an asynchronous executor (CUDA) a launched step is
        answered once the next request has been launched or the device is done with it,
        whichever comes first: the next step is staged while this one runs, as the engine
        pipelines steps on one GPU."""
        while True:
            request = self.next_request()
            if isinstance(request, msg.Shutdown):
                self.settle()
                return
            if isinstance(request, msg.RunStep) and self.executor.limits.async_steps:
                self.launch(request)
            else:
                self.run(request)

    def next_request(self) -> Any:
        if self.inflight is None:
            return self.requests.read(self.rank, self.parent_alive)
        while True:
            request = self.requests.poll(self.rank)
            if request is not None:
                return request
            if self.device_idle():
                self.settle()
                return self.requests.read(self.rank, self.parent_alive)
            if not self.parent_alive():
                raise PeerGone("the engine's process is gone")
            time.sleep(IDLE_POLL)

    def device_idle(self) -> bool:
        import torch

        device = self.executor.device
        return device.type != "cuda" or torch.cuda.current_stream(device).query()

    def launch(self, request: msg.RunStep) -> None:
        """Launch the step; then answer the step launched before it."""
        try:
            step = self.rank_step(request.step)
            pending = self.executor.launch(step)
        except Exception as exc:
            self.failed(request.number, exc)
            return
        self.settle()
        self.inflight = (request.number, pending, step)

    def settle(self) -> None:
        """Answer the launched step not answered yet, if any."""
        if self.inflight is None:
            return
        (number, pending, step), self.inflight = self.inflight, None
        try:
            value = pending.result()
        except Exception as exc:
            self.failed(number, exc)
            return
        self.answer(number, self.keep_taps(number, step, value))

    def rank_step(self, step):
        """The engine's step as this rank runs it: image rows as tensors, and the drafts a
        hosted speculator made for it (``RankDrafts``) from this rank's device."""
        step = msg.unpack_embeddings(step)
        if not isinstance(step.drafts, msg.RankDrafts):
            return step
        key = step.drafts.key
        drafts = self.drafts.pop(key, None)
        for old in [k for k in self.drafts if k < key]:  # proposals no step used
            del self.drafts[old]
        if drafts is None:
            raise KeyError(f"the drafts {key} of this step are not on rank {self.rank}")
        if isinstance(drafts, Exception):
            raise drafts
        return attrs.evolve(step, drafts=drafts)

    def keep_taps(self, number: int, step, output):
        """With a hosted speculator, the step's tapped rows stay here for its Observe: the
        answer names them (``RankRows``) instead of carrying them."""
        if self.speculator is None or not output.hidden:
            return output
        self.tapped[number] = (step, output)
        return attrs.evolve(output, hidden={seq: msg.RankRows(number) for seq in output.hidden})

    def run(self, request: Any) -> None:
        number = getattr(request, "number", None)
        try:
            value = self.handle(request)
        except Exception as exc:
            self.failed(number, exc)
            return
        if number is not None:
            self.answer(number, value)

    def failed(self, number: int | None, exc: Exception) -> None:
        """Answer ``exc``; an error that is not the input's ends the rank (re-raised)."""
        if isinstance(exc, INPUT_ERRORS):
            log.debug("rank %d: request %s failed", self.rank, number, exc_info=True)
        else:
            log.error("rank %d failed; it exits", self.rank, exc_info=exc)
        if number is not None:
            self.answer(number, error=exc)
        if not isinstance(exc, INPUT_ERRORS):
            raise exc

    def handle(self, request: Any) -> Any:
        import torch
        import torch.distributed as dist

        ex = self.executor
        if isinstance(request, msg.RunStep):
            step = self.rank_step(request.step)
            return self.keep_taps(request.number, step, ex.launch(step).result())
        if isinstance(request, msg.CopyBlocks):
            ex.copy_blocks(request.pairs)
            return None
        if isinstance(request, msg.ReleaseSequence):
            ex.release_sequence(request.seq)
            return None
        if isinstance(request, msg.ExpectTaps):
            ex.expect_taps(request.taps)
            return None
        if isinstance(request, msg.UseSlidingPages):
            return ex.use_sliding_pages()
        if isinstance(request, msg.AllocateKV):
            ex.allocate_kv(request.num_blocks)
            dist.barrier(group=self.control)  # every rank has its cache (and graphs)
            return ex.limits  # as allocate_kv left them (the lone-prompt chunk fitted to the memory left)
        if isinstance(request, msg.EmbedImage):
            return ex.embed_image(request.image) if self.rank == 0 else None
        if isinstance(request, msg.EmbeddingRows):
            with torch.inference_mode():
                return ex.embedding_rows(request.ids)
        if isinstance(request, msg.HeadLogits):
            with torch.inference_mode():
                return ex.head_logits(request.hidden.tensor())
        if isinstance(request, msg.HostSpeculator):
            return self.host_speculator(request)
        if isinstance(request, msg.Propose):
            return self.propose(request)
        if isinstance(request, msg.WriteDrafts):
            drafts = self.drafts.get(request.key)
            if isinstance(drafts, torch.Tensor) and request.values:
                device = drafts.device
                with torch.inference_mode():
                    drafts[torch.tensor(request.rows, device=device), torch.tensor(request.cols, device=device)] = \
                        torch.tensor(request.values, dtype=drafts.dtype, device=device)
            return None
        if isinstance(request, msg.Observe):
            if self.inflight is not None and self.inflight[0] <= request.step:
                self.settle()  # the step is done on the engine's side (rank 0 answered it): here too
            kept = self.tapped.pop(request.step, None)
            for old in [n for n in self.tapped if n < request.step]:  # steps never observed
                del self.tapped[old]
            if kept is not None:
                self.hosted().observe(kept[0], kept[1], request.committed)
            return None
        if isinstance(request, msg.DraftAllocate):
            self.hosted().allocate_kv(request.num_blocks)
            dist.barrier(group=self.control)
            return None
        if isinstance(request, msg.DraftCopyBlocks):
            self.hosted().copy_blocks(request.pairs)
            return None
        if isinstance(request, msg.DraftRelease):
            self.hosted().release_sequence(request.seq)
            return None
        raise TypeError(f"unknown request {type(request).__name__}")

    def hosted(self):
        if self.speculator is None:
            raise RuntimeError("no speculator is hosted on the ranks")
        return self.speculator

    def host_speculator(self, request: msg.HostSpeculator) -> msg.SpeculatorLoaded:
        import torch
        import torch.distributed as dist

        if self.speculator is not None:
            raise ValueError("a speculator is already hosted on the ranks")
        target = RankTarget(self.executor, self.shard)
        built, error = None, None
        try:  # the factory runs no collective: a rank that fails here fails alone
            with torch.inference_mode():
                built = load_factory(request.factory)(target, *request.args)
        except Exception as exc:  # a bad draft file, no memory left on one device, ...
            log.error("rank %d: the hosted speculator failed to load", self.rank, exc_info=exc)
            error = f"{type(exc).__name__}: {exc}"
        device = self.executor.device
        free = int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" and built is not None else None
        every: list = [None] * self.spec.size
        dist.all_gather_object(every, (free, error), group=self.control)
        failed = [(r, e) for r, (_, e) in enumerate(every) if e is not None]
        if failed:  # on every rank alike: answered, and the ranks carry on without it
            raise ValueError(f"the speculator failed to load on rank {failed[0][0]}: {failed[0][1]}")
        self.speculator = s = built
        every = [f for f, _ in every]
        tail = getattr(s, "token_tail", None)
        return msg.SpeculatorLoaded(tuple(s.taps), int(s.max_draft), int(s.kv_bytes_per_block()), every,
                                    None if tail is None else int(tail),
                                    bool(getattr(s, "follows_sliding_pages", False)))

    def propose(self, request: msg.Propose) -> Any:
        """The hosted speculator's drafts: answered (the host path), or kept under the key."""
        import torch

        speculator = self.hosted()
        if request.number is not None:
            with torch.inference_mode():
                return speculator.propose(request.requests)
        try:
            with torch.inference_mode():
                found = speculator.propose_on_device(request.requests)
        except INPUT_ERRORS as exc:  # raised alike on every rank, before any collective
            self.drafts[request.key] = exc  # the step that reads them fails with it
            return None
        rows, counts = hosted_rows(request.requests, speculator.max_draft)
        if found.rows != rows or found.counts != counts:
            raise RuntimeError("the hosted speculator's drafts are not in the rows the engine placed them in")
        self.drafts[request.key] = found.ids
        return None


def hosted_rows(requests, max_draft: int) -> tuple[dict[int, int], dict[int, int]]:
    """Where a hosted speculator's device drafts are (``DeviceDrafts.rows`` and ``counts``):
    a row per request with room and tokens, in order, ``min(room, max_draft)`` drafts each.
    The engine's side places them without asking the ranks."""
    kept = [r for r in requests if r.max_draft > 0 and r.tokens]
    return ({r.seq: row for row, r in enumerate(kept)},
            {r.seq: min(r.max_draft, max_draft) for r in kept})


def run_rank(rank: int, spec: RankSpec, store: str, requests: StepChannel, replies: StepChannel,
             parent: int) -> None:
    """The entry point of a rank process (spawned)."""
    from musegl_core.logs import configure

    configure(spec.log_level, f"rank {rank}")
    try:
        _run(rank, spec, store, requests, replies, parent)
    except PeerGone:
        log.info("rank %d: the engine's process is gone; exiting", rank)
    except BaseException:
        log.exception("rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)
    finally:
        requests.close()
        replies.close()
    os._exit(0)  # no interpreter teardown: the process group and the executor go with the process


def _run(rank: int, spec: RankSpec, store: str, requests: StepChannel, replies: StepChannel, parent: int) -> None:
    import torch
    import torch.distributed as dist

    from musegl_cuda.parallel.shard import ShardPlan, TensorShard

    if spec.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    file_store = dist.FileStore(store, spec.size)
    if spec.device == "cuda":
        # NVLink SHARP (NVLS, multicast) is off on this project's multi-GPU hosts; NCCL's
        # ring and tree all-reduces run without it, and without probing for it
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", store=file_store, rank=rank, world_size=spec.size,
                                device_id=torch.device("cuda", rank))
        device_group, backend = dist.group.WORLD, "nccl"
        control = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo", store=file_store, rank=rank, world_size=spec.size)
        device_group = control = dist.group.WORLD
        backend = "gloo"
    config = text_config(spec)
    shard = TensorShard(ShardPlan.of(config, spec.size, rank), device_group, backend)
    executor = build_executor(spec, rank, shard)
    worker = Rank(spec, rank, requests, replies, parent, control, executor, shard)
    worker.loaded()
    worker.serve()
    executor.close()
