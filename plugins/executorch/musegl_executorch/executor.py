"""``ExecuTorchExecutor``: the executor contract v2 over an exported program.

The program (``musegl export``) runs on the CPU through ``executorch.runtime``
(XNNPACK-delegated products, portable kernels for the rest). The KV cache is
off-graph: this class owns the pool tensors ``k_pool``/``v_pool`` of shape
``(layers, blocks·block_size, kv_heads, head_dim)``, hands them to every call
unchanged (graph inputs are not memory-planned, so the runtime reads them in
place) and writes the returned rows at their cells. The engine owns block ids
as with every executor. Sampling is the torch executor's batched sampler
(:mod:`musegl_cuda.sampling`) on the returned logits. A program exported with
``--sliding-pages`` keeps one pool row per place of a layer group and follows
the engine's sliding pages (:meth:`ExecuTorchExecutor.use_sliding_pages`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from musegl_core.engine.dtypes import backend_dtypes, dtype_name
from musegl_core.engine.embedding_rows import check_image_rows
from musegl_core.engine.executor import ExecutorLimits, HeadRows, ModelInfo, PromptImage, Step, StepOutput
from musegl_core.engine.kv_sizing import kv_block_bytes
from musegl_core.engine.memory import available_ram
from musegl_core.engine.step_checks import kv_allocated
from musegl_core.engine.sample_rows import SampleRows
from musegl_core.errors import ConfigError
from musegl_cuda.sampling import sample
from musegl_core.engine.sliding_pages import PageGroups
from musegl_executorch.abi import Pages, plan_calls
from musegl_executorch.artifact import Manifest, directory_of, read_manifest
from musegl_executorch.pools import copy_pool_blocks
from musegl_executorch.export.lower import EMBED_TEXT, FROM_EMBEDDINGS, VISION_ENCODER

BLOCK_SIZE = 16
DTYPES = backend_dtypes(lambda name: getattr(torch, name))


class ExecuTorchExecutor:
    """The exported Muse Glimmer decoder behind :class:`~musegl_core.engine.executor.Executor`."""

    def __init__(self, model: str, max_context: int | None = None) -> None:
        from executorch.runtime import Runtime

        self.manifest: Manifest = read_manifest(model)
        self.model = model
        m = self.manifest
        if max_context is not None and max_context > m.limits.native_context:
            raise ConfigError(f"--max-context {max_context} is beyond the exported native context "
                              f"{m.limits.native_context} of {model}")
        directory = directory_of(model)
        runtime = Runtime.get()
        if not runtime.backend_registry.is_available("XnnpackBackend"):
            raise ConfigError("this executorch wheel has no XNNPACK backend; the export cannot run")
        self.program = runtime.load_program(directory / m.program, data_path=directory / m.data)
        missing = [name for name in m.methods if name not in self.program.method_names]
        if missing:
            raise ConfigError(f"{model}: the program lacks the method {missing[0]} its manifest lists")
        self.methods = {name: self.program.load_method(name) for name in m.methods}
        # the pybinding's call, which can return outputs without cloning them (executorch 1.5)
        self._calls = {name: method._method for name, method in self.methods.items()}
        self.config = c = m.config
        self.dtype = DTYPES[dtype_name(m.activation_dtype)]
        self.block_size = BLOCK_SIZE
        self.limits = ExecutorLimits(step_sizes=tuple(m.limits.forward_sizes), host_compute=True)
        self.info = ModelInfo(
            name=m.name, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_layers,
            native_context=m.limits.native_context, dtype=m.activation_dtype, backend="executorch-xnnpack",
            vision=m.vision is not None, hidden_states=m.dflash is not None,
            vision_patches=m.vision.max_patches if m.vision else None,
        )
        self.k_pool: torch.Tensor | None = None
        self.v_pool: torch.Tensor | None = None
        self.num_blocks = 0  # pages of the pool (blocks, without sliding pages)
        #: a program exported with sliding pages: its layer groups, and how a call finds each group's pages
        self.page_groups = PageGroups.of(c.sliding) if m.sliding_pages else None
        self.pages: Pages | None = None
        self.sliding = False  # the engine's sliding pages on (use_sliding_pages)

    # -- KV storage ----------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        return kv_block_bytes(self.config, self.block_size, self.dtype.itemsize)

    def kv_memory_available(self) -> int | None:
        """MemAvailable, but never more blocks than the program's ``max_cells`` accept."""
        pages = 1 + (self.page_groups.sliding_groups if self.page_groups is not None else 0)  # pages a block
        cap = (self.manifest.limits.max_cells // self.block_size // pages) * self.kv_bytes_per_block()
        ram = available_ram()
        return cap if ram is None else min(ram, cap)

    def use_sliding_pages(self) -> tuple[int, int, int] | None:
        """Follow the engine's sliding pages (docs/engine.md "Sliding layers keep their window"):
        only a program exported with ``--sliding-pages``, whose pools hold one row per place of a
        layer group and whose calls take one set of window cells per sliding group. Called before
        :meth:`allocate_kv`; (sliding groups, window, sliding layers), or None."""
        groups = self.page_groups
        if groups is None or self.k_pool is not None:
            return None
        self.sliding = True
        return groups.sliding_groups, self.config.sliding_window, groups.sliding_layers

    def allocate_kv(self, num_blocks: int) -> None:
        """The off-graph pools: ``num_blocks`` blocks of every layer; with a program exported with
        sliding pages, rows of places, and ``num_blocks`` pages when the engine's sliding pages are
        on, else every block's fixed page in each group (every position kept)."""
        groups = self.page_groups
        pages = num_blocks if groups is None or self.sliding else num_blocks * (1 + groups.sliding_groups)
        if groups is not None:
            self.pages = Pages(groups.sliding_groups, None if self.sliding else num_blocks)
        cells = pages * self.block_size
        if cells > self.manifest.limits.max_cells:
            raise ConfigError(f"a KV pool of {num_blocks} blocks ({cells} cells) exceeds the {self.manifest.limits.max_cells} "
                              f"cells the program was exported for (musegl export --max-cells)")
        c = self.config
        rows = c.num_layers if groups is None else groups.places
        shape = (rows, max(cells, 2), c.num_kv_heads, c.head_dim)
        self.k_pool = torch.zeros(shape, dtype=self.dtype)
        self.v_pool = torch.zeros(shape, dtype=self.dtype)
        self.num_blocks = pages

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pages = self.pages
        if pages is not None and pages.fixed is not None:  # every position kept: each group's fixed page too
            pairs = [(s + g * pages.fixed, d + g * pages.fixed) for g in range(1 + pages.sliding_groups)
                     for s, d in pairs]
        copy_pool_blocks(self._pool(), pairs, self.block_size)

    def _pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        kv_allocated(self.v_pool)
        return kv_allocated(self.k_pool), self.v_pool

    # -- stepping --------------------------------------------------------------------------

    def step(self, step: Step) -> StepOutput:
        """Run the step as program calls (:func:`musegl_executorch.abi.plan_calls`),
        then sample every sampled row in one batched call."""
        if not step.chunks:
            return StepOutput()
        taps = self._tap_index(step.taps)
        embedded = frozenset(i for i, chunk in enumerate(step.chunks) if chunk.embeds)
        if embedded and self.manifest.vision is None:
            raise ValueError("the ExecuTorch program has no image input; this model cannot encode images")
        k_pool, v_pool = self._pool()
        starts = np.cumsum([0] + [len(chunk.tokens) for chunk in step.chunks[:-1]]).tolist()
        plan = HeadRows.of(step, starts)
        needed = [list(where) for where in plan.where]  # each chunk's head rows, ascending
        c, lim = self.config, self.manifest.limits
        calls = plan_calls(step.chunks, needed, block_size=self.block_size, num_blocks=self.num_blocks,
                           window=c.sliding_window, vocab=c.vocab_size, sizes=lim.forward_sizes,
                           max_chunk=lim.max_prefill_chunk, embedded=embedded, min_head_rows=lim.min_head_rows,
                           pages=self.pages)
        # the head's rows in HeadRows order, copied once out of each call's output
        logits = torch.empty((len(plan.rows), c.vocab_size), dtype=torch.float32) if plan.rows else None
        hidden = None if taps is None else torch.empty((len(taps), int(starts[-1]) + len(step.chunks[-1].tokens),
                                                        c.hidden_size), dtype=self.dtype)
        for call in calls:
            i = call.inputs
            inputs = [torch.from_numpy(i["tokens"]), torch.from_numpy(i["positions"]), k_pool, v_pool,
                      torch.from_numpy(i["full_slots"]), torch.from_numpy(i["full_bias"]),
                      torch.from_numpy(i["window_slots"]), torch.from_numpy(i["window_bias"]),
                      torch.from_numpy(i["head_rows"])]
            if call.method == FROM_EMBEDDINGS:
                inputs[0] = self._input_rows(step.chunks[call.pieces[0].chunk], call.pieces[0], i["tokens"])
            out, new_k, new_v, *tapped = self._execute(call.method, inputs)
            if call.sliding_writes is None:
                write_rows(k_pool, v_pool, new_k, new_v, None, call.write_slots)
            else:  # each group's layers at their places, at the group's cells
                for group, slots in enumerate([call.write_slots, *call.sliding_writes]):
                    write_rows(k_pool, v_pool, new_k, new_v, self._group_layers[group], slots)
            if call.head_of:
                gather_rows(logits, [plan.where[i][r] for i, r in call.head_of], out, list(call.head_of.values()))
            if hidden is not None:
                rows = call.inputs["tokens"].shape[1]
                for g, piece in enumerate(call.pieces):
                    at = int(starts[piece.chunk]) + piece.lo
                    n = piece.hi - piece.lo
                    hidden[:, at:at + n] = tapped[0][taps, g * rows:g * rows + n]
        sampled = None if not plan.sampled else (
            logits if plan.sampled == list(range(len(plan.rows))) else logits[plan.sampled])
        ids, logprobs = sample(sampled, SampleRows.of(step)) if plan.sampled else ([], [])
        return plan.output(step, starts, logits, ids, logprobs, hidden)

    @property
    def _group_layers(self) -> list[torch.Tensor]:
        """Each group's layers, in the order of their places (sliding pages)."""
        found = getattr(self, "_layers_of_groups", None)
        if found is None:
            groups = self.page_groups
            found = [torch.tensor(sorted((i for i, (g, _) in enumerate(groups.layers) if g == group),
                                         key=lambda i: groups.layers[i][1]))
                     for group in range(1 + groups.sliding_groups)]
            self._layers_of_groups = found
        return found

    def _tap_index(self, taps: Sequence[int]) -> list[int] | None:
        """Where each requested tap is in the program's ``hidden`` output (None: no taps)."""
        if not taps:
            return None
        exported = self.manifest.dflash.taps if self.manifest.dflash else ()
        missing = [t for t in taps if t not in exported]
        if missing:
            raise ValueError(f"the ExecuTorch program returns the hidden states of layers {list(exported)}, "
                             f"not {missing} (export it with musegl export MODEL --dflash DRAFT)")
        return [exported.index(t) for t in taps]

    def dflash_speculator(self, flags):
        """The speculator over the program's own draft (``draft_context``/``draft_block``),
        for the DFlash plugin's flags (``--dflash`` naming this export, ``--dflash-n-draft``;
        checked by :func:`musegl_executorch.plugin.check_dflash` when the executor loaded)."""
        from musegl_dflash.plugin import TargetShape, resolve
        from musegl_executorch.drafter import ProgramDrafter

        d = self.manifest.dflash
        if d is None:
            raise ConfigError(f"{self.model}: the export holds no DFlash draft")
        c = self.config
        n_draft = resolve(flags, d.config, TargetShape(c.vocab_size, c.hidden_size, c.num_layers))
        return ProgramDrafter(self, d, n_draft)

    def execute(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One call of the program's ``method`` (the drafter's draft methods), as :meth:`_execute`."""
        return self._execute(method, inputs)

    def _execute(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One program call. The outputs alias the method's planned memory (no copy:
        ``executorch.runtime.Method.execute`` clones every output, a vocabulary-wide
        copy of the logits per call); they are valid until that method runs again, so
        the caller copies what it keeps (the head rows) and writes the K/V rows at once."""
        return self._calls[method](inputs, clone_outputs=False)

    def _input_rows(self, chunk, piece, tokens: np.ndarray) -> torch.Tensor:
        """``(1, T, hidden)`` input rows of a piece of a chunk with image rows: ``embed_text``
        of its tokens, the image rows of its spans written over their placeholders."""
        rows = self._execute(EMBED_TEXT, [torch.from_numpy(np.ascontiguousarray(tokens[0]))])[0].clone()
        for span in chunk.embeds:
            lo, hi = max(piece.lo, span.offset), min(piece.hi, span.offset + span.count)
            if lo >= hi:
                continue
            source = torch.as_tensor(span.embedding)
            if source.ndim != 2 or source.shape[1] != self.config.hidden_size or \
                    span.first + span.count > source.shape[0]:
                raise ValueError(f"sequence {chunk.seq}: embedding rows must be (>= {span.first + span.count}, "
                                 f"{self.config.hidden_size}), got {tuple(source.shape)}")
            first = span.first + lo - span.offset
            rows[lo - piece.lo:hi - piece.lo] = source[first:first + hi - lo].to(rows.dtype)
        return rows[None]

    def embed_image(self, image: PromptImage):
        """The image's decoder input rows ``(rows, hidden)`` through ``vision_encoder`` (the
        grid's position taps, RoPE, window mask and merge order computed here)."""
        vision = self.manifest.vision
        if vision is None:
            raise ValueError("the ExecuTorch program has no vision encoder; this model cannot encode images "
                             "(export it with musegl export MODEL --mmproj PROJECTOR)")
        from musegl_executorch.export.vision import grid_inputs

        gh, gw = (int(v) for v in image.grid)
        pixels = torch.as_tensor(np.asarray(image.pixels, dtype=np.float32))
        if gh * gw > vision.max_patches:
            raise ValueError(f"the image has {gh * gw} patches; the program's vision encoder takes at most "
                             f"{vision.max_patches} (musegl export --max-vision-patches)")
        if gh < 1 or gw < 1 or gh % 2 or gw % 2 or pixels.shape != (gh * gw, 3 * vision.config.patch_size ** 2):
            raise ValueError(f"image pixels {tuple(pixels.shape)} do not fit the patch grid {gh}x{gw}")
        pos_index, pos_weight, cos, sin, *windows = grid_inputs(vision.config, (gh, gw))
        # the eager tower casts its RoPE table to the activation dtype before the float32 rotation
        cos, sin = cos.to(self.dtype).float(), sin.to(self.dtype).float()
        rows = self._execute(VISION_ENCODER, [pixels.contiguous(), pos_index, pos_weight, cos, sin,
                                              *windows])[0].clone()
        return check_image_rows(rows, image)

    def release_sequence(self, seq: int) -> None:
        pass  # no per-sequence state: the pool is indexed by the engine's block ids

    def close(self) -> None:
        self.methods = {}
        self._calls = {}
        self.program = None
        self.k_pool = self.v_pool = None
        self.num_blocks = 0




def write_rows(k_pool: torch.Tensor, v_pool: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
               layers: torch.Tensor | None, slots: np.ndarray) -> None:
    """Write a call's new K/V rows at their cells (``slots``, -1: not written): every layer's
    (``layers`` None), or those of one group's ``layers`` at their places (rows 0.. of the pools)."""
    real = np.flatnonzero(slots >= 0)
    if not real.size:
        return
    at = torch.from_numpy(slots[real])
    rows = torch.from_numpy(real)
    if layers is None:
        k_pool[:, at] = new_k[:, rows]
        v_pool[:, at] = new_v[:, rows]
    else:
        places = torch.arange(len(layers))[:, None]
        k_pool[places, at[None, :]] = new_k[layers][:, rows]
        v_pool[places, at[None, :]] = new_v[layers][:, rows]


def gather_rows(into: torch.Tensor, at: list[int], source: torch.Tensor, rows: list[int]) -> None:
    """``into[at[k]] = source[rows[k]]``, as one slice copy when both runs are consecutive."""
    n = len(at)
    if at == list(range(at[0], at[0] + n)) and rows == list(range(rows[0], rows[0] + n)):
        into[at[0]:at[0] + n].copy_(source[rows[0]:rows[0] + n])
    else:
        into[torch.tensor(at)] = source[torch.tensor(rows)]
