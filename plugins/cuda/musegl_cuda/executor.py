"""``TorchExecutor``: the engine's executor contract over the PyTorch decoder.

One packed step runs every row of every chunk through the projections and
MLPs together; attention is per sequence and reads the sequence's K/V from
the paged cache through its block table (positions written by earlier steps
included). The cache is one tensor ``(layers, 2, blocks, block_size,
kv_heads, head_dim)``; ``k_cache[i]``/``v_cache[i]`` are per-layer views
shaped ``(blocks, block_size, kv_heads, head_dim)``. The engine owns block
ids; this class only stores and reads what they index.

On the CPU (float32 activations by default) attention is a loop over the
sequences of a step (the reference path, at parity with transformers). The
CPU keeps the checkpoint's matrices as stored by default (``weights="stored"``:
float16, bfloat16, GGUF Q8_0/Q4_0/Q4_K bytes, multiplied by the kernels of
:mod:`musegl_cuda.cpu`); ``weights="upcast"`` converts them to the activation
dtype at load. A float32 checkpoint runs the same either way. On CUDA a quantized
checkpoint (GGUF blocks, FP8) stays as stored by default, in the Triton kernels of
:mod:`musegl_cuda.cuda.quantized` (:mod:`musegl_cuda.cuda.device_weights`); others are
upcast. On CUDA (bfloat16 by
default) a step is flattened once into a :class:`~musegl_cuda.cuda.plan.StepPlan`
and runs through the Triton kernels of :mod:`musegl_cuda.cuda.kernels`: paged
attention over every sequence at once, fused norms; decode-only steps whose
width is one of ``step_sizes`` replay a captured CUDA graph
(:mod:`musegl_cuda.cuda.graphs`), tapped ones too when the graphs were captured
with the speculator's taps (:meth:`TorchExecutor.expect_taps`); other steps
run the same kernels eagerly.

Every sampled row of a step is sampled in one batched call
(:mod:`musegl_cuda.sampling`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from typing import Iterator, Sequence

import attrs
import torch

from musegl_core.checkpoint.loader import Checkpoint
from musegl_core.checkpoint.vision import VisionWeights
from musegl_core.engine.dtypes import backend_dtypes, dtype_name
from musegl_core.engine.embedding_rows import check_image_rows, embedding_rows, no_vision_error
from musegl_core.engine.executor import (GREEDY, ExecutorLimits, FinishedStep, HeadRows, ModelInfo, PendingStep,
                                         PromptImage, SeqChunk, Step, StepOutput)
from musegl_core.engine.memory import available_ram
from musegl_core.engine.sample_rows import SampleRows
from musegl_core.engine.kv_dtype import kv_position_bytes
from musegl_core.engine.step_checks import check_positions, check_taps, check_tokens, kv_allocated, table_of
from musegl_cuda.cpu.attention import RowKeys
from musegl_cuda.cpu.stored_matrix import HalfRows
from musegl_cuda.drafts import DraftRows
from musegl_cuda import kv_fp8
from musegl_cuda.host_kv import HostPages
from musegl_cuda.model import AttentionBatch, MuseGlimmerDecoder, PagedMeta, SequenceAttention
from musegl_cuda.parallel.shard import TensorShard
from musegl_cuda.quantization import QUANTIZATIONS, quantized_stored
from musegl_cuda.cuda import dense_attention
from musegl_core.engine.sliding_pages import PageGroups, group_tables
from musegl_cuda.cuda.plan import StepPlan, plan_step, rows_per_tile
from musegl_cuda.vision import load_vision_encoder
from musegl_cuda.pending import GreedyIds, Launched, Sampled, device_sources, follow_on_host
from musegl_cuda.sampling import Draw, choose, on_device
from musegl_cuda.step_profile import StepProfiler

DEFAULT_BLOCK_SIZE = 16
#: Decode widths captured as CUDA graphs unless ``--forward-sizes`` says otherwise.
DEFAULT_FORWARD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
WEIGHT_MODES = ("stored", "upcast")
#: The verify-rows budget on CUDA (``ExecutorLimits.verify_rows``): the widest captured decode
#: graph (128 by default), at least :data:`MIN_VERIFY_ROWS`, so a verify step replays a graph.
#: H200, 30B bf16 (benchmarks/results/h200_run_2026-12-02_session10 and _session11): 1 row
#: 14.0 ms, 64 rows 15.4 ms, 128 rows at 2k positions 19.6 ms, a 512-row verify step (32 sequences
#: x 16 rows) 89 ms of kernels; served DFlash at batch 32, acceptance 4: 1.53x plain decode with a
#: 128-row budget (3 drafts a sequence), 0.84x with 64 (1 draft). On the CPU: no budget (nothing
#: measured there).
MIN_VERIFY_ROWS = 16
#: ``--max-prefill-chunk`` on CUDA unless given (``ExecutorLimits.prefill_chunk``): a 2,048-row
#: chunk runs the products near the matrix rate where a 512-row one leaves much of it idle,
#: and the engine's prefill budget still bounds what a chunk beside decoders may stretch their
#: step (H200, 30B: a decode step 15 ms, a prompt row ~85 us). The CPU keeps 512.
CUDA_PREFILL_CHUNK = 2048
#: ``--solo-prefill-chunk`` on CUDA unless given (``ExecutorLimits.solo_prefill_chunk``): the
#: prompt rows of a step in which one sequence prefills and nothing else runs, lowered to what
#: the memory left beside the KV pool holds (``TorchExecutor._fit_solo_chunk``). A 32,768-token
#: prompt's time to the first token in the executor (H100, 30B bf16): 3.038 s in 8,192-row
#: chunks, 2.999 s in 16,384, 2.895 s in one step (its global layers through cuDNN's attention
#: at 592 TFLOP/s, against FlashAttention's 338 for chunks that follow cached keys).
CUDA_SOLO_PREFILL_CHUNK = 32768
#: CPU steps of up to this many rows (decode-sized) run torch's own ops on one thread:
#: they are tiny and gain less from intra-op threads than waking them costs (the stored-weight
#: kernels keep their own threads).
SINGLE_THREADED_ROWS = 16
DTYPES = backend_dtypes(lambda name: getattr(torch, name))


def plain_greedy(chunk: SeqChunk) -> bool:
    """A chunk whose sampled rows are argmax of the raw logits (no bias, penalty,
    mask) and that asks for nothing but the ids: a graph's own argmax serves it."""
    p = chunk.sampling
    return ((p is GREEDY or (p.greedy and not p.logit_bias and not p.penalized))
            and chunk.logprobs < 0 and not chunk.want_logits and not chunk.logit_rows
            and all(m is None for m in chunk.masks))


log = logging.getLogger("musegl.cuda")

#: cuBLAS workspace used on CUDA unless ``CUBLAS_WORKSPACE_CONFIG`` is set: none.
#: Without a workspace cuBLAS picks products without split-K, so a small-row decode
#: step launches no reduce and memset kernels: on an H200 at the 30B shape batch 1
#: went from 14.75 to 14.42 ms/token and batch 64 from 16.57 to 16.45 ms/step
#: (benchmarks/results/gpu_decode_2026-11-30_serve).
CUBLAS_WORKSPACE = ":0:0"


def unsplit_cublas_products() -> None:
    """Use :data:`CUBLAS_WORKSPACE` unless the user chose a workspace; must run
    before the process's first cuBLAS call (torch reads the variable once)."""
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        log.debug("CUBLAS_WORKSPACE_CONFIG=%s (products without split-K)", CUBLAS_WORKSPACE)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` picks CUDA when torch sees a GPU, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` means bfloat16 on CUDA and float32 elsewhere."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    return DTYPES[dtype_name(dtype)]


#: Checkpoint precisions that are not quantized: on CUDA they load ``upcast`` by default.
UNQUANTIZED_FILE_TYPES = ("f32", "f16", "bf16", "mixed", "")


def resolve_weights(weights: str | None, device: torch.device, dtype: torch.dtype, file_type: str = "",
                    quantization: str | None = None) -> str:
    """``None`` means ``stored`` on the CPU with float32 activations for a checkpoint not
    stored in float32 (a float32 one runs the float32 reference path), ``stored`` on CUDA
    for a quantized checkpoint (GGUF blocks, FP8) or with ``quantization``, else ``upcast``.
    ``quantization`` (``fp8``) needs ``stored``; on the CPU, float32 activations too."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    cpu32 = device.type == "cpu" and dtype == torch.float32
    if weights is None:
        if device.type == "cuda":
            return "stored" if quantization or file_type not in UNQUANTIZED_FILE_TYPES else "upcast"
        return "stored" if cpu32 and (quantization or file_type not in ("f32", "")) else "upcast"
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    if weights == "stored" and device.type != "cuda" and not cpu32:
        raise ValueError("weights 'stored' runs on CUDA, or on the CPU with float32 activations "
                         f"(got device {device.type}, dtype {str(dtype).removeprefix('torch.')})")
    if quantization is not None and weights != "stored":
        raise ValueError(f"quantization {quantization!r} keeps the weights quantized: it needs weights 'stored'")
    return weights


def format_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """torch's intra-op threads set to 1 for the block, then restored."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prefill_row_bytes(config, dtype: torch.dtype, taps: int = 0) -> int:
    """Device memory one prompt row of a wide prefill step may hold at its peak: the fused
    gate/up product and its SwiGLU (``3 x intermediate``), the q/k/v/gate product, the
    attention's query, output and gated output, the hidden state, residual and norm
    outputs, and with a speculator's ``taps`` the tapped hidden states (stacked, and the
    draft's context input made of them), in the activation dtype, with a quarter more for
    the allocator's slack and the attention backends' workspaces (30B shape, bf16: ~269 KB;
    with DFlash's 5 taps ~436 KB)."""
    qkvg = 2 * config.num_heads * config.head_dim + 2 * config.num_kv_heads * config.head_dim
    elements = 3 * config.intermediate_size + qkvg + 3 * config.num_heads * config.head_dim + 4 * config.hidden_size
    elements += 2 * taps * config.hidden_size
    size = torch.empty((), dtype=dtype).element_size()
    return elements * size * 5 // 4


class TorchExecutor:
    """The Muse Glimmer text decoder behind the :class:`~musegl_core.engine.executor.Executor` protocol."""

    def __init__(self, checkpoint: Checkpoint, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 limits: ExecutorLimits | None = None, forward_sizes: Sequence[int] | None = None,
                 dummy_seed: int | None = None, vision: VisionWeights | None = None,
                 weights: str | None = None, async_steps: bool | None = None,
                 shard: TensorShard | None = None, quantization: str | None = None,
                 w8a8_rows: int | None = None, dummy_kind: str | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        """``forward_sizes``: decode widths to capture as CUDA graphs (None: the
        defaults on CUDA; ignored on the CPU; empty: no graphs).
        ``dummy_seed``: don't read weights, make random ones on the device
        with this seed (``--load-format dummy``). ``vision``: the vision
        tower's weights (a projector was loaded). ``weights``: ``stored`` keeps
        the checkpoint's matrices in their stored dtype (CPU and float32
        activations only; the default there), ``upcast`` converts them to
        ``dtype`` (None: the default for the device and dtype). ``async_steps``:
        let the engine launch a decode step before it reads the previous one
        (None: on CUDA, where the host's work then overlaps the device's; the
        CPU path computes every step when it is launched, so it gains nothing).
        ``shard``: run one rank's part of a tensor-parallel model
        (:mod:`musegl_cuda.parallel`; None: the whole model). ``quantization``: ``fp8``
        quantizes half-precision matrices to e4m3 at load (:mod:`musegl_cuda.quantization`).
        ``w8a8_rows``: on CUDA, FP8 products of at least this many rows run W8A8
        (:data:`~musegl_cuda.cuda.device_weights.W8A8_ROWS` when None). ``dummy_kind``: with
        ``dummy_seed`` on CUDA, random matrices as stored of this kind (``fp8``, a GGUF type, or
        ``q4_k_m``; ``quantization="fp8"`` means ``fp8``), for timing runs without a file. ``kv_cache_dtype``:
        ``auto`` keeps K/V in the activation dtype, ``fp8`` as float8 e4m3 with fixed
        per-layer, per-head scales (:mod:`musegl_cuda.kv_fp8`)."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_dtype = kv_fp8.storage_dtype(kv_cache_dtype, self.dtype)
        if kv_cache_dtype == "fp8":
            kv_fp8.check_device(self.device)
        self.weights = resolve_weights(weights, self.device, self.dtype, getattr(checkpoint, "file_type", ""),
                                       quantization)
        self.quantization = quantization
        dummy_kind = dummy_kind or quantization
        if dummy_seed is not None and dummy_kind and self.device.type != "cuda":
            raise ValueError("quantization with dummy weights runs on CUDA (random matrices made as stored)")
        if dummy_seed is not None and not (dummy_kind and self.device.type == "cuda"):
            self.weights = "upcast"  # random weights are made in the activation dtype
            self.quantization = None
        elif dummy_seed is not None:
            self.weights = "stored"  # random matrices as stored (device_weights.random_matrix)
        self.block_size = block_size
        #: what the K/V bytes depend on besides the tokens (kv_identity; the disk tier's format)
        self._identity = (getattr(checkpoint, "path", None), dummy_seed, dummy_kind, shard)
        self.paged = self.device.type == "cuda"
        if self.paged:
            unsplit_cublas_products()
        sizes: tuple[int, ...] = ()
        if self.paged:
            sizes = tuple(sorted(set(DEFAULT_FORWARD_SIZES if forward_sizes is None else forward_sizes)))
            if any(w <= 0 for w in sizes):
                raise ValueError("forward sizes must be positive")
        base = limits or ExecutorLimits()
        self._step_floor = base.max_step_tokens  # the widest step before the lone-prompt steps widen it
        solo = CUDA_SOLO_PREFILL_CHUNK if self.paged else None
        self.limits = ExecutorLimits(max(base.max_step_tokens, solo or 0), sizes or base.step_sizes,
                                     host_compute=self.device.type == "cpu",
                                     async_steps=self.paged if async_steps is None else async_steps,
                                     device_drafts=True,
                                     verify_rows=max(max(sizes), MIN_VERIFY_ROWS) if sizes else None,
                                     prefill_chunk=CUDA_PREFILL_CHUNK if self.paged else None,
                                     solo_prefill_chunk=solo)
        self.config = config = checkpoint.config
        self.info = ModelInfo(
            name=checkpoint.name,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            native_context=config.max_position_embeddings,
            dtype=str(self.dtype).removeprefix("torch."),
            backend="cuda" if self.device.type == "cuda" else "torch-cpu",
            vision=vision is not None,
        )
        #: weight bytes per dtype tag after loading (the memory the weights take)
        self.weight_bytes: dict[str, int] = {}
        with torch.inference_mode():
            on_device = self.weights == "stored" and self.device.type == "cuda"
            self.model = MuseGlimmerDecoder(config, self.dtype, self.device,
                                            stored=self.weights == "stored" and not on_device, shard=shard,
                                            device_weights=on_device)
            if dummy_seed is not None and on_device:
                self.weight_bytes = self.model.randomize_device(dummy_seed, dummy_kind, w8a8_rows)
            elif dummy_seed is not None:
                self.model.randomize(dummy_seed)
            elif on_device:  # CUDA: the matrices as stored (musegl_cuda.cuda.device_weights)
                for stored in checkpoint.iter_stored():
                    self.model.load_device(stored, self.quantization, w8a8_rows)
                self.weight_bytes = self.model.finish_device()
            elif self.weights == "stored":
                for stored in checkpoint.iter_stored():
                    # --quantization fp8 on the CPU: quantized, then decoded back to float32 at
                    # load (exactly the weights a GPU run holds)
                    self.model.load_stored(quantized_stored(stored) if self.quantization else stored)
                self.weight_bytes = self.model.finish_stored()
            else:
                loaded = set()
                for name, array in checkpoint.iter_weights():
                    self.model.load_weight(name, torch.from_numpy(array))
                    loaded.add(name)
                missing = set(MuseGlimmerDecoder.weight_names(config)) - loaded
                if missing:
                    raise ValueError(f"checkpoint did not provide {sorted(missing)[:5]}")
        self.model.eval()
        if not self.weight_bytes:
            size = torch.empty((), dtype=self.dtype).element_size()
            n = sum(p.numel() for p in self.model.parameters() if p.device.type != "meta")
            self.weight_bytes = {str(self.dtype).removeprefix("torch."): n * size}
        log.info("weights (%s, checkpoint %s): %s", self.weights, getattr(checkpoint, "file_type", "?"),
                 ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(self.weight_bytes.items()))
                 + f"; total {format_bytes(sum(self.weight_bytes.values()))}")
        self.vision = None if vision is None else load_vision_encoder(vision, config, self.dtype, self.device)
        # From here on the config as this rank's layers see it (its heads and KV heads: the KV
        # cache, the attention plans); the whole model's without tensor parallelism.
        self.config = config = self.model.local
        #: FP8 KV: ``(layers, 2, kv_heads)`` float32 scales, set from the weights (kv_fp8.layer_scales);
        #: each layer's attention reads its row
        self.kv_scales: torch.Tensor | None = None
        if kv_cache_dtype == "fp8":
            with torch.inference_mode():
                self.kv_scales = kv_fp8.layer_scales(self.model)
            for layer, scales in zip(self.model.layers, self.kv_scales):
                layer.self_attn.kv_scales = scales
            log.info("KV cache: float8 e4m3, fixed per-head scales from the weights (V scale %.3g .. %.3g)",
                     float(self.kv_scales[:, 1].min()), float(self.kv_scales[:, 1].max()))
        self.kv: torch.Tensor | None = None
        self.host_pages: HostPages | None = None  # the host tier (allocate_host_kv)
        #: sliding pages (:meth:`use_sliding_pages`): layers per page and each layer's (group, index)
        self.page_groups: PageGroups | None = None
        self.num_blocks = 0
        self.graphs = None
        self.taps: tuple[int, ...] = ()  # captured into the decode graphs (expect_taps)
        group = config.num_heads // config.num_kv_heads
        self.decode_block_m = max(16, 1 << (group - 1).bit_length())
        self.prefill_block_m = max(self.decode_block_m, 64 if self.dtype == torch.float32 else 128)
        self.table_cols = -(-config.max_position_embeddings // block_size)
        self.sm_count = (torch.cuda.get_device_properties(self.device).multi_processor_count
                         if self.paged else 1)
        # long single-sequence prefill chunks: their global layers through torch's fused attention
        self.dense_prefill = self.paged and dense_attention.available(
            self.device, self.dtype, config.num_heads, config.num_kv_heads, config.head_dim)
        self.samplers = None  # the sampler graphs of decode graph steps (musegl_cuda.cuda.sampling_graphs)
        self._previous: PendingStep | None = None  # the last launch (a following chunk reads its ids)
        self._drafted: DraftRows | None = None  # the launch's device-draft blocks, until judged
        self._unresolved: collections.deque[Launched] = collections.deque()  # launches not read yet
        self._profiler = StepProfiler.from_env()  # benchmark only (MUSEGL_BENCHMARK_PROFILE)
        self._views: tuple[torch.Tensor, list] | None = None  # the CPU path's per-layer cache views (_layer_views)

    # -- KV storage ------------------------------------------------------------

    def kv_identity(self) -> str:
        """Everything a block's K/V bytes depend on besides its tokens and the KV layout: the weights
        (the checkpoint's files, or the random seed), how they are kept and computed in (the disk
        tier's format, engine/kv_disk.py; a block written under another identity is never read)."""
        from musegl_core.engine.kv_disk import files_identity

        path, seed, kind, shard = self._identity
        weights = f"random:{seed}:{kind}" if seed is not None else files_identity(path)
        return (f"weights {weights} ({self.weights}, {self.quantization or 'no quantization'}), "
                f"{self.device.type} {str(self.dtype).removeprefix('torch.')}"
                + (f", shard {shard.plan!r}" if shard is not None else ""))

    def kv_bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return kv_position_bytes(self.config, self.kv_cache_dtype, itemsize) * self.block_size

    def kv_memory_available(self) -> int | None:
        """Free device memory on CUDA; MemAvailable of the machine on the CPU."""
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free)
        return available_ram()

    def expect_taps(self, taps: Sequence[int]) -> None:
        """Every step will ask for ``taps`` (a speculator's; called before
        :meth:`allocate_kv`): the decode graphs are captured with them, so
        tapped decode and verify steps replay a graph."""
        check_taps(tuple(taps), self.config.num_layers)
        if self.graphs is not None:
            raise RuntimeError("expect_taps must be called before allocate_kv")
        self.taps = tuple(taps)

    def use_sliding_pages(self) -> tuple[int, int, int] | None:
        """Store the cache as pages of layer groups, so sliding layers keep only their window
        (the engine's sliding pages, docs/engine.md): the full layers form one group, the
        sliding layers groups of as many; one tensor per place in a group,
        ``(places, 2, pages, block_size, kv_heads, head_dim)``, and a layer reads and writes
        its place at its group's pages (``SeqChunk.blocks`` for the full layers,
        ``SeqChunk.sliding_blocks[g]`` for sliding group ``g``). Called before
        :meth:`allocate_kv`; returns (sliding groups, window, sliding layers), or None where
        this executor does not offer it (a layout whose full layers do not form one group).
        A chunk that keeps its full layers (``SeqChunk.keep_full``, a rewind past the window)
        writes their K/V to a scratch page past the pool's. On CUDA the Triton kernels read
        each group's block table (:meth:`_forward_plan`); the decode graphs, captured with one
        table, are not captured then (every step runs eagerly)."""
        c = self.config
        if self.kv is not None:
            return None
        self.page_groups = PageGroups.of(c.sliding)
        if self.page_groups is None:
            return None
        return self.page_groups.sliding_groups, c.sliding_window, self.page_groups.sliding_layers

    def allocate_kv(self, num_blocks: int) -> None:
        """The paged cache; on CUDA one more block (``num_blocks``: the scratch block
        padding rows write) and the decode graphs, captured here. With sliding pages,
        ``num_blocks`` counts pages (:meth:`use_sliding_pages`)."""
        c = self.config
        extra = 1 if self.paged or self.page_groups is not None else 0
        places = c.num_layers if self.page_groups is None else self.page_groups.places
        self._views = None
        self.kv = torch.zeros(places, 2, num_blocks + extra, self.block_size, c.num_kv_heads, c.head_dim,
                              dtype=self.kv_dtype, device=self.device)
        self.num_blocks = num_blocks
        if self.paged and self.limits.step_sizes and self.page_groups is None:
            from musegl_cuda.cuda.graphs import DecodeGraphs

            from musegl_core.progress import loading_progress

            self.graphs = DecodeGraphs(self.model, self.kv, self.limits.step_sizes, self.block_size,
                                       self.table_cols, self.decode_block_m, self.sm_count, self.taps)
            with loading_progress("capturing CUDA graphs") as progress:
                self.graphs.capture(num_blocks, progress)
            from musegl_cuda.cuda.sampling_graphs import SamplerGraphs

            self.samplers = SamplerGraphs(self.graphs)
            with loading_progress("capturing sampler graphs") as progress:
                self.samplers.capture(self.graphs.pool, progress)
        if self.paged:
            self._warm_attention(num_blocks)
            self._fit_solo_chunk()

    def _fit_solo_chunk(self) -> None:
        """Shrink ``limits.solo_prefill_chunk`` and the widest step (``max_step_tokens``) to the
        prompt rows whose activations fit in the device memory the KV pool and the graphs left
        (:func:`prefill_row_bytes` each, in steps of 1,024, never below the prefill chunk): the
        pool takes most of the memory, so on a card with less room beside the weights a lone
        prompt gets narrower steps instead of running out of memory (and a wider
        ``--solo-prefill-chunk`` is refused at start-up)."""
        solo, chunk = self.limits.solo_prefill_chunk, self.limits.prefill_chunk or CUDA_PREFILL_CHUNK
        if not solo or solo <= chunk:
            return
        free, _total = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        fits = free // prefill_row_bytes(self.config, self.dtype, len(self.taps)) // 1024 * 1024
        rows = max(chunk, min(solo, fits))
        if rows != solo:
            log.info("a lone prompt prefills in steps of %d rows (--solo-prefill-chunk %d: %.1f GiB of device "
                     "memory left for activations)", rows, solo, free / 2**30)
            self.limits = attrs.evolve(self.limits, solo_prefill_chunk=rows,
                                       max_step_tokens=max(self._step_floor, rows))

    def _warm_attention(self, scratch_block: int) -> None:
        """Compile the attention launches of prefill and mixed steps now, not under the
        first requests (:func:`~musegl_cuda.cuda.kernels.warm_attention`), and plan the fused
        attention of long sequence-starting chunks (:func:`~musegl_cuda.cuda.dense_attention.warm`)."""
        import time

        from musegl_cuda.cuda.kernels import warm_attention

        c = self.config
        attn = self.model.layers[0].self_attn
        started = time.perf_counter()
        with torch.inference_mode():
            launches = warm_attention(self.kv[0, 0].view(-1, c.num_kv_heads, c.head_dim),
                                      self.kv[0, 1].view(-1, c.num_kv_heads, c.head_dim), self.block_size,
                                      scratch_block, c.num_heads, (self.decode_block_m, self.prefill_block_m),
                                      c.sliding_window, attn.qkvg.shape[0], attn.gate_offset, self.dtype,
                                      attn.kv_scales)
            torch.cuda.synchronize(self.device)
        log.info("attention kernels ready: %d kinds of launch in %.1f s", launches, time.perf_counter() - started)
        if self.model.device_weights:  # the weight products' launches of prefill and mixed steps
            from musegl_cuda.cuda.device_weights import warm_products

            started = time.perf_counter()
            with torch.inference_mode():
                products = warm_products(self.model.device_matrices(), self.model.embed_matrix)
                torch.cuda.synchronize(self.device)
            log.info("weight product kernels ready: %d products in %.1f s", products, time.perf_counter() - started)
        if self.dense_prefill:  # cuDNN's plans for the sequence-starting chunk lengths up to the prefill chunk
            started = time.perf_counter()
            with torch.inference_mode():
                lengths = dense_attention.warm(self.device, self.dtype, c.num_heads, c.num_kv_heads, c.head_dim,
                                               self.limits.prefill_chunk or CUDA_PREFILL_CHUNK)
                torch.cuda.synchronize(self.device)
            log.info("fused prefill attention ready: %d chunk lengths planned in %.1f s", lengths,
                     time.perf_counter() - started)

    @property
    def k_cache(self) -> list[torch.Tensor]:
        """Per-layer K views, each ``(blocks, block_size, kv_heads, head_dim)``."""
        return [layer[0] for layer in self._require_kv()]

    @property
    def v_cache(self) -> list[torch.Tensor]:
        return [layer[1] for layer in self._require_kv()]

    def _require_kv(self) -> torch.Tensor:
        return kv_allocated(self.kv)

    # -- the host tier (musegl_core.engine.kv_host.HostKV) -------------------------

    def allocate_host_kv(self, num_pages: int) -> None:
        """Host pages of the device cache's page shape; pinned on CUDA (musegl_cuda/host_kv.py)."""
        self.host_pages = HostPages(self._require_kv(), num_pages)

    def offload_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            with torch.inference_mode():
                self.host_pages.offload(self._require_kv(), pairs)

    def restore_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            with torch.inference_mode():
                self.host_pages.restore(self._require_kv(), pairs)

    def read_host_pages(self, pages: Sequence[int]) -> bytes:
        return self.host_pages.read(pages)

    def write_host_pages(self, pages: Sequence[int], data: bytes) -> None:
        self.host_pages.write(pages, data)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        kv = self._require_kv()
        if self.host_pages is not None:
            self.host_pages.await_pages(p for pair in pairs for p in pair)
        src = on_device([s for s, _ in pairs], self.device, torch.long)  # queued behind launched steps
        dst = on_device([d for _, d in pairs], self.device, torch.long)
        if kv.dtype == kv_fp8.FP8:  # as bytes: float8 indexing is not implemented everywhere
            kv = kv.view(torch.uint8)
        with torch.inference_mode():
            kv[:, :, dst] = kv[:, :, src]

    # -- stepping ----------------------------------------------------------------

    def _block_table(self, chunk: SeqChunk) -> torch.Tensor:
        """The chunk's block table as a tensor, checked against its positions and the pool."""
        needed = list(table_of(chunk, self.block_size, self.num_blocks))
        return torch.tensor(needed, dtype=torch.long, device=self.device)

    def _attention_batch(self, step: Step) -> AttentionBatch:
        """Cache slots (``block·block_size + offset``) to write and read, and the masks."""
        bs, window = self.block_size, self.config.sliding_window
        write, sequences, start, sampled = [], [], 0, []
        for chunk in step.chunks:
            n, sample = len(chunk.tokens), int(chunk.sample)
            sampled += [False] * (n - sample) + [True] * min(sample, n)
            first, last = chunk.positions[0], chunk.positions[-1]
            check_positions(chunk)
            table = self._block_table(chunk)
            k_pos = torch.arange(0, last + 1, device=self.device)
            slots = table[k_pos // bs] * bs + k_pos % bs  # every position 0..last
            q_pos = k_pos[first:]
            write.append(slots[first:])
            causal = k_pos[None, :] <= q_pos[:, None]
            lo = max(0, first - window + 1)  # the oldest key any row of a sliding layer can see
            in_window = (q_pos[:, None] - k_pos[None, lo:]) < window
            rows = slice(start, start + len(q_pos))
            sequences.append(SequenceAttention(rows, slots, causal, slots[lo:], causal[:, lo:] & in_window))
            start = rows.stop
        half = HalfRows.of(sampled) if self.model.stored else None
        return AttentionBatch(torch.cat(write), sequences, half=half)

    def _decode_batch(self, step: Step) -> AttentionBatch:
        """:meth:`_attention_batch` of a step of one row per sequence (stored mode): the slot
        each row writes and each row's key slots (:meth:`RowKeys.of_decode`), no masks."""
        bs = self.block_size
        tables, last, write = [], [], []
        for chunk in step.chunks:
            check_positions(chunk)
            pos = int(chunk.positions[0])
            table = table_of(chunk, bs, self.num_blocks)
            tables.append(table)
            last.append(pos)
            write.append(table[pos // bs] * bs + pos % bs)
        return AttentionBatch(torch.tensor(write, dtype=torch.long), keys=RowKeys.of_decode(tables, last, bs))

    def step(self, step: Step) -> StepOutput:
        """Run ``step`` and sample every sampled row of every chunk in one batched
        call: :meth:`launch`, then wait for it."""
        return self.launch(step).result()

    def launch(self, step: Step) -> PendingStep:
        """Queue ``step`` on the device and return before it is done (CUDA; the CPU
        path runs it here). On CUDA a decode-only step of a captured width replays
        its graph; every other step runs at its own width (the CPU path runs no
        padding rows). Chunks that :attr:`~SeqChunk.follows` the previous launch
        take its ids on the device where that launch was a graph step of one row
        per sequence, else from its result."""
        if self._profiler is not None:
            self._profiler.tick()
        previous, self._previous = self._previous, None
        self._drafted = None
        if not step.chunks:
            return FinishedStep(StepOutput())
        kv = self._require_kv()
        check_taps(step.taps, self.config.num_layers)
        while len(self._unresolved) > 1:  # at most two launched steps in flight: their buffers alternate
            self._unresolved.popleft().settle()
        if self.host_pages is not None and self.paged:  # a page a pending host copy reads or writes
            self.host_pages.await_pages(page for chunk in step.chunks
                                        for table in (chunk.blocks, *chunk.sliding_blocks) for page in table)
        with torch.inference_mode():
            if self.paged:
                pending = self._launch_paged(step, kv, previous)
            else:
                step = follow_on_host(step, previous)
                if self.model.stored and step.num_tokens <= SINGLE_THREADED_ROWS:
                    # A decode-sized step: its torch ops are tiny and gain nothing from
                    # intra-op threads but the cost of waking them; the weight products
                    # (the C kernels) keep their own threads.
                    with single_threaded():
                        pending = self._eager_outputs(step, kv)
                        pending.settle()
                else:
                    pending = self._eager_outputs(step, kv)
        if self._drafted is not None and isinstance(pending, Launched):  # a launch _outputs did not judge
            pending.judged = self._judge(pending.device_ids, pending.ids_by_row)
        self._previous = pending
        if isinstance(pending, Launched):
            self._unresolved.append(pending)
        return pending

    def _sliding_views(self, step: Step) -> list[Step]:
        """The step as each group of sliding layers sees it: every chunk with its group's pages
        as ``blocks`` (a page out of every row's window, -1, reads page 0 under a mask)."""
        groups = self.page_groups.sliding_groups
        views = []
        for group in range(groups):
            chunks = []
            for chunk in step.chunks:
                if len(chunk.sliding_blocks) != groups:
                    raise ValueError(f"sequence {chunk.seq}: {len(chunk.sliding_blocks)} sliding block tables, "
                                     f"the cache has {groups} groups of sliding layers")
                chunks.append(attrs.evolve(chunk, blocks=group_tables(chunk.blocks, chunk.sliding_blocks)[1 + group]))
            views.append(attrs.evolve(step, chunks=chunks))
        return views

    def _keep_full(self, step: Step, batch: AttentionBatch) -> AttentionBatch:
        """The full layers' batch with the rows of chunks that keep their full layers' K/V
        (``SeqChunk.keep_full``) writing to the scratch page past the pool's instead: they read
        the K/V already there."""
        if not any(chunk.keep_full for chunk in step.chunks):
            return batch
        write = batch.write_slots.clone()
        start = 0
        for chunk in step.chunks:
            if chunk.keep_full:
                write[start:start + len(chunk.tokens)] = self.num_blocks * self.block_size
            start += len(chunk.tokens)
        return attrs.evolve(batch, write_slots=write)

    def _run_eager(self, step: Step, kv: torch.Tensor):
        """:meth:`_forward_eager` with the head as a function of the packed rows it runs."""
        normed, hidden, starts = self._forward_eager(step, kv)
        return (lambda rows: self.model.logits(normed[rows])), hidden, starts

    def _forward_eager(self, step: Step, kv: torch.Tensor):
        """The CPU path's forward: the final-normed rows, the tapped hidden states, each chunk's first row."""
        vocab = self.config.vocab_size
        tokens = [t for c in step.chunks for t in c.tokens]
        check_tokens(tokens, vocab)
        decode = self.model.stored and all(len(chunk.tokens) == 1 for chunk in step.chunks)
        batch = self._decode_batch(step) if decode else self._attention_batch(step)
        layers_batch: AttentionBatch | list[AttentionBatch] = batch
        if self.page_groups is not None:  # each layer reads its group's pages
            batch = self._keep_full(step, batch)
            groups = [batch] + [self._decode_batch(view) if decode else self._attention_batch(view)
                                for view in self._sliding_views(step)]
            layers_batch = [groups[group] for group, _ in self.page_groups.layers]
        token_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.tensor([p for c in step.chunks for p in c.positions], device=self.device)
        starts = list(range(len(step.chunks))) if decode else [seq.rows.start for seq in batch.sequences]
        self._place_drafts(step, starts, token_ids)
        embeds = self._embedding_rows(step, starts)
        layers_kv = self._layer_views(kv)
        normed, hidden = self.model(token_ids, positions, layers_batch, layers_kv, tuple(step.taps), embeds)
        return normed, hidden, starts

    def _layer_views(self, kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) views of the cache ``kv`` (with sliding pages, its place in its
        group's pages), made once per cache tensor."""
        cached = self._views
        if cached is None or cached[0] is not kv:
            if self.page_groups is None:
                views = [(kv[i, 0], kv[i, 1]) for i in range(self.config.num_layers)]
            else:
                views = [(kv[j, 0], kv[j, 1]) for _, j in self.page_groups.layers]
            cached = self._views = (kv, views)
        return cached[1]

    def _eager_outputs(self, step: Step, kv: torch.Tensor) -> Launched:
        """The CPU path's step: :meth:`_run_eager`, then the head and the sampler
        (:meth:`_outputs`); where every chunk is plain greedy, the ids come from the head's
        raw product (:meth:`~musegl_cuda.model.MuseGlimmerDecoder.greedy_ids`: the same ids
        without the softcap of every vocabulary entry, and no sampler)."""
        normed, hidden, starts = self._forward_eager(step, kv)
        plan = None
        if all(plain_greedy(chunk) for chunk in step.chunks):
            plan = HeadRows.of(step, starts)
        if plan is None or plan.sampled != list(range(len(plan.rows))):
            return self._outputs(step, lambda rows: self.model.logits(normed[rows]), hidden, starts)
        if not plan.rows:
            drawn = Draw(0)
        else:
            every = plan.rows == list(range(normed.shape[0]))  # decode: no gather
            rows = normed if every else normed[on_device(plan.rows, self.device, torch.long)]
            drawn = Draw(len(plan.rows), self.model.greedy_ids(rows))
        judged = self._judge(drawn.chosen, by_row=False)
        launched = Sampled(step, starts, plan, None, hidden, drawn, None)
        launched.judged = judged
        return launched

    def _launch_paged(self, step: Step, kv: torch.Tensor, previous: PendingStep | None) -> PendingStep:
        c = self.config
        graphs = self.graphs
        chunks = step.chunks
        if graphs is not None and graphs.serves_taps(step.taps) and step.width in graphs.graphs:
            width = step.width
            tapped = bool(step.taps)
            if all(len(ch.tokens) == 1 and ch.sample == 1 and not ch.embeds for ch in chunks):
                # one decode row per sequence: staged without a plan, tables sent only where they changed
                sources = device_sources(step, previous)
                if sources is None:
                    step = follow_on_host(step, previous)
                    chunks = step.chunks
                if graphs.stage_decode(chunks, width, self.num_blocks, c.vocab_size, sources):
                    graphs.replay(width)
                    rows = {ch.seq: i for i, ch in enumerate(chunks)}
                    hidden = graphs.tapped_rows(width, len(chunks)) if tapped else None
                    if all(plain_greedy(ch) for ch in chunks):
                        return GreedyIds(chunks, graphs.fetch_ids(width, len(chunks)), rows, hidden=hidden)
                    sampled = self._sample_in_graph(step, width, list(range(len(chunks))), rows, hidden)
                    if sampled is not None:
                        return sampled
                    logits = graphs.logits[width]
                    return self._outputs(step, lambda r: logits[r], hidden, list(range(len(chunks))),
                                         rows, graphs.last_ids)
                step = follow_on_host(step, previous)
                chunks = step.chunks
            elif step.decode_only and not any(ch.embeds for ch in chunks):
                step = follow_on_host(step, previous)
                chunks = step.chunks
                # staged without a plan: only new table columns are sent (long contexts)
                starts = graphs.stage_rows(chunks, width, self.num_blocks, c.vocab_size,
                                           rows_per_tile(self.decode_block_m, c.num_heads // c.num_kv_heads))
                if starts is not None:
                    self._place_drafts(step, starts, graphs.tokens)
                    graphs.replay(width)
                    hidden = graphs.tapped_rows(width, step.num_tokens) if tapped else None
                    if all(plain_greedy(ch) for ch in chunks):
                        return GreedyIds(chunks, graphs.fetch_ids(width, step.num_tokens), None, starts, hidden,
                                         graphs.ids[width])
                    sampled = self._sample_in_graph(step, width, starts, None, hidden)
                    if sampled is not None:
                        return sampled
                    logits = graphs.logits[width]
                    return self._outputs(step, lambda r: logits[r], hidden, starts)
        step = follow_on_host(step, previous)
        block_m, split_tiles = self._dynamic_attention(step)
        plan = plan_step(step, self.block_size, self.num_blocks, c.vocab_size,
                         rows_per_tile(block_m, c.num_heads // c.num_kv_heads))
        normed, hidden = self._forward_plan(plan, kv, block_m, tuple(step.taps),
                                            self._embedding_rows(step, plan.starts), step, split_tiles)
        return self._outputs(step, lambda rows: self.model.logits(normed[rows]), hidden, plan.starts)

    def _sample_in_graph(self, step: Step, width: int, starts: list[int], rows: dict[int, int] | None,
                         hidden) -> Launched | None:
        """The sampler graph of ``width`` on the rows of a decode graph step just replayed
        (:mod:`musegl_cuda.cuda.sampling_graphs`); None where it cannot hold them."""
        if self.samplers is None:
            return None
        return self.samplers.launch(step, starts, width, rows, hidden)

    def _dynamic_attention(self, step: Step) -> tuple[int, int | None]:
        """The attention tiles' ``block_m`` of a step the dynamic path runs, and the tile count
        its key splits follow (None: its own tiles). A decode-only step no wider than the widest
        decode graph runs as its graph runs (:class:`~musegl_cuda.cuda.graphs.DecodeGraphs`: the
        decode tiles, the splits of ``step.width`` tiles), so that it gives the graph's values
        without graphs and where its block tables outgrow the graphs'. With the prefill tiles and
        its own tile count, a verify step of 4 x 2 rows split its keys otherwise (and on an H100 read
        them 128 a block, the wide prefill launch), and greedy ids parted from the graphs' in bf16
        (benchmarks/results/gpu_quantized_2026-12-07_h100, test_fp8_graphs_match_the_dynamic_path[2])."""
        if step.decode_only and step.width <= max(self.limits.step_sizes or DEFAULT_FORWARD_SIZES):
            return self.decode_block_m, step.width
        decode = all(len(chunk.tokens) == 1 for chunk in step.chunks)
        return (self.decode_block_m if decode else self.prefill_block_m), None

    def _forward_plan(self, plan: StepPlan, kv: torch.Tensor, block_m: int, taps: tuple[int, ...] = (),
                      embeds: tuple[torch.Tensor, torch.Tensor] | None = None, step: Step | None = None,
                      split_tiles: int | None = None):
        """The paged forward of ``plan`` outside any graph (prefill, mixed and wide steps);
        ``step``: the planned step, whose device drafts are placed into the tokens; ``split_tiles``:
        the tile count the key splits follow (default: the plan's; :meth:`_dynamic_attention`)."""
        from musegl_cuda.cuda.kernels import layer_splits

        c = self.config
        dev = self.device
        tiles = len(plan.tiles)
        sliding, full = layer_splits(split_tiles or tiles, c.num_kv_heads, self.sm_count)
        tables = torch.from_numpy(plan.tables).to(dev, non_blocking=True)
        dense = None
        if self.dense_prefill and len(plan.starts) == 1 and plan.num_tokens >= dense_attention.MIN_ROWS:
            n = plan.num_tokens
            dense = dense_attention.DenseKeys.of_table(tables[0], self.block_size, n, int(plan.positions[0]) + n)
        tiles_on_device = torch.from_numpy(plan.tiles).to(dev, non_blocking=True)
        slots = plan.slots
        if self.page_groups is not None:  # rows keeping their full layers' K/V write the scratch block
            slots = self._keep_full_slots(step, plan.starts, slots)
        meta = PagedMeta(torch.from_numpy(slots).to(dev, non_blocking=True), tables, tiles_on_device, tiles,
                         sliding, block_m, self.block_size, full, dense)
        tokens = torch.from_numpy(plan.tokens).to(dev, non_blocking=True)
        if step is not None:
            self._place_drafts(step, plan.starts, tokens)
        positions = torch.from_numpy(plan.positions).to(dev, non_blocking=True)
        if self.page_groups is None:
            layers_kv = [(kv[i, 0], kv[i, 1]) for i in range(c.num_layers)]
            return self.model.forward_paged(tokens, positions, meta, layers_kv, taps, embeds)
        # sliding pages: each group of sliding layers reads and writes its own pages (the same rows
        # and tiles, its own block tables and slots)
        group_rows = rows_per_tile(block_m, c.num_heads // c.num_kv_heads)
        metas = [meta]
        for view in self._sliding_views(step):
            grouped = plan_step(view, self.block_size, self.num_blocks, c.vocab_size, group_rows)
            metas.append(PagedMeta(torch.from_numpy(grouped.slots).to(dev, non_blocking=True),
                                   torch.from_numpy(grouped.tables).to(dev, non_blocking=True), tiles_on_device,
                                   tiles, sliding, block_m, self.block_size, full, None))
        layers_kv = [(kv[j, 0], kv[j, 1]) for _, j in self.page_groups.layers]
        layer_metas = [metas[group] for group, _ in self.page_groups.layers]
        return self.model.forward_paged(tokens, positions, layer_metas, layers_kv, taps, embeds)

    def _keep_full_slots(self, step: Step | None, starts: Sequence[int], slots):
        """``slots`` with the rows of chunks that keep their full layers' K/V
        (``SeqChunk.keep_full``) pointed at the scratch block past the pool's."""
        if step is None or not any(chunk.keep_full for chunk in step.chunks):
            return slots
        slots = slots.copy()
        for chunk, start in zip(step.chunks, starts):
            if chunk.keep_full:
                slots[start:start + len(chunk.tokens)] = self.num_blocks * self.block_size
        return slots

    def _place_drafts(self, step: Step, starts: Sequence[int], tokens: torch.Tensor) -> None:
        """Write the step's device drafts into ``tokens`` (the forward's token ids on the
        device) and keep their layout for :meth:`_judge`."""
        self._drafted = DraftRows.of(step, starts)
        if self._drafted is not None:
            self._drafted.place(tokens)

    def _judge(self, ids: torch.Tensor | None, by_row: bool):
        """The accepted counts of the placed drafts against the step's sampled ``ids``
        (:meth:`DraftRows.judge`), once; None when the step had no device drafts."""
        drafted, self._drafted = self._drafted, None
        return None if drafted is None else drafted.judge(ids, by_row)

    def _outputs(self, step: Step, head, hidden, starts: list[int], rows: dict[int, int] | None = None,
                 last_ids: torch.Tensor | None = None) -> "Launched":
        """Run the head on the rows somebody needs (:class:`HeadRows`) and sample them,
        queued on the device; the answer per sequence is packed when the step is
        read. ``last_ids``: where a graph step of one row per sequence leaves its
        ids for a step that follows it; ``rows`` (given with it) maps a sequence to its row."""
        plan = HeadRows.of(step, starts)
        logits = head(on_device(plan.rows, self.device, torch.long)) if plan.rows else None
        sample_rows = SampleRows.of(step)  # after the head: the engine's masks are computed meanwhile
        if not plan.sampled:
            drawn = Draw(0)
        elif plan.sampled == list(range(len(plan.rows))):  # every head row is sampled (decode): no gather
            drawn = choose(logits, sample_rows)
        else:
            drawn = choose(logits[on_device(plan.sampled, self.device, torch.long)], sample_rows)
        if last_ids is not None and drawn.chosen is not None:
            last_ids[:drawn.size].copy_(drawn.chosen)
        judged = self._judge(drawn.chosen, by_row=False)  # before fetch() moves the ids to the host
        launched = Sampled(step, starts, plan, logits, hidden, drawn.fetch(), rows)
        launched.judged = judged
        return launched

    def _embedding_rows(self, step: Step, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(packed row indices, their input rows) of every embedding span of the step
        (:func:`musegl_core.engine.embedding_rows.embedding_rows`), on the device."""
        found = embedding_rows(step, starts, self.config.hidden_size,
                               lambda embedding, first, count: torch.as_tensor(embedding)[first:first + count])
        if found is None:
            return None
        index, pieces = found
        return (torch.tensor(index, dtype=torch.long, device=self.device),
                torch.cat([rows.to(self.device, self.dtype) for rows in pieces]))

    # -- lending the embedding and head to a speculator (TargetAccess) ------------

    def embedding_rows(self, ids) -> torch.Tensor:
        """The raw token embedding rows of ``ids`` (no norm): ``ids.shape + (hidden,)``, on
        the device in the activation dtype (float32 from stored matrices)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        return self.model.embedding_rows(ids)

    def head_logits(self, hidden) -> torch.Tensor:
        """The raw lm_head product of ``(n, hidden)`` rows (no multiplier, no softcap)."""
        hidden = torch.as_tensor(hidden, device=self.device)
        model = self.model
        return model.head_product(hidden.float() if model.stored else hidden.to(model.dtype))

    def embed_image(self, image: PromptImage):
        """The image's decoder input rows ``(rows, hidden)`` (vision tower, adapter,
        projection, perception norm; :mod:`musegl_cuda.vision`)."""
        if self.vision is None:
            raise no_vision_error()
        with torch.inference_mode():
            pixels = torch.as_tensor(image.pixels, device=self.device)
            rows = self.vision(pixels, tuple(image.grid))
        return check_image_rows(rows, image)

    def release_sequence(self, seq: int) -> None:
        # sampling is keyed by (seed, position); the sampler graphs keep a penalized sequence's counts
        if self.samplers is not None:
            self.samplers.release(seq)

    def close(self) -> None:
        for pending in self._unresolved:
            pending.settle()
        self._unresolved.clear()
        self._previous = None
        self.graphs = None
        self.samplers = None
        self.kv = None
        self._views = None
        if self.host_pages is not None:
            self.host_pages.settle()
            self.host_pages = None
        self.num_blocks = 0
        self.model = None  # type: ignore[assignment]
        self.vision = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
