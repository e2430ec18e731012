"""``MLXExecutor``: the engine's executor contract (v2) over the MLX decoder.

The KV cache is paged and owned by block id, as the engine expects: per
layer one flat K and one flat V array of ``blocks·block_size`` slots
(``(slots, kv_heads, head_dim)``); position ``p`` of a chunk lives in slot
``blocks[p // block_size]·block_size + p % block_size``. Sessions, prefix
snapshots and copy-on-write therefore work unchanged: :meth:`copy_blocks`
copies slots, and a chunk that continues a sequence reads the slots earlier
steps (or a sharing sequence) wrote.

A step packs every row of every chunk: projections and MLPs run over all
rows at once, attention over all sequences at once (padded to the longest
chunk and context of the step, see :class:`~musegl_mlx.model.StepLayout`),
and every sampled row is sampled in one batched call
(:mod:`musegl_mlx.sampling`). MLX is lazy: one ``mx.eval`` per step runs
the whole graph (the cache writes included).
"""

from __future__ import annotations

import logging
import platform
from typing import Sequence

from musegl_mlx import blas

blas.route()  # before MLX is loaded: MLX binds its BLAS then (see musegl_mlx.blas)

import attrs  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from musegl_core.checkpoint.config import TextConfig  # noqa: E402
from musegl_core.engine.dtypes import COMPUTE_DTYPES, backend_dtypes  # noqa: E402
from musegl_core.engine.embedding_rows import check_image_rows, embedding_rows, no_vision_error  # noqa: E402
from musegl_core.engine.executor import (ExecutorLimits, HeadRows, ModelInfo, PromptImage, SeqChunk, Step,  # noqa: E402
                                         StepOutput)
from musegl_core.engine.memory import available_ram as host_ram  # noqa: E402
from musegl_core.engine.sample_rows import SampleRows  # noqa: E402
from musegl_core.engine.kv_dtype import KV_CACHE_DTYPES, kv_position_bytes  # noqa: E402
from musegl_mlx import kv_fp8  # noqa: E402
from musegl_core.engine.sliding_pages import PageGroups, group_tables  # noqa: E402
from musegl_core.engine.step_checks import check_copy_pairs, check_step, kv_allocated  # noqa: E402
from musegl_mlx.loader import load_weights  # noqa: E402
from musegl_core.allocator import release_free_heap  # noqa: E402
from musegl_mlx.model import MuseGlimmerDecoder, StepLayout  # noqa: E402
from musegl_mlx.precision import DtypeChoice, choose_dtype  # noqa: E402
from musegl_mlx.sampling import sample  # noqa: E402

log = logging.getLogger("musegl.mlx")

DEFAULT_BLOCK_SIZE = 16
DTYPES = backend_dtypes(lambda name: getattr(mx, name))
DTYPE_NAMES = {DTYPES[name]: name for name in COMPUTE_DTYPES}


def metal() -> bool:
    """True when MLX runs on Apple's GPU (Metal), False on the CPU build."""
    try:
        return bool(mx.metal.is_available())
    except AttributeError:
        return False


def dtype_choice(dtype: str | None, stored: str | None = None) -> DtypeChoice:
    """:func:`musegl_mlx.precision.choose_dtype` on this machine: ``dtype`` is
    ``--dtype`` (None: not given), ``stored`` the checkpoint's stored precision
    (``Checkpoint.file_type``; None: unknown)."""
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    return choose_dtype(dtype, stored, on_cpu=on_cpu, blas_routed=on_cpu and blas.routed())


def resolve_dtype(dtype: str | None, stored: str | None = None) -> mx.Dtype:
    """The MLX dtype of :func:`dtype_choice`."""
    return DTYPES[dtype_choice(dtype, stored).name]


def available_ram() -> int | None:
    """MemAvailable on Linux, the recommended working set on Metal, else None."""
    if metal():
        info = mx.metal.device_info()
        limit = int(info.get("max_recommended_working_set_size", 0))
        return max(0, limit - int(mx.get_active_memory())) if limit else None
    return host_ram()


class MLXExecutor:
    """The Muse Glimmer text decoder in MLX behind the
    :class:`~musegl_core.engine.executor.Executor` protocol."""

    def __init__(self, config: TextConfig, weights, name: str, dtype: str | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, limits: ExecutorLimits | None = None,
                 vision=None, stored_dtype: str | None = None, kv_cache_dtype: str = "auto") -> None:
        """``weights`` yields ``(name, weight)`` pairs (see :func:`musegl_mlx.loader.load_weights`);
        ``vision``: opened vision weights (:mod:`musegl_core.checkpoint.vision`), or None
        for a text-only load; ``dtype`` is ``--dtype`` and ``stored_dtype`` the
        checkpoint's stored precision, which decide the compute dtype together
        (:mod:`musegl_mlx.precision`). ``kv_cache_dtype``: ``auto`` keeps K/V in the compute
        dtype, ``fp8`` as e4m3 bytes with fixed per-head scales (:mod:`musegl_mlx.kv_fp8`)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.config = config
        choice = dtype_choice(dtype, stored_dtype)
        self.dtype = DTYPES[choice.name]
        self.block_size = block_size
        base = limits or ExecutorLimits()
        self.limits = ExecutorLimits(base.max_step_tokens, base.step_sizes,
                                     host_compute=mx.default_device().type == mx.DeviceType.cpu)
        self.info = ModelInfo(name=name, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                              num_layers=config.num_layers, native_context=config.max_position_embeddings,
                              dtype=DTYPE_NAMES[self.dtype], backend="mlx", vision=vision is not None)
        self.model = MuseGlimmerDecoder(config, self.dtype)
        load_weights(self.model, weights)
        self.kv_cache_dtype = kv_cache_dtype
        if kv_cache_dtype == "fp8":
            for layer in self.model.layers:
                layer.kv_scales = kv_fp8.layer_scales(layer, config.hidden_size)
            log.info("KV cache: float8 e4m3, fixed per-head scales from the weights")
        self.vision = None
        if vision is not None:
            from musegl_mlx.vision import load_vision_encoder

            self.vision = load_vision_encoder(vision, config, self.dtype)
        self.kv: list[list[mx.array]] | None = None  # [K per layer, V per layer], each (slots, kv_heads, hd)
        self.num_blocks = 0
        #: sliding pages (:meth:`use_sliding_pages`): one cache per place of a layer group
        self.page_groups: PageGroups | None = None
        log.info("MLX %s on %s (%s), %s", mx.__version__, "Metal" if metal() else "the CPU",
                 f"{platform.system()} {platform.machine()}", self.info.dtype)
        log.info("MLX computes in %s: %s", choice.name, choice.reason)
        if not metal():
            status = blas.route()
            log.info("MLX float32 products: %s", f"OpenBLAS ({status.library})" if status.routed
                     else f"MLX's own BLAS ({status.reason})")
        release_free_heap()  # the heap's holes that loading left (musegl_core.allocator)

    # -- KV storage ------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        return kv_position_bytes(self.config, self.kv_cache_dtype, self.dtype.size) * self.block_size

    def kv_memory_available(self) -> int | None:
        return available_ram()

    def use_sliding_pages(self) -> tuple[int, int, int] | None:
        """Keep the cache as pages of layer groups, so sliding layers keep only their window (the
        engine's sliding pages, docs/engine.md): one flat K and V cache per place of a group
        (:class:`~musegl_core.engine.sliding_pages.PageGroups`), each layer reading and writing
        its group's pages (``SeqChunk.blocks``, ``SeqChunk.sliding_blocks[g]``); one scratch page
        past the pool's takes the full layers' writes of ``keep_full`` rows. Called before
        :meth:`allocate_kv`; returns (sliding groups, window, sliding layers), or None."""
        if self.kv is not None:
            return None
        self.page_groups = PageGroups.of(self.config.sliding)
        if self.page_groups is None:
            return None
        return self.page_groups.sliding_groups, self.config.sliding_window, self.page_groups.sliding_layers

    def allocate_kv(self, num_blocks: int) -> None:
        c = self.config
        groups = self.page_groups
        pages = num_blocks if groups is None else num_blocks + 1  # sliding pages: a scratch page
        shape = (pages * self.block_size, c.num_kv_heads, c.head_dim)
        dtype = mx.uint8 if self.kv_cache_dtype == "fp8" else self.dtype  # fp8: e4m3 bytes
        caches = c.num_layers if groups is None else groups.places
        self.kv = [[mx.zeros(shape, dtype=dtype) for _ in range(caches)] for _ in range(2)]
        mx.eval(self.kv)
        self.num_blocks = num_blocks

    def _require_kv(self) -> list[list[mx.array]]:
        return kv_allocated(self.kv)

    # -- the host tier (musegl_core.engine.kv_host.HostKV; musegl_mlx/host_kv.py) ----

    def allocate_host_kv(self, num_pages: int) -> None:
        from musegl_mlx.host_kv import HostPages

        self.host_pages = HostPages(self._require_kv(), self.block_size, num_pages)

    def offload_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self.host_pages.offload(self._require_kv(), pairs)

    def restore_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self.host_pages.restore(self._require_kv(), pairs)

    def read_host_pages(self, pages: Sequence[int]) -> bytes:
        return self.host_pages.read(pages)

    def write_host_pages(self, pages: Sequence[int], data: bytes) -> None:
        self.host_pages.write(pages, data)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        kv = self._require_kv()
        bs = self.block_size
        check_copy_pairs(pairs, self.num_blocks)
        offsets = np.arange(bs)
        src = mx.array((np.array([s for s, _ in pairs])[:, None] * bs + offsets).reshape(-1).astype(np.int32))
        dst = mx.array((np.array([d for _, d in pairs])[:, None] * bs + offsets).reshape(-1).astype(np.int32))
        for cache in kv:
            for layer in cache:
                layer[dst] = layer[src]
        mx.eval(kv)

    # -- stepping ----------------------------------------------------------------

    def _slots(self, chunk: SeqChunk, table) -> np.ndarray:
        """The cache slot of every position ``0 .. last`` of the chunk (``table``: its
        checked block table, :func:`musegl_core.engine.step_checks.table_of`)."""
        bs, last = self.block_size, chunk.positions[-1]
        table = np.asarray(table, dtype=np.int64)
        p = np.arange(last + 1)
        return table[p // bs] * bs + p % bs

    def _layout(self, step: Step, tables) -> StepLayout:
        """Write slots, query padding and the key gathers and masks of both layer kinds
        (``tables``: the chunks' checked block tables)."""
        window = self.config.sliding_window
        chunks = step.chunks
        b = len(chunks)
        lq = max(len(c.tokens) for c in chunks)
        write, slots = [], []
        for chunk, table in zip(chunks, tables):
            s = self._slots(chunk, table)
            slots.append(s)
            write.append(s[chunk.positions[0]:])
        decode = lq == 1
        pad_index = unpad_index = None
        if not decode:
            pad = np.zeros((b, lq), dtype=np.int32)  # padding query rows read packed row 0
            unpad, start = [], 0
            for i, chunk in enumerate(chunks):
                n = len(chunk.tokens)
                pad[i, :n] = np.arange(start, start + n)
                unpad.extend(i * lq + np.arange(n))
                start += n
            pad_index = mx.array(pad.reshape(-1))
            unpad_index = mx.array(np.asarray(unpad, dtype=np.int32))

        def keys(lo_of) -> tuple[mx.array, mx.array]:
            los = [lo_of(c) for c in chunks]
            width = max(len(s) - lo for s, lo in zip(slots, los))
            gather = np.zeros((b, width), dtype=np.int32)
            mask = np.zeros((b, 1, lq, width), dtype=np.bool_)
            for i, (chunk, s, lo) in enumerate(zip(chunks, slots, los)):
                k_pos = np.arange(lo, len(s))
                gather[i, :len(k_pos)] = s[lo:]
                q_pos = np.asarray(chunk.positions)
                visible = (k_pos[None, :] <= q_pos[:, None])
                if lo_of is sliding_lo:
                    visible &= (q_pos[:, None] - k_pos[None, :]) < window
                mask[i, 0, :len(q_pos), :len(k_pos)] = visible
                mask[i, 0, len(q_pos):, 0] = True  # padding query rows see one key (no empty softmax)
            return mx.array(gather), mx.array(mask)

        def full_lo(chunk: SeqChunk) -> int:
            return 0

        def sliding_lo(chunk: SeqChunk) -> int:
            return max(0, chunk.positions[0] - window + 1)

        full_slots, full_mask = keys(full_lo)
        if any(self.config.sliding):
            sliding_slots, sliding_mask = keys(sliding_lo)
        else:
            sliding_slots, sliding_mask = full_slots, full_mask
        return StepLayout(mx.array(np.concatenate(write).astype(np.int32)), b, lq, pad_index, unpad_index,
                          full_slots, full_mask, sliding_slots, sliding_mask)

    def step(self, step: Step) -> StepOutput:
        """Run ``step`` at its own width (no padding rows) and sample every sampled
        row of every chunk in one batched call."""
        if not step.chunks:
            return StepOutput()
        kv = self._require_kv()
        c = self.config
        tables = check_step(step, self.block_size, self.num_blocks, c.vocab_size, c.num_layers)
        tokens = [t for chunk in step.chunks for t in chunk.tokens]
        layout = self._layout(step, tables)
        starts = list(np.cumsum([0] + [len(ch.tokens) for ch in step.chunks[:-1]]))
        positions = [p for chunk in step.chunks for p in chunk.positions]
        places = None
        if self.page_groups is not None:  # each layer reads and writes its group's pages
            layout, places = self._group_layouts(step, layout), [j for _, j in self.page_groups.layers]
        normed, hidden = self.model(mx.array(np.asarray(tokens, dtype=np.int32)),
                                    mx.array(np.asarray(positions, dtype=np.int32)), layout, kv,
                                    tuple(step.taps), self._embedding_rows(step, starts), places)
        return self._outputs(step, normed, hidden, starts, kv)

    def _group_layouts(self, step: Step, full: StepLayout) -> list[StepLayout]:
        """Each layer's layout with sliding pages: the full layers' ``full`` (rows of
        ``keep_full`` chunks writing the scratch page instead: their K/V are in the cache),
        each sliding group's from its pages."""
        groups = self.page_groups
        if any(chunk.keep_full for chunk in step.chunks):
            write, start = np.array(full.write_slots), 0
            for chunk in step.chunks:
                if chunk.keep_full:
                    write[start:start + len(chunk.tokens)] = self.num_blocks * self.block_size
                start += len(chunk.tokens)
            full = attrs.evolve(full, write_slots=mx.array(write))
        layouts = [full]
        for group in range(groups.sliding_groups):
            view = []
            for chunk in step.chunks:
                if len(chunk.sliding_blocks) != groups.sliding_groups:
                    raise ValueError(f"sequence {chunk.seq}: {len(chunk.sliding_blocks)} sliding block tables, "
                                     f"the cache has {groups.sliding_groups} groups of sliding layers")
                view.append(attrs.evolve(chunk, blocks=group_tables(chunk.blocks, chunk.sliding_blocks)[1 + group]))
            layouts.append(self._layout(attrs.evolve(step, chunks=view),
                                        check_step(attrs.evolve(step, chunks=view), self.block_size,
                                                   self.num_blocks, self.config.vocab_size)))
        return [layouts[group] for group, _ in groups.layers]

    def _outputs(self, step: Step, normed: mx.array, hidden: mx.array | None, starts: list[int],
                 kv: list[list[mx.array]]) -> StepOutput:
        """Run the head on the rows somebody needs (:class:`HeadRows`), sample, and pack
        the answer per sequence."""
        plan = HeadRows.of(step, starts)
        rows = SampleRows.of(step)
        logits = self.model.logits(normed[mx.array(np.asarray(plan.rows, dtype=np.int32))]) if plan.rows else None
        # One evaluation for the whole step: the forward, every cache write, the head.
        mx.eval(kv, *(a for a in (logits, hidden) if a is not None))
        ids, logprobs = (sample(logits[mx.array(np.asarray(plan.sampled, dtype=np.int32))], rows)
                         if plan.sampled else ([], []))
        want = any(chunk.logit_rows or chunk.want_logits for chunk in step.chunks)
        return plan.output(step, starts, np.array(logits) if want else None, ids, logprobs, hidden)

    def _embedding_rows(self, step: Step, starts: list[int]) -> tuple[mx.array, mx.array] | None:
        """(packed row indices, their input rows) of every embedding span of the step
        (:func:`musegl_core.engine.embedding_rows.embedding_rows`), as MLX arrays."""
        def take(embedding, first: int, count: int) -> mx.array:
            if isinstance(embedding, mx.array):
                return embedding[first:first + count]
            return mx.array(np.asarray(embedding)[first:first + count])

        found = embedding_rows(step, starts, self.config.hidden_size, take)
        if found is None:
            return None
        index, pieces = found
        return mx.array(np.asarray(index, dtype=np.int32)), mx.concatenate([r.astype(self.dtype) for r in pieces])

    # -- lending the embedding and head to a speculator (TargetAccess) ------------

    def embedding_rows(self, ids) -> mx.array:
        """The raw token embedding rows of ``ids`` (no norm): ``ids.shape + (hidden,)``,
        widened to float32 (numpy reads no bfloat16 MLX array)."""
        ids = mx.array(np.asarray(ids, dtype=np.int32))
        rows = self.model.embed_tokens(ids.reshape(-1), self.dtype)
        return rows.reshape(*ids.shape, -1).astype(mx.float32)

    def head_logits(self, hidden) -> mx.array:
        """The raw lm_head product of ``(n, hidden)`` rows (no multiplier, no softcap),
        computed in the executor's dtype and widened to float32."""
        if not isinstance(hidden, mx.array):
            hidden = mx.array(np.asarray(hidden, dtype=np.float32))
        return self.model.lm_head(hidden.astype(self.dtype)).astype(mx.float32)

    def embed_image(self, image: PromptImage):
        """The image's decoder input rows ``(rows, hidden)`` as an MLX array (vision
        tower, adapter, projection, perception norm; :mod:`musegl_mlx.vision`)."""
        if self.vision is None:
            raise no_vision_error()
        rows = self.vision(image.pixels, tuple(image.grid))
        mx.eval(rows)
        return check_image_rows(rows, image)

    def release_sequence(self, seq: int) -> None:
        pass  # no per-sequence state: sampling is keyed by (seed, position)

    def close(self) -> None:
        self.kv = None
        self.host_pages = None
        self.num_blocks = 0
        self.model = None  # type: ignore[assignment]
        self.vision = None
        if metal():
            mx.clear_cache()
