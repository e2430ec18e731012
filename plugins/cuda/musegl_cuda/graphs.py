"""Captured CUDA graphs of decode steps, one per width in ``step_sizes``.

Every graph reads the same static device buffers (tokens, positions, cache
slots, block tables, attention tiles), sized for the widest graph; a step
copies its :class:`~musegl_cuda.plan.StepPlan` into them and replays the
graph of its width (the engine already padded it: ``Step.width``). A graph
runs the whole decoder and the head over every row and leaves float32
logits ``(width, vocab)`` in a static output; sampling runs after the replay.
Graphs share one memory pool and are captured widest first.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from musegl_cuda.kernels import attention_splits
from musegl_cuda.model import MuseGlimmerDecoder, PagedMeta
from musegl_cuda.plan import StepPlan

log = logging.getLogger("musegl.cuda")


class DecodeGraphs:
    """The decode graphs of one executor (see the module docstring)."""

    def __init__(self, model: MuseGlimmerDecoder, kv: torch.Tensor, sizes: tuple[int, ...], block_size: int,
                 cols: int, block_m: int, sm_count: int) -> None:
        self.model = model
        self.kv = kv
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        self.cols = cols
        self.block_m = block_m
        self.sm_count = sm_count
        device = kv.device
        widest = self.sizes[-1]
        self.tokens = torch.zeros(widest, dtype=torch.long, device=device)
        self.positions = torch.zeros(widest, dtype=torch.long, device=device)
        self.slots = torch.zeros(widest, dtype=torch.long, device=device)
        self.tables = torch.zeros(widest + 1, cols, dtype=torch.int32, device=device)
        self.tiles = torch.zeros(widest, 4, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _run(self, width: int) -> torch.Tensor:
        config = self.model.config
        meta = PagedMeta(self.slots[:width], self.tables, self.tiles[:width], width,
                         attention_splits(width, config.num_kv_heads, self.sm_count), self.block_m,
                         self.block_size)
        layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(config.num_layers)]
        normed, _ = self.model.forward_paged(self.tokens[:width], self.positions[:width], meta, layers)
        return self.model.logits(normed)

    def capture(self, scratch_block: int, progress: Callable[[int, int, str], None] | None = None) -> float:
        """Capture every width (rows all padding, writing ``scratch_block``); returns seconds."""
        start = time.perf_counter()
        self.slots.fill_(scratch_block * self.block_size)
        self.tables.zero_()
        self.tables[:, 0] = scratch_block
        self.tiles.zero_()
        widest = self.sizes[-1]
        rows = torch.arange(widest, dtype=torch.int32, device=self.tiles.device)
        self.tiles[:, 0] = widest  # the padding table row
        self.tiles[:, 1] = rows
        self.tiles[:, 2] = 1
        pool = None
        with torch.inference_mode():
            for done, width in enumerate(reversed(self.sizes)):
                if progress is not None:
                    progress(done, len(self.sizes), f"decode graph width {width}")
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile the kernels, settle the allocator
                        self._run(width)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[width] = self._run(width)
                pool = graph.pool()
                self.graphs[width] = graph
            torch.cuda.synchronize()
        if progress is not None:
            progress(len(self.sizes), len(self.sizes), "decode graphs captured")
        elapsed = time.perf_counter() - start
        log.info("captured %d decode graphs (widths %s) in %.1f s", len(self.sizes),
                 ",".join(map(str, self.sizes)), elapsed)
        return elapsed

    def fits(self, plan: StepPlan) -> bool:
        return plan.width in self.graphs and plan.tables.shape[1] <= self.cols

    def replay(self, plan: StepPlan) -> torch.Tensor:
        """Copy ``plan`` (padded to a captured width, tiles padded to the width) into
        the static buffers and replay; the float32 logits ``(width, vocab)``."""
        width = plan.width
        self.tokens[:width].copy_(torch.from_numpy(plan.tokens), non_blocking=True)
        self.positions[:width].copy_(torch.from_numpy(plan.positions), non_blocking=True)
        self.slots[:width].copy_(torch.from_numpy(plan.slots), non_blocking=True)
        seqs, cols = plan.tables.shape
        self.tables[:seqs, :cols].copy_(torch.from_numpy(plan.tables), non_blocking=True)
        # the padding table row of the capture stays the last row: a plan's padding rows
        # use their own table row (index len(chunks)), copied above.
        self.tiles[:width].copy_(torch.from_numpy(plan.tiles), non_blocking=True)
        self.graphs[width].replay()
        return self.logits[width]
