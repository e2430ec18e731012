"""Tensor-free bookkeeping of the paged KV cache.

The pool hands out block ids; the executor stores the K/V tensors they index.
Blocks are reference counted so that a prefix can be shared by several
sequences (sessions, snapshots) and copied on write at the boundary.
Reservations guarantee that an admitted request can always grow to the size
it was admitted for: admission fails early instead of a step failing late.

**Prefix caching.** A block may carry a *key*: the content hash of the token
prefix whose K/V it holds (:mod:`musegl_core.engine.prefix_cache` computes
it). A keyed block is immutable: writers copy it first (:meth:`immutable`).
When the last holder releases a keyed block it is not wiped: it joins the
*cached* blocks, kept in least-recently-released order, where a later request
with the same prefix can pick it up again (:meth:`share`). Cached blocks are
free blocks: they count as available for reservations and are evicted, oldest
first, only when an allocation finds no never-cached free block, so caching
never reduces capacity and reservations stay exact.

**Sliding pages** (``companions`` > 0, docs/engine.md "Sliding layers keep
their window"): the pool's units are *pages*, each holding the K/V of one
group of layers for ``block_size`` positions. A block id is the page of the
full-attention layers; a block taken from the pool comes with ``companions``
more pages, one for each group of sliding-window layers. Once no holder's
window reaches a block, its companion pages go back to the pool
(:meth:`drop_companions`) while the block itself stays. Counts
(``num_blocks``, ``free_blocks``, reservations) are then in pages; a block
costs :attr:`pages_per_block` of them. With ``companions`` 0 a page is a block.
"""

from __future__ import annotations

import collections

import attrs


class PoolExhausted(Exception):
    """Not enough free (unreserved) blocks."""


@attrs.define
class KVPool:
    num_blocks: int  # pages (blocks when companions is 0)
    block_size: int
    companions: int = 0  # sliding pages per block (groups of sliding layers), 0: none
    _free: list[int] = attrs.field(init=False)  # free pages holding nothing reusable
    _cached: collections.OrderedDict = attrs.field(init=False)  # free keyed blocks, LRU first
    _refs: list[int] = attrs.field(init=False)
    _reserved: int = attrs.field(init=False, default=0)
    _key_of: dict[int, bytes] = attrs.field(init=False, factory=dict)
    _block_of: dict[bytes, int] = attrs.field(init=False, factory=dict)
    evicted: int = attrs.field(init=False, default=0)  # cached blocks reused for other content
    _companion_pages: dict[int, list[int]] = attrs.field(init=False, factory=dict)  # block -> its sliding pages
    _cached_pages: int = attrs.field(init=False, default=0)  # pages the cached blocks hold
    #: called as ``on_evict(block, key)`` before a cached block is reused for other content (its
    #: pages still hold the keyed K/V): the host tier takes it (SessionTable.evicted_to_host)
    on_evict: object = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one position")
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._cached = collections.OrderedDict()
        self._refs = [0] * self.num_blocks

    # -- accounting ------------------------------------------------------------------
    @property
    def pages_per_block(self) -> int:
        return 1 + self.companions

    def pages(self, block: int) -> int:
        """The pages ``block`` holds: itself and its companions still kept."""
        return 1 + len(self._companion_pages.get(block, ()))

    @property
    def free_blocks(self) -> int:
        """Pages nobody holds (cached blocks' included)."""
        return len(self._free) + self._cached_pages

    @property
    def used_blocks(self) -> int:
        """Blocks held by at least one session, snapshot or running request."""
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Free blocks that still hold a keyed prefix (reusable until evicted)."""
        return len(self._cached)

    @property
    def reserved_blocks(self) -> int:
        return self._reserved

    @property
    def available_blocks(self) -> int:
        """Free blocks nobody has reserved."""
        return self.free_blocks - self._reserved

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
        """Take one block (from the caller's reservation when ``reserved``).

        A never-cached free block is preferred; otherwise the least recently
        released cached block is evicted (its key forgotten)."""
        need = self.pages_per_block
        if reserved:
            self.unreserve(need)
        elif self.available_blocks < need:
            raise PoolExhausted("no free KV block")
        while len(self._free) < need:  # evict the least recently released cached blocks
            old, _ = self._cached.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old, self._key_of[old])
            self._cached_pages -= self.pages(old)
            self._forget(old)
            self._free.append(old)
            self._free.extend(self._companion_pages.pop(old, ()))
            self.evicted += 1
        block = self._free.pop()
        if self.companions:
            self._companion_pages[block] = [self._free.pop() for _ in range(self.companions)]
        self._refs[block] = 1
        return block

    def share(self, block: int) -> int:
        """Add a holder to ``block``: an allocated block, or a cached one (revived)."""
        if self._refs[block] < 1:
            if block not in self._cached:
                raise ValueError(f"block {block} is not allocated")
            del self._cached[block]
            self._cached_pages -= self.pages(block)
        self._refs[block] += 1
        return block

    def release(self, block: int) -> None:
        refs = self._refs[block]
        if refs < 1:
            raise ValueError(f"block {block} released twice")
        self._refs[block] = refs - 1
        if refs == 1:
            if block in self._key_of:
                self._cached[block] = None  # most recently released: evicted last
                self._cached_pages += self.pages(block)
            else:
                self._free.append(block)
                self._free.extend(self._companion_pages.pop(block, ()))

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def immutable(self, block: int) -> bool:
        """Whether a writer must copy ``block`` first: shared, or keyed for reuse."""
        return self._refs[block] > 1 or block in self._key_of

    # -- sliding pages ---------------------------------------------------------------
    def companion_pages(self, block: int) -> list[int] | None:
        """The sliding pages of ``block`` (None once they went back to the pool)."""
        return self._companion_pages.get(block) if self.companions else None

    def has_window(self, block: int) -> bool:
        """Whether ``block`` still holds its sliding layers' K/V (always, without sliding pages)."""
        return not self.companions or block in self._companion_pages

    def drop_companions(self, block: int) -> int:
        """Give a held block's sliding pages back to the pool; how many."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not held")
        pages = self._companion_pages.pop(block, ())
        self._free.extend(pages)
        return len(pages)

    # -- prefix keys -----------------------------------------------------------------
    def register(self, block: int, key: bytes) -> bool:
        """Key a held block by the content hash of its prefix. False (and nothing
        changes) when the block is keyed already or another block has this key."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        if block in self._key_of or key in self._block_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def lookup(self, key: bytes) -> int | None:
        """The block (held or cached) keyed ``key``, if any."""
        return self._block_of.get(key)

    def key(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
