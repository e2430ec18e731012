"""What the engine's process and the ranks say to each other over the :class:`~.channel.StepChannel`.

Every rank reads every request (in order); only rank 0 answers, with a
:class:`Reply` carrying the request's ``number``. Requests without a number
(:class:`CopyBlocks`, :class:`ReleaseSequence`, the hosted speculator's :class:`Propose` for
the device, :class:`WriteDrafts`, :class:`Observe`, :class:`DraftCopyBlocks`, :class:`DraftRelease`)
get no answer:
the next request's answer follows them.

A speculator hosted on the ranks (:class:`HostSpeculator`) is replicated: every rank runs
it on the same requests in the same order. Its drafts stay on each rank's device, named in
the engine's steps by a :class:`RankDrafts`; the tapped rows of a step stay there too, named
in rank 0's answer by a :class:`RankRows` per sequence, and :class:`Observe` hands them to it.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Sequence

import attrs
import numpy as np

from musegl_core.engine.executor import ExecutorLimits, ModelInfo, PromptImage, Step


class RankFailure(RuntimeError):
    """A rank process died: the request failed, and so will every later one (raised by the
    tensor-parallel executor and its hosted speculator)."""


@attrs.frozen
class HostTensor:
    """A tensor as it crosses the channel: a numpy array (pickled as one copy of its bytes,
    where a torch tensor pickles through its whole storage), bfloat16 as its int16 bits."""

    array: np.ndarray
    dtype: str

    @classmethod
    def of(cls, tensor) -> "HostTensor":
        import torch

        t = tensor.detach().to("cpu").contiguous()
        name = str(t.dtype).removeprefix("torch.")
        return cls((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy(), name)

    def tensor(self):
        import torch

        t = torch.from_numpy(self.array)
        return t.view(torch.bfloat16) if self.dtype == "bfloat16" else t


def pack(value: Any) -> Any:
    """``value`` with every torch tensor a :class:`HostTensor` (lists, dicts, tuples and attrs
    classes searched; a list of plain numbers is left as it is)."""
    return _convert(value, True)


def unpack(value: Any) -> Any:
    """:func:`pack` undone: every :class:`HostTensor` a CPU torch tensor again."""
    return _convert(value, False)


def _convert(value: Any, packing: bool) -> Any:
    import torch

    if packing and isinstance(value, torch.Tensor):
        return HostTensor.of(value)
    if not packing and isinstance(value, HostTensor):
        return value.tensor()
    if isinstance(value, (list, tuple)):
        if not value or isinstance(value[0], (int, float, str, bytes, type(None))):
            return value
        return type(value)(_convert(v, packing) for v in value)
    if isinstance(value, dict):
        return {k: _convert(v, packing) for k, v in value.items()}
    if attrs.has(type(value)):
        fields = [a for a in attrs.fields(type(value)) if a.init]
        changes = {}
        for a in fields:
            old = getattr(value, a.name)
            new = _convert(old, packing)
            if new is not old:
                changes[a.name] = new
        return attrs.evolve(value, **changes) if changes else value
    return value


def unpack_embeddings(step: Step) -> Step:
    """The embedding rows of ``step``'s chunks as tensors again (the rest of a step carries none)."""
    if not any(span for chunk in step.chunks for span in chunk.embeds):
        return step
    chunks = [attrs.evolve(chunk, embeds=tuple(attrs.evolve(span, embedding=unpack(span.embedding))
                                               for span in chunk.embeds)) if chunk.embeds else chunk
              for chunk in step.chunks]
    return attrs.evolve(step, chunks=chunks)


@attrs.frozen
class Loaded:
    """Rank 0's first answer (number 0), once every rank holds its weights."""

    info: ModelInfo
    limits: ExecutorLimits
    block_size: int
    kv_bytes_per_block: list[int]  # per rank
    free_memory: list[int | None]  # per rank: device memory free after the weights (CUDA), else None
    weight_bytes: dict[str, int]  # summed over the ranks
    pids: list[int]


@attrs.frozen
class ExpectTaps:
    """A speculator's taps, before :class:`AllocateKV` (the decode graphs are captured with them)."""

    number: int
    taps: tuple[int, ...]


@attrs.frozen
class UseSlidingPages:
    """Switch to the cache of layer-group pages, before :class:`AllocateKV`
    (``TorchExecutor.use_sliding_pages``): every rank answers the same."""

    number: int


@attrs.frozen
class AllocateKV:
    number: int
    num_blocks: int


@attrs.frozen
class RunStep:
    number: int
    step: Step


@attrs.frozen
class CopyBlocks:
    pairs: Sequence[tuple[int, int]]


@attrs.frozen
class ReleaseSequence:
    """A sequence ended: each rank's executor drops what it keeps for it (the sampler
    graphs' penalty counts)."""

    seq: int


@attrs.frozen
class EmbedImage:
    """Rank 0 runs the (replicated) vision tower; the rows come back to the engine."""

    number: int
    image: PromptImage


@attrs.frozen
class EmbeddingRows:
    """TargetAccess: raw embedding rows of ``ids`` (every rank takes part: the rows are split)."""

    number: int
    ids: Any


@attrs.frozen
class HeadLogits:
    """TargetAccess: the raw head product of ``hidden`` (every rank takes part)."""

    number: int
    hidden: HostTensor


@attrs.frozen
class HostSpeculator:
    """Build a speculator on every rank: ``factory`` (``"module:function"``) is called with
    the rank's :class:`~.rank.RankTarget` and ``args``. Answered with :class:`SpeculatorLoaded`."""

    number: int
    factory: str
    args: tuple


@attrs.frozen
class SpeculatorLoaded:
    """The hosted speculator's contract figures (rank 0's), and every rank's free device
    memory once it is loaded (CUDA; else None)."""

    taps: tuple[int, ...]
    max_draft: int
    kv_bytes_per_block: int  # one rank's
    free_memory: list[int | None]
    token_tail: int | None = None  # the trailing ids of a request it reads (None: all of them)
    follows_sliding_pages: bool = False  # its K/V follows the engine's sliding pages (DFlash's store)


@attrs.frozen
class DraftAllocate:
    """The hosted speculator's :meth:`allocate_kv`."""

    number: int
    num_blocks: int


@attrs.frozen
class RankDrafts:
    """``Step.drafts`` of a step whose drafts the ranks hold: those :class:`Propose` ``key`` made."""

    key: int


@attrs.frozen
class TokenTail(collections.abc.Sequence):
    """A request's ``tokens`` as they cross to the ranks for a speculator that reads only
    the last few (``token_tail``): the count, and those ids. Reading an earlier id is an
    ``IndexError``."""

    length: int
    tail: tuple[int, ...]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.length))]
        i = index + self.length if index < 0 else index
        first = self.length - len(self.tail)
        if not first <= i < self.length:
            raise IndexError(f"token {index} of {self.length} did not cross to the ranks (only the last "
                             f"{len(self.tail)})")
        return self.tail[i - first]

    def __iter__(self):  # the ABC's iterates from id 0, which did not cross: never an empty list
        raise TypeError(f"only the last {len(self.tail)} of {self.length} tokens crossed to the ranks")


@attrs.frozen
class Propose:
    """The hosted speculator drafts for ``requests``. With ``number`` (the host path) rank 0
    answers the drafts (``propose``); without, each rank keeps them on its device under
    ``key`` (``propose_on_device``) for the step whose drafts are ``RankDrafts(key)``."""

    number: int | None
    key: int
    requests: list


@attrs.frozen
class WriteDrafts:
    """Overwrite ids of the drafts ``key`` on every rank: ``values[i]`` at row ``rows[i]``,
    column ``cols[i]`` (the benchmark's replayed drafts, one source for every rank)."""

    key: int
    rows: list[int]
    cols: list[int]
    values: list[int]


@attrs.frozen
class RankRows:
    """A sequence's tapped rows of step ``number`` in rank 0's answer: they stay on the ranks."""

    number: int


@attrs.frozen
class Observe:
    """The hosted speculator's :meth:`observe` of the step numbered ``step`` (whose tapped
    rows the ranks kept). Not answered (it has no ``number``)."""

    step: int
    committed: dict


@attrs.frozen
class DraftCopyBlocks:
    pairs: Sequence[tuple[int, int]]


@attrs.frozen
class DraftRelease:
    seq: int


@attrs.frozen
class Shutdown:
    pass


@attrs.frozen
class Reply:
    """Rank 0's answer to request ``number``: ``value``, or ``error`` (the exception, rebuilt
    by the engine's side as the same type where it can)."""

    number: int
    value: Any = None
    error: BaseException | None = None
