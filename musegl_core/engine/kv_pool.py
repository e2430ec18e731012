"""Tensor-free bookkeeping of the paged KV cache.

The pool hands out block ids; the executor stores the K/V tensors they index.
Blocks are reference counted so that a prefix can be shared by several
sequences (sessions, snapshots) and copied on write at the boundary.
Reservations guarantee that an admitted request can always grow to the size
it was admitted for: admission fails early instead of a step failing late.
"""

from __future__ import annotations

import attrs


class PoolExhausted(Exception):
    """Not enough free (unreserved) blocks."""


@attrs.define
class KVPool:
    num_blocks: int
    block_size: int
    _free: list[int] = attrs.field(init=False)
    _refs: list[int] = attrs.field(init=False)
    _reserved: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one position")
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._refs = [0] * self.num_blocks

    # -- accounting ------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def reserved_blocks(self) -> int:
        return self._reserved

    @property
    def available_blocks(self) -> int:
        """Free blocks nobody has reserved."""
        return len(self._free) - self._reserved

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # -- reservations ----------------------------------------------------------------
    def reserve(self, blocks: int) -> None:
        if blocks > self.available_blocks:
            raise PoolExhausted(f"need {blocks} KV blocks, {self.available_blocks} available")
        self._reserved += blocks

    def unreserve(self, blocks: int) -> None:
        if blocks > self._reserved:
            raise ValueError("unreserving more blocks than are reserved")
        self._reserved -= blocks

    # -- blocks ----------------------------------------------------------------------
    def allocate(self, reserved: bool = False) -> int:
        """Take one block (from the caller's reservation when ``reserved``)."""
        if reserved:
            self.unreserve(1)
        elif self.available_blocks < 1:
            raise PoolExhausted("no free KV block")
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def share(self, block: int) -> int:
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        self._refs[block] += 1
        return block

    def release(self, block: int) -> None:
        refs = self._refs[block]
        if refs < 1:
            raise ValueError(f"block {block} released twice")
        self._refs[block] = refs - 1
        if refs == 1:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]
