"""The executor contract (v2): what the engine asks of a model backend.

The engine never touches tensors. It hands the executor a :class:`Step`, a
packed list of :class:`SeqChunk` objects, and gets back a :class:`StepOutput`.
The KV cache is *off-graph and paged*: the engine's :class:`~musegl_core.engine.kv_pool.KVPool`
decides which block ids a sequence owns; the executor only stores and reads
the K/V tensors those ids index. ``docs/executor.md`` is the reference for
plugin authors; this module is its code.

What a step can carry, per sequence:

* **token rows** (ids looked up in the embedding table) and **embedding rows**
  (:class:`EmbeddingSpan`: rows a backend computed earlier, e.g. image
  features from :meth:`Executor.embed_image`);
* a request to **sample** the next token after each of the last ``sample``
  rows. One sampled row is an ordinary decode or the end of a prefill;
  ``k + 1`` sampled rows verify ``k`` draft tokens (the engine keeps the
  longest prefix the target agrees with, see :mod:`musegl_core.engine.speculator`);
* what the sampler needs to do that batched on the device: the sequence's
  :class:`SamplingParams`, one uniform random number per sampled row (keyed by
  the request's seed and the row's absolute position, so a draw never depends
  on the batch), optional allowed-token bitmasks (grammar processors) and the
  ids the penalties count.

An executor may also run steps asynchronously (:class:`AsyncExecutor`): the
engine then launches decode step N+1, whose rows *follow* the ids step N
samples on the device (:attr:`SeqChunk.follows`), before it reads step N's
result, so the host's planning and bookkeeping overlap the device's work.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import attrs


@attrs.frozen
class SamplingParams:
    """Per-sequence sampling, applied batched inside the executor.

    The executor applies, in this order, to the float32 logits of a sampled
    row: ``logit_bias`` (added), ``repetition_penalty`` (every id of the
    prompt and the generated text: positive logits divided, negative
    multiplied), ``frequency_penalty`` and ``presence_penalty`` (subtracted per
    occurrence / once, counting generated ids only), the allowed-token masks
    (disallowed ids become ``-inf``), then temperature, ``top_k``, ``top_p``
    and ``min_p``, and draws by inverse CDF with the row's uniform number.

    ``temperature == 0`` (or ``top_k == 1``) means greedy: argmax, lowest id on
    ties, after bias, penalties and masks. ``top_k == 0``, ``top_p == 1`` and
    ``min_p == 0`` disable those filters. ``seed`` keys the random numbers; the
    engine gives every request without one a random seed at admission.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """True when a penalty needs the sequence's token history."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


GREEDY = SamplingParams(temperature=0.0)


@attrs.frozen
class ModelInfo:
    """What the engine and the front need to know about a loaded model."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    native_context: int
    dtype: str
    backend: str
    demo: bool = False
    vision: bool = False  # the executor can encode images (embed_image)
    hidden_states: bool = True  # the executor returns tapped decoder hidden states (Step.taps) for speculators
    #: most ViT patches the executor's vision encoder takes per image (an exported program's
    #: capacity); the preprocessing clips --max-vision-patches to it. None: no limit of its own
    vision_patches: int | None = None


@attrs.frozen
class PromptImage:
    """One preprocessed image of a prompt, ready for :meth:`Executor.embed_image`.

    ``pixels`` is backend-neutral (a numpy array of normalized patches, as the
    preprocessing produced it); ``rows`` is the number of embedding rows it
    becomes (the ``<|patch|>`` placeholders it occupies in the prompt);
    ``digest`` identifies its content (sessions and prefix reuse compare it
    instead of the placeholder ids); ``grid`` is the patch grid (height,
    width) the vision tower needs.
    """

    digest: str
    rows: int
    pixels: Any = attrs.field(default=None, eq=False, repr=False)  # the digest is the identity
    grid: tuple[int, int] = (0, 0)


@attrs.frozen
class EmbeddingSpan:
    """Rows of a chunk whose decoder input comes from a computed embedding.

    Chunk rows ``offset .. offset+count-1`` take rows ``first .. first+count-1``
    of ``embedding`` (what :meth:`Executor.embed_image` returned) as their input
    hidden state *instead of* the normed token embedding; their token ids in the
    chunk are placeholders and are not looked up.
    """

    offset: int
    count: int
    embedding: Any
    first: int = 0


@attrs.define
class SeqChunk:
    """One sequence's rows in a packed step.

    ``positions[i]`` is the absolute position of ``tokens[i]``; positions of
    one chunk are consecutive. ``blocks`` is the sequence's block table: block
    ``blocks[p // block_size]`` holds the K/V of position ``p`` for every
    position the chunk reads (``0 .. positions[-1]``) or writes. A chunk whose
    first position is past 0 continues a sequence whose earlier positions are
    already in the cache (written by earlier steps, or shared from another
    sequence's blocks): the executor reads them, never recomputes them.

    ``sample`` is the number of trailing rows after which a token is sampled
    (0: none; 1: the end of a prefill or a decode step; ``k + 1``: a block of
    ``k`` draft tokens being verified). ``True`` means 1. For sampled row ``j``
    (counting from the first sampled row), ``uniforms[j]`` is its random number
    in [0, 1), ``masks[j]`` its allowed-token bitmask or None (a numpy uint32
    array of ``ceil(vocab/32)`` words: bit ``i % 32`` of word ``i // 32`` set
    means id ``i`` is allowed; ``masks`` may be a
    :class:`~musegl_core.engine.masks.PendingMasks` computed while the forward
    runs, so read it after the forward), and ``history`` plus the chunk's own tokens up
    to that row are the ids the penalties count (``prompt_len`` of them are
    the prompt, counted only by the repetition penalty).

    ``follows`` (asynchronous executors only, :class:`AsyncExecutor`) says the
    chunk's one token is not known to the engine yet: it is the id sampled for
    this sequence by the step launched just before this one (that step's last
    sampled row of the sequence); ``tokens[0]`` is a placeholder. Only a
    one-row decode chunk (one token, ``sample == 1``) can follow.

    ``draft_row`` (>= 0; executors announcing ``limits.device_drafts`` only)
    says the chunk is a verify block whose drafts are on the device: its
    ``tokens[1:]`` are placeholders for the first ``len(tokens) - 1`` ids of
    row ``draft_row`` of :attr:`Step.drafts`, and the executor reports in
    :attr:`StepOutput.accepted` how many of them agree with its sampled ids
    (draft ``j`` with the id sampled after row ``j``, while all before agree).

    ``logprobs`` asks, for every sampled row, the log-probability of the chosen
    id and of the ``logprobs`` most likely ids (-1: none). ``want_logits`` asks
    the float32 logits of the last row as well; ``logit_rows`` those of every
    row (parity tests, other verifiers).
    """

    seq: int
    tokens: Sequence[int]
    positions: Sequence[int]
    blocks: Sequence[int]
    sample: int = 0
    sampling: SamplingParams = GREEDY
    uniforms: Sequence[float] = ()
    masks: Sequence[Any] = ()
    history: Sequence[int] = ()
    prompt_len: int = 0
    logprobs: int = -1
    embeds: Sequence[EmbeddingSpan] = ()
    want_logits: bool = False
    logit_rows: bool = False
    follows: bool = False
    draft_row: int = -1
    #: with sliding pages (an executor that offers them, ``use_sliding_pages``): one block table
    #: per group of sliding layers, the page of each block of ``blocks``, -1 where no row's
    #: window reaches the block (its sliding K/V left the device); empty otherwise
    sliding_blocks: tuple = ()

    def __attrs_post_init__(self) -> None:
        if len(self.tokens) != len(self.positions) or not self.tokens:
            raise ValueError("a chunk needs one position per token and at least one token")
        self.sample = int(self.sample)
        if not 0 <= self.sample <= len(self.tokens):
            raise ValueError(f"sample={self.sample} must lie in 0..{len(self.tokens)} (the chunk's rows)")
        if self.follows and (len(self.tokens) != 1 or self.sample != 1 or self.embeds):
            raise ValueError("only a one-row decode chunk (one token, sample=1) can follow the previous step")
        if self.draft_row >= 0 and (len(self.tokens) < 2 or self.sample != len(self.tokens) or self.embeds):
            raise ValueError("only a verify block (drafts after its first row, every row sampled) reads drafts "
                             "on the device")
        for span in self.embeds:
            if span.offset < 0 or span.count < 1 or span.offset + span.count > len(self.tokens):
                raise ValueError("an embedding span must lie inside its chunk")

    @property
    def sampled_rows(self) -> range:
        """Indices (into the chunk) of the rows after which a token is sampled."""
        return range(len(self.tokens) - self.sample, len(self.tokens))


@attrs.define
class Step:
    """A packed forward over several sequences.

    ``width`` is the number of rows the executor should run: at least
    :attr:`num_tokens`; more when the scheduler padded a decode-only step up
    to one of :attr:`ExecutorLimits.step_sizes` (the executor adds padding
    rows that write no cache and sample nothing). ``taps`` names decoder
    layers whose *input* residual (the output of the previous layer, GGUF
    convention; ``num_layers`` is the last layer's output) is returned for
    every row, for drafts such as DFlash. ``drafts`` holds the device drafts
    (:class:`~musegl_core.engine.speculator.DeviceDrafts` ``ids``, a backend
    array ``(rows, k)``) that chunks with a ``draft_row`` read.
    """

    chunks: list[SeqChunk]
    taps: tuple[int, ...] = ()
    width: int = 0
    drafts: Any = None

    def __attrs_post_init__(self) -> None:
        self.width = max(self.width, self.num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    @property
    def decode_only(self) -> bool:
        """Every chunk samples after each of its rows (decodes, verify blocks) and
        carries no embedding rows: the steps a captured graph can run."""
        return all(c.sample == len(c.tokens) and not c.embeds for c in self.chunks)


@attrs.frozen
class TokenLogprobs:
    """The log-probability of a sampled id and the most likely alternatives
    (ids and log-probabilities, most likely first), under the distribution the
    id was drawn from (after bias, penalties, masks and temperature; before
    top-k/top-p/min-p truncation)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@attrs.define
class StepOutput:
    """What a step returns, keyed by sequence handle.

    ``tokens[seq]`` lists the sampled ids of a chunk with ``sample > 0``, one
    per sampled row in row order; ``logprobs[seq]`` likewise when asked.
    ``logits`` has an entry for every chunk with ``want_logits`` (shape
    ``(vocab,)``) or ``logit_rows`` (shape ``(rows, vocab)``); ``hidden`` maps
    a sequence to an array of shape ``(len(taps), rows, hidden)``. Arrays are
    backend-native (torch, mlx) or numpy; the engine only passes them on.
    ``accepted[seq]``, for a chunk with a ``draft_row``: how many of its
    drafts agree with its sampled ids (the engine commits ``accepted + 1`` ids).
    """

    tokens: dict[int, list[int]] = attrs.field(factory=dict)
    logprobs: dict[int, list[TokenLogprobs]] = attrs.field(factory=dict)
    logits: dict[int, Any] = attrs.field(factory=dict)
    hidden: dict[int, Any] = attrs.field(factory=dict)
    accepted: dict[int, int] = attrs.field(factory=dict)


@attrs.frozen
class HeadRows:
    """Which packed rows of a step an executor runs through the head: the sampled rows,
    the last row of chunks that want logits, every row of chunks with ``logit_rows``.
    ``rows`` are packed row indices, in order; ``where[i]`` maps chunk ``i``'s rows to
    indices into ``rows``; ``sampled`` lists the ``rows`` index of every sampled row,
    chunk by chunk (the order the sampler's ids come back in). Backend-neutral: the
    executors only run the head and the sampler on these rows."""

    rows: list[int]
    where: list[dict[int, int]]
    sampled: list[int]

    @classmethod
    def of(cls, step: "Step", starts: Sequence[int]) -> "HeadRows":
        """``starts[i]``: the packed row of chunk ``i``'s first token."""
        rows: list[int] = []
        where: list[dict[int, int]] = []
        sampled: list[int] = []
        for chunk, start in zip(step.chunks, starts):
            last = len(chunk.tokens) - 1
            needed = set(range(last + 1)) if chunk.logit_rows else set(chunk.sampled_rows)
            if chunk.want_logits:
                needed.add(last)
            index = {r: len(rows) + k for k, r in enumerate(sorted(needed))}
            where.append(index)
            rows.extend(int(start) + r for r in sorted(needed))
            sampled.extend(index[r] for r in chunk.sampled_rows)
        return cls(rows, where, sampled)

    def output(self, step: "Step", starts: Sequence[int], logits: Any, ids: Sequence[int],
               logprobs: Sequence["TokenLogprobs"], hidden: Any) -> StepOutput:
        """The step's answer per sequence: ``logits`` holds the head's rows (indexable by row,
        in ``rows`` order; None when there were none), ``ids``/``logprobs`` the sampler's
        answers for ``sampled``, ``hidden`` the tapped rows ``(taps, packed rows, hidden)``."""
        out = StepOutput()
        at = 0
        for chunk, start, index in zip(step.chunks, starts, self.where):
            if chunk.logit_rows:
                out.logits[chunk.seq] = logits[index[0]:index[0] + len(chunk.tokens)]
            elif chunk.want_logits:
                out.logits[chunk.seq] = logits[index[len(chunk.tokens) - 1]]
            if chunk.sample:
                out.tokens[chunk.seq] = ids[at:at + chunk.sample]
                if chunk.logprobs >= 0:
                    out.logprobs[chunk.seq] = logprobs[at:at + chunk.sample]
                at += chunk.sample
            if hidden is not None:
                out.hidden[chunk.seq] = hidden[:, int(start):int(start) + len(chunk.tokens)]
        return out


#: ``--max-prefill-chunk`` where neither the user nor the executor (``ExecutorLimits.prefill_chunk``) sets one.
DEFAULT_PREFILL_CHUNK = 512


@attrs.frozen
class ExecutorLimits:
    """Shape limits an executor announces so the scheduler packs steps it can run.

    ``step_sizes`` lists fixed step widths (rows) the backend has precompiled
    (CUDA graphs), ascending. The scheduler pads a decode-only step up to the
    smallest listed width that holds it (``Step.width``); a step wider than
    the largest, or one that carries prefill rows, runs at its own width (the
    dynamic path). An empty tuple means any width. The scheduler never puts
    more than ``max_step_tokens`` rows into one step. ``host_compute`` is True
    when the forward runs on the host's CPU cores (the engine then computes
    grammar masks between steps by default, instead of on threads that would
    take cores from the forward; ``--grammar-threads``). ``async_steps`` is
    True when the executor is an :class:`AsyncExecutor`. ``device_drafts`` is
    True when the executor reads verify blocks' drafts from the device
    (:attr:`SeqChunk.draft_row`, :attr:`Step.drafts`) and reports
    :attr:`StepOutput.accepted` for them.

    ``verify_rows`` is the speculation budget: about how many verify rows
    (each decoding sequence's pending token plus its drafts) one step may
    carry and still cost about a plain decode step on this backend; the
    engine gives each of ``b`` decoding sequences at most
    ``verify_rows // b - 1`` drafts, and none when that is below 1
    (:meth:`musegl_core.engine.loop.StepLoop.draft_cap`). None: no budget
    (every sequence may get the speculator's full block). ``--spec-verify-rows``
    overrides it.

    ``prefill_chunk`` is the backend's default of ``--max-prefill-chunk``
    (the most prompt rows one step computes) where the user sets none: a GPU
    runs a 2,048-row chunk at a far better share of its matrix rate than a
    512-row one, a CPU gains nothing from wider chunks and each row stretches
    the decoders' step. None: :data:`DEFAULT_PREFILL_CHUNK`.

    ``solo_prefill_chunk`` is the backend's default of ``--solo-prefill-chunk``:
    the most prompt rows one step computes when a single sequence prefills and
    nothing else runs (no one waits on the step, so a long prompt needs fewer,
    wider steps). None: the prefill chunk (no wider solo steps). An executor
    that announces one must also take steps of that many rows
    (``max_step_tokens``).
    """

    max_step_tokens: int = 4096
    step_sizes: tuple[int, ...] = ()
    host_compute: bool = False
    async_steps: bool = False
    device_drafts: bool = False
    verify_rows: int | None = None
    prefill_chunk: int | None = None
    solo_prefill_chunk: int | None = None

    def padded_width(self, rows: int) -> int:
        """The width a decode-only step of ``rows`` rows runs at."""
        for size in self.step_sizes:
            if size >= rows:
                return size
        return rows


@runtime_checkable
class Executor(Protocol):
    """A model backend. Created by an executor plugin's factory in the worker.

    Lifecycle (all calls from one thread at a time; after start-up, only the
    engine thread): the factory loads the weights (reporting progress); the
    worker reads :attr:`info`, :attr:`block_size` and :attr:`limits`, sizes the
    pool from :meth:`kv_bytes_per_block` and :meth:`kv_memory_available`, then
    calls :meth:`allocate_kv` once. After that only :meth:`step` (or
    :meth:`AsyncExecutor.launch`), :meth:`copy_blocks`, :meth:`embed_image` and
    :meth:`release_sequence` are called, until :meth:`close`. There is no
    warm-up call: do warm-up (graph capture) inside :meth:`allocate_kv`.
    """

    info: ModelInfo
    block_size: int
    limits: ExecutorLimits

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block costs across all layers (K and V)."""

    def kv_memory_available(self) -> int | None:
        """Bytes the KV cache may take on this backend now (weights loaded), or
        None when the backend cannot tell (the pool is then sized from the
        limits alone)."""

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocate the paged KV storage for ``num_blocks`` blocks."""

    def step(self, step: Step) -> StepOutput:
        """Run one packed forward, write K/V into the chunks' blocks, sample."""

    def embed_image(self, image: PromptImage) -> Any:
        """The ``image.rows`` embedding rows of a preprocessed image (backend
        array ``(rows, hidden)``), to be placed into steps as
        :class:`EmbeddingSpan`. Raise ``ValueError`` when the model cannot see
        images (``info.vision`` is False)."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy the K/V contents of block ``src`` into block ``dst`` for each pair
        (copy-on-write when a shared prefix block is about to be written)."""

    def release_sequence(self, seq: int) -> None:
        """Forget any per-sequence state. Called once when the sequence ends
        (finished, cancelled or failed). Blocks are not touched: the engine
        owns block lifetime."""

    def close(self) -> None:
        """Free device memory. The executor is not used afterwards."""

    # Optional capabilities, checked at load: TargetAccess (below) and the host tier's page
    # copies, musegl_core.engine.kv_host.HostKV (allocate_host_kv, offload_pages,
    # restore_pages, read_host_pages, write_host_pages; all or none). Without HostKV the
    # engine runs with the host tier off and says so in one start-up line.


@runtime_checkable
class PendingStep(Protocol):
    """A launched step (:meth:`AsyncExecutor.launch`)."""

    def result(self) -> StepOutput:
        """Wait for the step and return its output (the same object on every call);
        raises what the step raised."""


@attrs.frozen
class FinishedStep:
    """A :class:`PendingStep` that was done when it was launched (a step the executor
    ran synchronously)."""

    output: StepOutput

    def result(self) -> StepOutput:
        return self.output


@runtime_checkable
class AsyncExecutor(Executor, Protocol):
    """An executor that can queue a step's device work and return before it is done
    (announced by ``limits.async_steps``).

    The engine uses it for decode steps whose rows need nothing from the host
    that depends on the previous token (no grammar masks, penalties or drafts):
    while step N runs it plans step N+1, whose chunks :attr:`~SeqChunk.follows`
    step N's ids, launches it, and only then reads step N's result and
    commits it. A sequence that stopped at step N gets a wasted row in step
    N+1; the engine discards it. The rules an implementation keeps:

    * the device runs steps, :meth:`copy_blocks` and :meth:`embed_image` in
      the order they were called (one stream): a block a step writes may be
      freed and handed to another sequence before the step is done, because
      the engine plans the next user's writes after it;
    * at most two launched steps are unresolved at a time; ``launch`` may wait
      for older ones (their :meth:`PendingStep.result` still answers later);
    * :meth:`step` is ``launch(step).result()``.
    """

    def launch(self, step: Step) -> PendingStep:
        """Queue ``step`` and return at once (or after doing it synchronously, for
        steps the backend cannot queue)."""


@runtime_checkable
class TargetAccess(Protocol):
    """Optional: an executor that lends a speculator its token embedding and head
    (docs/executor.md section 8). A draft model that has neither (DFlash) drafts
    with the target's own; without this interface it reads them from the
    checkpoint file instead.

    Arrays are backend-native: the arguments may be numpy arrays or the
    backend's own, the results are the backend's arrays on its device (the
    torch executor: torch tensors in its activation dtype; MLX: float32 mx
    arrays, which numpy reads).
    Both methods or neither: :func:`check_executor` refuses half of it."""

    def embedding_rows(self, ids: Any) -> Any:
        """The raw token embedding rows of ``ids`` (any shape): ``ids.shape + (hidden,)``,
        before the embedding norm."""

    def head_logits(self, hidden: Any) -> Any:
        """The raw head product of ``(n, hidden)`` rows: ``(n, vocab)``, without the
        output multiplier and the softcap."""


def target_access(executor: object) -> TargetAccess | None:
    """``executor`` as a :class:`TargetAccess` when it implements it, else None."""
    methods = _protocol_members(TargetAccess)[1]
    if all(_present(executor, name) and callable(getattr(executor, name)) for name in methods):
        return executor  # type: ignore[return-value]
    return None


# -- checking an executor against the contract -----------------------------------------------
#: Where the contract is written, for the one-line errors of :func:`check_executor`.
CONTRACT_MEMBERS = 'docs/executor.md section 2, "What the executor object provides"'
CONTRACT_ASYNC = 'docs/executor.md section 4a, "Asynchronous steps"'
CONTRACT_TARGET = 'docs/executor.md section 8, "Speculators (drafts)"'
CONTRACT_HOST = 'docs/executor.md, "The host tier (optional)"'


def _protocol_members(protocol: type) -> tuple[list[str], list[str]]:
    """The attributes (annotated) and methods a Protocol class declares itself."""
    attributes = list(vars(protocol).get("__annotations__", {}))
    methods = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
    return attributes, methods


def _present(obj: object, name: str) -> bool:
    import inspect

    try:
        inspect.getattr_static(obj, name)
        return True
    except AttributeError:
        try:  # members served by __getattr__ (a wrapper that delegates)
            return hasattr(obj, name)
        except Exception:
            return False


def contract_problems(executor: object) -> list[str]:
    """What keeps ``executor`` from following the executor contract (v2), one
    phrase per problem naming the member and the section; empty when it follows it."""
    attributes, methods = _protocol_members(Executor)
    missing = [name for name in attributes if not _present(executor, name)]
    missing += [name for name in methods if not (_present(executor, name) and callable(getattr(executor, name)))]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing)} ({CONTRACT_MEMBERS})")
    wrong = []
    for name, kind in (("info", ModelInfo), ("limits", ExecutorLimits)):
        if name not in missing and not isinstance(getattr(executor, name), kind):
            wrong.append(f"{name} is a {type(getattr(executor, name)).__name__}, not a {kind.__name__}")
    if "block_size" not in missing:
        size = getattr(executor, "block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            wrong.append(f"block_size is {size!r}, not a positive int")
    if wrong:
        problems.append(f"{'; '.join(wrong)} ({CONTRACT_MEMBERS})")
    limits = getattr(executor, "limits", None) if "limits" not in missing else None
    if isinstance(limits, ExecutorLimits) and limits.async_steps:
        async_missing = [name for name in _protocol_members(AsyncExecutor)[1]
                         if not (_present(executor, name) and callable(getattr(executor, name)))]
        if async_missing:
            problems.append(f"limits.async_steps is set but {', '.join(async_missing)} is missing ({CONTRACT_ASYNC})")
    from musegl_core.engine.kv_host import HostKV, host_kv

    offered = [name for name in _protocol_members(HostKV)[1] if _present(executor, name)]
    if offered and host_kv(executor) is None:
        problems.append(f"HostKV (the host tier) needs {', '.join(_protocol_members(HostKV)[1])} as methods, it "
                        f"has {', '.join(offered)} ({CONTRACT_HOST})")
    lent = [name for name in _protocol_members(TargetAccess)[1] if _present(executor, name)]
    if lent and target_access(executor) is None:
        methods = _protocol_members(TargetAccess)[1]
        problems.append(f"TargetAccess needs {' and '.join(methods)} as methods, it has "
                        f"{', '.join(lent)} ({CONTRACT_TARGET})")
    return problems


def check_executor(executor: object, name: str) -> None:
    """Refuse, right after the factory of executor ``name`` returned it, an
    object that does not follow the contract: one line naming every missing or
    wrong member and the contract section (:class:`~musegl_core.errors.ConfigError`,
    exit status 2), instead of an ``AttributeError`` deep in the engine later."""
    problems = contract_problems(executor)
    if problems:
        from musegl_core.errors import ConfigError

        raise ConfigError(f"the {name!r} executor ({type(executor).__module__}.{type(executor).__qualname__}) does "
                          f"not follow the executor contract v2: {'; '.join(problems)}")
