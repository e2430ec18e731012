"""The host tier: KV pages kept in host RAM below the device pool (``--kv-offload-memory``).

Tensor-free bookkeeping, like :class:`~musegl_core.engine.kv_pool.KVPool`: the
tier hands out *host page* ids; the executor (its optional :class:`HostKV`
capability, :func:`host_kv`) stores the K/V they index and copies pages between
the device pool and them. A device page is one unit of the pool's storage (a
block, or with sliding pages one layer group's part of a block); a host page
holds exactly one device page.

What lives here are whole blocks of holders that are not running: an idle
session's or a snapshot's blocks moved down when the device pool ran short
(:meth:`~musegl_core.engine.sessions.SessionTable.make_room`), and the prefix
cache's blocks the pool evicted. Each moved block is a :class:`HostBlock`: its
host pages (the block's, then its sliding pages still kept) and its prefix key
when the prefix cache keyed it. Nothing is recomputed on the way back: a
returning session's blocks are copied back into device pages
(:meth:`HostTier.restore`) and count as cached tokens.

**A tier below.** :class:`KVTier` is the interface a lower tier (disk) offers
the host tier: ``put``/``get``/``contains`` of one block's bytes by its prefix
key. :attr:`HostTier.lower`, when set, receives every keyed block the host tier
lets go of (:meth:`HostTier.hand_down`), and :meth:`HostTier.fetch` brings one
back into host pages. The bytes of a block are the executor's host pages,
concatenated (:meth:`HostKV.read_host_pages` / :meth:`HostKV.write_host_pages`).
"""

from __future__ import annotations

import collections
from typing import Protocol, Sequence, runtime_checkable

import attrs


class HostFull(Exception):
    """The host tier has not the pages asked for."""


@runtime_checkable
class HostKV(Protocol):
    """Optional executor capability: host-RAM pages below the device pool (docs/executor.md).

    The engine calls :meth:`allocate_host_kv` once, after ``allocate_kv``; then the copies,
    from the engine thread, in the order the engine wants them done with respect to steps and
    ``copy_blocks``: a device page offloaded may be handed to another sequence's write by the
    next step, and a restored page is read by the next step (a backend that copies
    asynchronously orders its copy stream against its steps, as the torch executor on CUDA
    does)."""

    def allocate_host_kv(self, num_pages: int) -> None:
        """Allocate host storage for ``num_pages`` pages (pinned memory where that speeds copies)."""

    def offload_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device page ``src`` into host page ``dst``, for each ``(src, dst)``."""

    def restore_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host page ``src`` into device page ``dst``, for each ``(src, dst)``."""

    def read_host_pages(self, pages: Sequence[int]) -> bytes:
        """The bytes of host ``pages``, concatenated (a block handed down to a lower tier)."""

    def write_host_pages(self, pages: Sequence[int], data: bytes) -> None:
        """Fill host ``pages`` from ``data`` (what :meth:`read_host_pages` returned)."""


def host_kv(executor: object) -> HostKV | None:
    """``executor`` as a :class:`HostKV` when it offers every method of it, else None."""
    names = [name for name, value in vars(HostKV).items() if callable(value) and not name.startswith("_")]
    if all(callable(getattr(executor, name, None)) for name in names):
        return executor  # type: ignore[return-value]
    return None


@runtime_checkable
class KVTier(Protocol):
    """A tier below the host tier, addressed by a block's prefix key (BLAKE2b-128 of the
    token prefix up to the block's end, salted: :mod:`musegl_core.engine.prefix_cache`).
    ``data`` is one block's bytes as :meth:`HostKV.read_host_pages` gives them; a tier
    stores them whole and gives them back unchanged."""

    name: str  # the cache_source label of its hits ("disk")

    def contains(self, key: bytes) -> bool:
        """Whether ``get(key)`` would find the block."""

    def put(self, key: bytes, data: bytes) -> None:
        """Keep a block (a tier that is full drops what its own policy says)."""

    def get(self, key: bytes) -> bytes | None:
        """The block's bytes, or None."""


@attrs.define(eq=False)
class HostBlock:
    """One block moved down: its host pages (the block's own first, then the sliding
    pages it still kept) and the prefix key it had in the device pool (None: unkeyed)."""

    pages: tuple[int, ...]
    key: bytes | None = None


@attrs.define
class HostTier:
    """Host pages: which are free, and the counters the metrics read.

    ``executor`` does the copies (:class:`HostKV`); ``page_bytes`` is one page's size."""

    num_pages: int
    page_bytes: int
    executor: HostKV
    lower: KVTier | None = None
    _free: list[int] = attrs.field(init=False)
    _keys: collections.Counter = attrs.field(init=False, factory=collections.Counter)  # keys of held host blocks
    offloaded_blocks: int = 0  # blocks moved down
    restored_blocks: int = 0  # blocks moved back up
    dropped_blocks: int = 0  # blocks let go of (with their holder, or handed to the tier below)
    restores: int = 0  # holders restored (returning sessions, snapshots)
    restore_seconds: float = 0.0  # the engine thread's time restoring them (on CUDA the copies finish on a side stream)

    def __attrs_post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError("a host tier needs at least one page")
        self._free = list(range(self.num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    # -- moving blocks ---------------------------------------------------------------------
    def offload(self, blocks: Sequence[tuple[Sequence[int], bytes | None]], count: bool = True) -> list[HostBlock]:
        """Copy blocks down: each given as (its device pages, its prefix key); their host
        blocks, in order. :class:`HostFull` (nothing taken) when the pages are not free.
        ``count`` False: sliding pages alone, counted by their holder (not as offloaded blocks)."""
        need = sum(len(pages) for pages, _ in blocks)
        if need > len(self._free):
            raise HostFull(f"need {need} host pages, {len(self._free)} free")
        moved, pairs = [], []
        for pages, key in blocks:
            host = tuple(self._free.pop() for _ in pages)
            pairs.extend(zip(pages, host))
            moved.append(HostBlock(host, key))
            if key is not None:
                self._keys[key] += 1
        if pairs:
            self.executor.offload_pages(pairs)
        if count:
            self.offloaded_blocks += len(moved)
        return moved

    def restore(self, pairs: Sequence[tuple[int, int]], blocks: int) -> None:
        """Copy host pages back into device pages (``(host, device)`` pairs) for ``blocks``
        blocks; the host pages stay taken until :meth:`free`."""
        if pairs:
            self.executor.restore_pages(pairs)
        self.restored_blocks += blocks

    def free(self, blocks: Sequence[HostBlock], hand_down: bool = False) -> None:
        """Give ``blocks``' host pages back; ``hand_down``: their keyed ones go to the tier
        below first (:meth:`hand_down`)."""
        for block in blocks:
            if hand_down:
                self.hand_down(block)
            self._free.extend(block.pages)
            if block.key is not None:
                self._keys[block.key] -= 1
                if self._keys[block.key] <= 0:
                    del self._keys[block.key]

    def hand_down(self, block: HostBlock) -> bool:
        """Give a keyed block to the tier below (:attr:`lower`); whether it went."""
        if self.lower is None or block.key is None or self.lower.contains(block.key):
            return False
        self.lower.put(block.key, self.executor.read_host_pages(block.pages))
        self.dropped_blocks += 1
        return True

    def fetch(self, key: bytes, pages: int) -> HostBlock | None:
        """Bring the block keyed ``key`` (at most ``pages`` pages: a block whose sliding pages had
        left the device has fewer) up from the tier below into host pages; None when the tier
        below has it not or the host tier has no room."""
        if self.lower is None or pages > len(self._free):
            return None
        data = self.lower.get(key)
        if data is None or len(data) % self.page_bytes or not 0 < len(data) // self.page_bytes <= pages:
            return None
        host = tuple(self._free.pop() for _ in range(len(data) // self.page_bytes))
        self.executor.write_host_pages(host, data)
        self._keys[key] += 1
        return HostBlock(host, key)

    def read_blocks(self, blocks: Sequence[Sequence[int]]) -> list[bytes]:
        """The bytes of device blocks (each given as its device pages), copied through free host
        pages that are free again afterwards (a copy written through to the tier below; no
        offload is counted). :class:`HostFull` when the pages are not free."""
        need = sum(len(pages) for pages in blocks)
        if need > len(self._free):
            raise HostFull(f"need {need} host pages, {len(self._free)} free")
        hosts = [tuple(self._free.pop() for _ in pages) for pages in blocks]
        try:
            self.executor.offload_pages([pair for pages, host in zip(blocks, hosts) for pair in zip(pages, host)])
            return [self.executor.read_host_pages(host) for host in hosts]
        finally:
            for host in hosts:
                self._free.extend(host)

    def holds(self, key: bytes) -> bool:
        """Whether a host block keyed ``key`` is here."""
        return key in self._keys

    def stats(self) -> dict:
        return {
            "kv_host_pages_total": self.num_pages,
            "kv_host_pages_used": self.used_pages,
            "kv_host_bytes_used": self.used_bytes,
            "kv_host_offloaded_blocks": self.offloaded_blocks,
            "kv_host_restored_blocks": self.restored_blocks,
            "kv_restores": self.restores,
            "kv_restore_seconds": self.restore_seconds,
        }


#: ``--kv-offload-memory``'s ceiling when the flag is not given
DEFAULT_HOST_BYTES = 8 << 30
#: ... and the share of the machine's available RAM it may take at most
DEFAULT_HOST_SHARE = 0.25


def default_host_bytes(*, slot_bytes: int, available_ram: int | None) -> int:
    """The host tier's size when ``--kv-offload-memory`` is not given: what every session slot
    and snapshot fills at ``--max-context`` (``slot_bytes``; more could never be used), at most
    :data:`DEFAULT_HOST_BYTES` (llama.cpp's ``--cache-ram`` default, a size every serving
    machine spares) and at most :data:`DEFAULT_HOST_SHARE` of the RAM available at start-up
    (the weights' page cache and the front need the rest)."""
    cap = DEFAULT_HOST_BYTES
    if available_ram is not None:
        cap = min(cap, int(available_ram * DEFAULT_HOST_SHARE))
    return max(0, min(slot_bytes, cap))
