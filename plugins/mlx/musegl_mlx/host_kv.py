"""The MLX executor's host tier (``--kv-offload-memory``, musegl_core/engine/kv_host.py).

The device cache is one array per layer and K/V, ``(blocks * block_size, kv_heads,
head_dim)``; the host tier keeps arrays of the same layout for ``host_pages`` blocks,
and a page's copy moves its ``block_size`` rows in every layer. MLX evaluates lazily:
each copy is evaluated before it returns, so a later step reads (or overwrites) the
device rows only after it, in the engine's order. On Apple silicon host and device
share memory: the tier is a budget of its own, beside the pool, that idle sessions
move to instead of being dropped.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np


class HostPages:
    def __init__(self, kv: list[list[mx.array]], block_size: int, num_pages: int) -> None:
        self.block_size = block_size
        self.host = [[mx.zeros((num_pages * block_size, *layer.shape[1:]), dtype=layer.dtype) for layer in cache]
                     for cache in kv]
        mx.eval(self.host)

    def _rows(self, pages: Sequence[int]) -> mx.array:
        offsets = np.arange(self.block_size)
        return mx.array((np.asarray(pages, dtype=np.int64)[:, None] * self.block_size + offsets)
                        .reshape(-1).astype(np.int32))

    def offload(self, kv: list[list[mx.array]], pairs: Sequence[tuple[int, int]]) -> None:
        src, dst = self._rows([s for s, _ in pairs]), self._rows([d for _, d in pairs])
        for cache, host in zip(kv, self.host):
            for layer, kept in zip(cache, host):
                kept[dst] = layer[src]
        mx.eval(self.host)

    def restore(self, kv: list[list[mx.array]], pairs: Sequence[tuple[int, int]]) -> None:
        src, dst = self._rows([s for s, _ in pairs]), self._rows([d for _, d in pairs])
        for cache, host in zip(kv, self.host):
            for layer, kept in zip(cache, host):
                layer[dst] = kept[src]
        mx.eval(kv)

    def _raw(self, array: mx.array) -> np.ndarray:
        """An array's bytes (bfloat16, which numpy lacks, as uint16)."""
        return np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)

    def read(self, pages: Sequence[int]) -> bytes:
        rows = self._rows(pages)
        parts = []
        for page in range(len(pages)):  # page by page: one page's bytes together, as the tiers store them
            span = rows[page * self.block_size:(page + 1) * self.block_size]
            parts.extend(self._raw(kept[span]).tobytes() for host in self.host for kept in host)
        return b"".join(parts)

    def write(self, pages: Sequence[int], data: bytes) -> None:
        rows = self._rows(pages)
        at = 0
        for page in range(len(pages)):
            span = rows[page * self.block_size:(page + 1) * self.block_size]
            for host in self.host:
                for i, kept in enumerate(host):
                    like = self._raw(kept[span])
                    size = like.nbytes
                    values = np.frombuffer(data[at:at + size], dtype=like.dtype).reshape(like.shape)
                    array = mx.array(values)
                    kept[span] = array.view(mx.bfloat16) if kept.dtype == mx.bfloat16 else array
                    at += size
        mx.eval(self.host)
