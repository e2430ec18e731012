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
the same gathered logits, the same ids. Rank 0 answers. A rank whose request
fails on its input (``ValueError`` and the like, raised before any collective,
alike on every rank) answers with the error and carries on; any other failure
ends the rank, which the engine's side sees as a dead rank.
"""

from __future__ import annotations

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
                             shard=shard)
    checkpoint = load_checkpoint(spec.model)
    vision = None
    try:
        vision = load_vision(spec.model, spec.mmproj, checkpoint.config.hidden_size)
        return TorchExecutor(checkpoint, device=device, dtype=spec.dtype, forward_sizes=spec.forward_sizes,
                             vision=vision, weights=spec.weights, async_steps=spec.async_steps, shard=shard)
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


class Rank:
    """One rank's loop over the requests; see the module docstring."""

    def __init__(self, spec: RankSpec, rank: int, requests: StepChannel, replies: StepChannel,
                 parent: int, control, executor) -> None:
        self.spec, self.rank = spec, rank
        self.requests, self.replies = requests, replies
        self.parent = parent
        self.control = control  # the gloo group for control (barriers, gathering small objects)
        self.executor = executor
        self.inflight: tuple[int, Any] | None = None  # (number, pending) of a step launched, not answered

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
            pending = self.executor.launch(msg.unpack_embeddings(request.step))
        except Exception as exc:
            self.failed(request.number, exc)
            return
        self.settle()
        self.inflight = (request.number, pending)

    def settle(self) -> None:
        """Answer the launched step not answered yet, if any."""
        if self.inflight is None:
            return
        (number, pending), self.inflight = self.inflight, None
        try:
            value = pending.result()
        except Exception as exc:
            self.failed(number, exc)
            return
        self.answer(number, value)

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
            return ex.launch(msg.unpack_embeddings(request.step)).result()
        if isinstance(request, msg.CopyBlocks):
            ex.copy_blocks(request.pairs)
            return None
        if isinstance(request, msg.ReleaseSequence):
            ex.release_sequence(request.seq)
            return None
        if isinstance(request, msg.ExpectTaps):
            ex.expect_taps(request.taps)
            return None
        if isinstance(request, msg.AllocateKV):
            ex.allocate_kv(request.num_blocks)
            dist.barrier(group=self.control)  # every rank has its cache (and graphs)
            return None
        if isinstance(request, msg.EmbedImage):
            return ex.embed_image(request.image) if self.rank == 0 else None
        if isinstance(request, msg.EmbeddingRows):
            with torch.inference_mode():
                return ex.embedding_rows(request.ids)
        if isinstance(request, msg.HeadLogits):
            with torch.inference_mode():
                return ex.head_logits(request.hidden.tensor())
        raise TypeError(f"unknown request {type(request).__name__}")


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
    worker = Rank(spec, rank, requests, replies, parent, control, executor)
    worker.loaded()
    worker.serve()
    executor.close()
