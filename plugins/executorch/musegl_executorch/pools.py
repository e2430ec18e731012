"""The off-graph KV pools an exported program reads and writes (the target's and the draft's):
copy-on-write of their cells, shared by the executor and the drafter."""

from __future__ import annotations

from typing import Sequence

import torch


def copy_pool_blocks(pools: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]], block_size: int) -> None:
    """Copy-on-write in off-graph pools ``(layers, cells, ...)``: every cell of block ``src``
    to the same offset of block ``dst``, for each ``(src, dst)`` pair."""
    if not pairs:
        return
    src = torch.tensor([s * block_size + o for s, _ in pairs for o in range(block_size)], dtype=torch.long)
    dst = torch.tensor([d * block_size + o for _, d in pairs for o in range(block_size)], dtype=torch.long)
    for pool in pools:
        pool[:, dst] = pool[:, src]
