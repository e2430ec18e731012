"""Session slots, named sessions and prefix snapshots (docs/sessions.md).

A **slot** holds the KV blocks of one resident session (blocks on demand:
exactly those its positions fill while it is idle; a running request reserves
what it may still take to its end, :meth:`SessionTable.reserve_run`). Named sessions keep their slot, transcript and
KV between requests; an anonymous request borrows a temporary slot for its
lifetime. ``--max-sessions`` bounds the slots; ``--prefix-cache-entries``
adds one slot per **snapshot**: a frozen prefix (token ids and the blocks that
hold their K/V) that any later request may share by reference. Independently
of both, the automatic prefix cache (:mod:`musegl_core.engine.prefix_cache`)
lets any request adopt full blocks whose content hash matches its prompt.

Every session has the ``cache_salt`` of the request that opened it: reuse
from snapshots and from the prefix cache happens only between sessions of
the same salt (None is the shared unsalted space), and a named session keeps
its salt for its lifetime (:class:`SaltMismatch`).

Block accounting is exact: the pool's reservations are the running requests'
``reserved`` blocks, and a running request can always take them (the
admission guarantee: an admitted request can always finish). When a request
cannot reserve what it needs, idle sessions and snapshots make room
(:meth:`SessionTable.make_room`): idle soft sessions first, then snapshots,
then, with ``--evict-idle-sessions``, idle named sessions, least recently used
first; their keyed blocks stay in the prefix cache until the pool reuses them.
Releasing a request returns every block that no session or snapshot still holds.
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

import attrs

from musegl_core.engine.kv_host import HostBlock, HostFull, HostTier
from musegl_core.engine.kv_pool import KVPool, PoolExhausted
from musegl_core.engine.prefix_cache import PrefixCache, block_key, chain_root
from musegl_core.engine.replay import ReplayLog
from musegl_core.engine.retention import evict_order, idle_timeout


class CapacityError(Exception):
    """No session slot is free (and none may be evicted)."""


class SessionBusy(Exception):
    """The session has a running or queued request."""


class SaltMismatch(Exception):
    """A request names an existing session with a different ``cache_salt``."""


@attrs.frozen
class SessionInfo:
    """What ``GET /v1/sessions`` shows about one named session.

    ``state`` is ``active`` (a request runs or waits on it) or ``idle``;
    ``cached_tokens`` counts the positions whose K/V it keeps;
    ``idle_seconds`` is the time since its last request ended (0 while active).
    """

    id: str
    state: str
    cached_tokens: int
    idle_seconds: float
    queued_requests: int = 0
    retention: str | None = None  # the residency its requests asked for (engine/retention.py)


@attrs.define(eq=False)
class Slot:
    """The KV blocks one holder (a session or a snapshot) has, and the blocks it
    may still take: ``reserved``, promised by the pool (:meth:`KVPool.reserve`).

    Blocks on demand: an idle session or a snapshot reserves nothing; it holds
    exactly the blocks its positions fill. A running request reserves, when it
    starts, the blocks it may still take to its end (:meth:`grow`), so an
    admitted request can always finish; what it did not use is given back when
    it ends (:meth:`settle`). ``budget`` is what the holder may reach:
    ``len(blocks) + reserved``."""

    pool: KVPool
    blocks: list[int] = attrs.field(factory=list)
    reserved: int = 0
    #: a rewind past the window (sliding pages): the running request's own sliding pages of the
    #: blocks it recomputes, by block index, and the pages it may still take for them
    window_pages: dict[int, list[int]] = attrs.field(factory=dict)
    page_reserve: int = 0

    @classmethod
    def open(cls, pool: KVPool, budget: int = 0) -> "Slot":
        pool.reserve(budget * pool.pages_per_block)
        return cls(pool, [], budget)

    @property
    def budget(self) -> int:
        return len(self.blocks) + self.reserved

    def grow(self, blocks: int) -> None:
        """Reserve ``blocks`` more (:class:`~musegl_core.engine.kv_pool.PoolExhausted` when the pool has not them)."""
        if blocks > 0:
            self.pool.reserve(blocks * self.pool.pages_per_block)
            self.reserved += blocks

    def settle(self) -> None:
        """Give back every reserved block: the slot holds what it filled, nothing more."""
        self.pool.unreserve(self.reserved * self.pool.pages_per_block)
        self.reserved = 0
        self.end_window_pages()

    # -- a rewind's own sliding pages (docs/engine.md "Rewinds past the window") ---------------
    def grow_pages(self, pages: int) -> None:
        """Reserve ``pages`` lone pages for a window recomputation."""
        if pages > 0:
            self.pool.reserve(pages)
            self.page_reserve += pages

    def window_pages_of(self, index: int) -> list[int]:
        """The recomputation's own sliding pages of ``blocks[index]`` (taken on first use)."""
        pages = self.window_pages.get(index)
        if pages is None:
            count = self.pool.companions
            if self.page_reserve < count:
                raise RuntimeError("window recomputation budget exhausted")
            self.page_reserve -= count
            pages = self.window_pages[index] = self.pool.take_pages(count)
        return pages

    def drop_window_pages(self, before: int) -> None:
        """Give back the own pages of the blocks before index ``before`` (out of every row's window);
        the recomputation may take as many again."""
        for index in [i for i in self.window_pages if i < before]:
            pages = self.window_pages.pop(index)
            self.pool.give_pages(pages)
            self.pool.reserve(len(pages))
            self.page_reserve += len(pages)

    def end_window_pages(self, exact_from: int | None = None) -> None:
        """The recomputation is over: the own pages of blocks from index ``exact_from`` on (every
        sliding layer's K/V there recomputed exactly) become those blocks' sliding pages where
        they have none; every other page and the unused reservation go back to the pool."""
        for index, pages in sorted(self.window_pages.items()):
            keep = exact_from is not None and index >= exact_from and index < len(self.blocks)
            if not (keep and self.pool.adopt_companions(self.blocks[index], pages)):
                self.pool.give_pages(pages)
        self.window_pages.clear()
        self.pool.unreserve(self.page_reserve)
        self.page_reserve = 0

    def take_block(self) -> int:
        if self.reserved < 1:
            raise RuntimeError("slot budget exhausted")
        self.reserved -= 1
        return self.pool.allocate(reserved=True)

    def adopt(self, block: int) -> None:
        """Hold a block someone else holds, or a cached one: from this slot's reservation
        when it has one (a running request), else on demand (a held block costs the pool
        nothing; reviving a cached one takes a free block nobody reserved:
        :class:`~musegl_core.engine.kv_pool.PoolExhausted` when there is none)."""
        if self.reserved > 0:
            self.pool.unreserve(self.pool.pages_per_block)
            self.reserved -= 1
        elif self.pool.refcount(block) < 1 and self.pool.available_blocks < self.pool.pages(block):
            raise PoolExhausted("no free KV block to revive a cached one")
        self.blocks.append(self.pool.share(block))

    def copy_on_write(self, index: int) -> list[tuple[int, int]]:
        """Replace immutable block ``blocks[index]`` (shared, or keyed by the prefix
        cache) by a private copy taken from this slot's reservation (which counts the
        copies a run may make, :meth:`SessionTable.run_blocks`); returns the (src, dst)
        pages for the executor to copy: none when the pool handed the same block back
        (a cached block evicted for its own copy: its contents are already in place);
        with sliding pages, the block's and its companions'."""
        pool = self.pool
        old = self.blocks[index]
        if not pool.immutable(old):
            raise RuntimeError("copy-on-write of a block nobody else holds")
        if pool.companions:  # the copy first: the old block and its sliding pages stay put meanwhile
            new = self.take_block()
            pairs = [(old, new)] + list(zip(pool.companion_pages(old) or (), pool.companion_pages(new)))
            pool.release(old)
            self.blocks[index] = new
            return pairs
        pool.release(old)  # held elsewhere or cached, so its contents stay
        new = self.take_block()
        self.blocks[index] = new
        return [] if new == old else [(old, new)]

    def truncate(self, keep: int, rereserve: bool = True) -> None:
        """Release every block after the first ``keep``. ``rereserve``: the slot may
        take as many again (a running request's budget is kept; the released blocks
        are its own, so the pool has them back); else they are simply given back."""
        dropped = self.blocks[keep:]
        del self.blocks[keep:]
        for block in reversed(dropped):  # the tail first, so cached tails are evicted first
            self.pool.release(block)
        if rereserve:
            self.pool.reserve(len(dropped) * self.pool.pages_per_block)
            self.reserved += len(dropped)

    def close(self) -> None:
        self.truncate(0, rereserve=False)
        self.settle()


@attrs.define(eq=False)
class Session:
    """A resident transcript: ``tokens[i]``'s K/V lives in ``slot.blocks[i // block_size]``.

    ``name`` is None for an anonymous request's temporary session. ``salt`` is
    the ``cache_salt`` it was opened with (None: unsalted). ``clean``
    turns False when a request on it failed or was cancelled mid-way; a dirty
    session replays from scratch. ``confirmed`` turns True on the first raw
    output (stream) or a successful response; an unconfirmed new session is
    dropped when its first request fails.
    """

    name: str | None
    slot: Slot
    tokens: list[int] = attrs.field(factory=list)
    salt: str | None = None
    soft: bool = False  # named by a client's own conversation key: expires and is evicted first
    group: str | None = None  # an anonymous choice's response (RequestOptions.group)
    retention: str | None = None  # the residency its requests asked for (engine/retention.py; None: none)
    clean: bool = True
    confirmed: bool = False
    active: bool = False
    waiting: collections.deque = attrs.field(factory=collections.deque)
    last_used: float = attrs.field(factory=time.monotonic)
    replay: ReplayLog = attrs.field(factory=ReplayLog)
    #: its blocks while they are in the host tier (then ``slot`` holds none): ``tokens``' K/V
    host: list[HostBlock] = attrs.field(factory=list)
    #: sliding pages of its blocks that left the window, copied to the host tier, by block index
    #: (:meth:`SessionTable.window_down`): a rewind past the window restores them
    window_host: dict[int, HostBlock] = attrs.field(factory=dict)

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting


@attrs.define(eq=False)
class Snapshot:
    tokens: tuple[int, ...]
    slot: Slot
    salt: str | None = None  # only sessions of this salt reuse it
    last_used: float = attrs.field(factory=time.monotonic)
    host: list[HostBlock] = attrs.field(factory=list)  # its blocks while they are in the host tier


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share. Slices are compared (C loops) and the first
    difference is found by halving, so a 17k-id agent prompt costs ~0.1 ms, not ~2."""
    a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


class SessionTable:
    """Named sessions, anonymous temporary sessions and snapshots, with LRU eviction."""

    def __init__(self, pool: KVPool, *, max_sessions: int, max_context: int, snapshots: int, evict_idle: bool,
                 prefix_caching: bool = True, idle_timeout: float | None = None, soft_idle_timeout: float = 600.0,
                 window: int | None = None, reach: int | None = None):
        self.pool = pool
        #: with sliding pages: the sliding layers' window (a reused prefix needs their K/V of its last
        #: ``window`` positions)
        self.window = window
        #: with sliding pages: the positions a rewind past the window recomputes (sliding layers x
        #: window, ``use_sliding_pages``); None: such a rewind recomputes the whole prompt
        self.reach = reach
        self.max_sessions = max_sessions
        self.max_context = max_context
        self.snapshot_capacity = snapshots
        self.evict_idle = evict_idle
        self.idle_timeout = idle_timeout
        self.soft_idle_timeout = soft_idle_timeout
        self.cache = PrefixCache(pool) if prefix_caching else None
        self.named: dict[str, Session] = {}
        self.anonymous: set[Session] = set()
        self.snapshots: list[Snapshot] = []
        self.evictions = 0
        self.expired = 0
        self.closed = 0
        #: the host tier below the device pool (``--kv-offload-memory``; the engine sets it), None: none
        self.host: HostTier | None = None
        #: the prefix cache's blocks the pool evicted into the host tier, by key, least recently used first
        self.host_cached: collections.OrderedDict[bytes, HostBlock] = collections.OrderedDict()
        #: requests that reused positions, and the positions, by where their K/V came from (cache_source)
        self.tier_hits = {"device": 0, "host": 0, "disk": 0}
        self.tier_hit_tokens = {"device": 0, "host": 0, "disk": 0}
        self._from_lower = 0  # blocks the last promote brought up from the tier below the host (disk)
        self.moved_down = 0  # idle soft sessions moved to the host tier at their idle timeout, instead of closed
        #: sliding pages in the host tier (:meth:`window_down`), least recently copied first
        self.window_lru: collections.OrderedDict[tuple[Session, int], None] = collections.OrderedDict()
        self.window_offloaded_blocks = 0  # blocks whose sliding pages went down as they left the window
        self.window_restores = 0  # rewinds past the window whose sliding pages came back from the host tier
        self.window_restored_blocks = 0  # ... and the blocks whose sliding pages came back
        self.window_dropped_blocks = 0  # sliding pages the host tier let go of for room
        self.offloads = 0  # idle holders moved down
        #: blocks on demand for running requests (engine/kv_suspend.py; the engine sets it with the host tier)
        self.on_demand = None

    @staticmethod
    def pool_blocks(block_size: int, *, max_sessions: int, max_context: int, snapshots: int) -> int:
        """Blocks a pool needs so every slot and snapshot can hold ``--max-context`` positions at once
        (the default pool without ``--kv-cache-memory``; blocks on demand need far fewer), plus the
        blocks a running request may copy on write (:meth:`run_blocks`)."""
        return (max_sessions + snapshots) * -(-max_context // block_size) + 1 + (1 if snapshots else 0)

    # -- slots -----------------------------------------------------------------------
    @property
    def slots_in_use(self) -> int:
        return len(self.named) + len(self.anonymous)

    def _idle_soft(self) -> list[Session]:
        return [s for s in self.named.values() if s.soft and s.idle]

    def can_open_soft(self) -> bool:
        """Whether a new soft session gets a slot without waiting: one is free, or
        an idle soft session (or, with ``--evict-idle-sessions``, any idle named
        session) can be evicted."""
        return (self.slots_in_use < self.max_sessions or bool(self._idle_soft())
                or (self.evict_idle and any(s.idle for s in self.named.values())))

    def _free_a_slot(self, anonymous: bool = False, group: str | None = None) -> None:
        """Make room for one more session, or :class:`CapacityError`. Soft sessions give way
        first; then, with ``--evict-idle-sessions``, the least recently used idle named
        session is evicted. Without it, so is it for an anonymous request when no slot
        would free on its own (no anonymous request or soft session running): anonymous
        work always finds room, and named sessions cannot lock a server. The slots of an
        anonymous request's own ``group`` (the other choices of its response) do not count
        as freeing on their own: its ``n`` choices start together rather than one after
        another. A session with a request running or queued is never evicted."""
        if self.slots_in_use < self.max_sessions:
            return
        soft = self._idle_soft()  # soft sessions give way first, with or without --evict-idle-sessions
        if soft:
            self.drop(self._lost(min(soft, key=evict_order(time.monotonic())), "evicted"))
            self.evictions += 1
            return
        frees_on_its_own = (any(group is None or s.group != group for s in self.anonymous)
                            or any(s.active and s.soft for s in self.named.values()))
        if self.evict_idle or (anonymous and not frees_on_its_own):
            idle = [s for s in self.named.values() if s.idle]
            if idle:
                victim = min(idle, key=evict_order(time.monotonic()))
                self.drop(self._lost(victim, "evicted"))
                self.evictions += 1
                return
        raise CapacityError(
            f"all {self.max_sessions} session slots (--max-sessions) are in use"
            + ("" if self.evict_idle else " (start the server with --evict-idle-sessions to evict idle ones)")
        )

    def open(self, name: str | None, salt: str | None = None, soft: bool = False,
             group: str | None = None) -> tuple[Session, bool]:
        """The session for ``name`` (created with ``salt`` when new), or a temporary
        one when None (of choice group ``group``). :class:`SaltMismatch` when ``name``
        exists with another salt."""
        self.expire_idle()
        if name is not None and name in self.named:
            session = self.named[name]
            if session.salt != salt:
                raise SaltMismatch(f"session {name!r} was opened with a different cache_salt")
            return session, False
        self._free_a_slot(anonymous=name is None, group=group if name is None else None)
        session = Session(name, Slot(self.pool), salt=salt, soft=soft and name is not None,
                          group=group if name is None else None)
        if name is None:
            self.anonymous.add(session)
        else:
            self.named[name] = session
        return session, True

    def _lost(self, session: Session, reason: str) -> Session:
        """Tell the engine's :class:`~musegl_core.engine.prefix_miss.PrefixHistory` (``history``,
        when set) what an evicted or expired session held, to explain its next request's miss."""
        history = getattr(self, "history", None)
        if history is not None and session.clean:
            history.lost(session.name, reason, session.tokens, session.salt)
        return session

    def drop(self, session: Session) -> None:
        self._free_host(session)
        self._free_windows(session)
        session.slot.close()
        session.tokens.clear()
        session.replay = ReplayLog()
        if session.name is None:
            self.anonymous.discard(session)
        elif self.named.get(session.name) is session:
            del self.named[session.name]

    # -- named sessions as a client manages them ------------------------------------
    def describe(self, now: float | None = None) -> list[SessionInfo]:
        """Every named session, most recently used first."""
        now = time.monotonic() if now is None else now
        return [
            SessionInfo(
                id=session.name,
                state="idle" if session.idle else "active",
                cached_tokens=len(session.tokens) if session.clean else 0,
                idle_seconds=round(max(0.0, now - session.last_used), 3) if session.idle else 0.0,
                queued_requests=len(session.waiting),
                retention=session.retention,
            )
            for session in sorted(self.named.values(), key=lambda s: s.last_used, reverse=True)
        ]

    def close(self, name: str) -> None:
        """Close an idle named session (``DELETE /v1/sessions/{id}``): its slot and
        KV are freed. KeyError when unknown, :class:`SessionBusy` while active."""
        session = self.named[name]
        if not session.idle:
            raise SessionBusy(f"session {name!r} has a request running or queued")
        self.drop(session)
        self.closed += 1

    def expire_idle(self, now: float | None = None) -> int:
        """Close named sessions idle longer than ``--session-idle-timeout`` and soft
        ones idle longer than ``--soft-session-idle-timeout`` (each at least its retention's,
        engine/retention.py); how many. With a host tier, an idle soft session moves down
        instead of closing: its blocks go to the host tier (:meth:`offload`) and it stays, until
        the host tier or the slots need its room (its keyed blocks then go on down, to the disk
        tier when there is one)."""
        now = time.monotonic() if now is None else now

        def timeout(session: Session) -> float | None:
            return idle_timeout(self.soft_idle_timeout if session.soft else self.idle_timeout, session.retention)

        stale = [s for s in self.named.values()
                 if s.idle and timeout(s) is not None and now - s.last_used > timeout(s)]
        closed = 0
        for session in stale:
            if session.soft and self.host is not None and session.clean:
                if session.host and not session.slot.blocks:
                    continue  # moved down already
                if self.offload(session):
                    self.moved_down += 1
                    continue
            self.drop(self._lost(session, "expired"))
            closed += 1
        self.expired += closed
        return closed

    # -- prefix reuse ----------------------------------------------------------------
    def best_prefix(self, session: Session, prompt: Sequence[int]) -> tuple[int, Snapshot | None]:
        """How many prompt positions can be reused, and from which snapshot (None:
        the session's own KV). At least one prompt position is always left to run."""
        limit = len(prompt) - 1
        own = min(common_prefix(session.tokens, prompt), limit) if session.clean else 0
        best, source = own, None
        for snap in self.snapshots:
            if snap.salt != session.salt:
                continue
            n = min(common_prefix(snap.tokens, prompt), limit)
            if n > best:
                best, source = n, snap
        return best, source

    def attach(self, session: Session, prompt: Sequence[int]) -> int:
        """Point ``session``'s KV at the longest reusable prefix of ``prompt``: its own
        transcript, a snapshot or the prefix cache, whichever is longest; returns it. K/V in the
        host tier comes back first (:meth:`restore`, :meth:`promote`) and counts as reused."""
        block_size = self.pool.block_size
        from_host = 0  # positions whose K/V came back from the host tier
        # the positions of the session's sliding pages in the host tier that the prompt keeps
        valid = common_prefix(session.tokens, prompt) if session.window_host and session.clean else 0
        if session.host:
            if session.clean:
                own = min(common_prefix(session.tokens, prompt), len(prompt) - 1)
                kept = len(session.slot.blocks)  # (blocks on demand may have moved only its last blocks down)
                from_host = (self.restore(session, self.pool.blocks_for(own)) - kept) * block_size
            else:
                self._free_host(session)
        from_disk = 0  # the part of them that came up from the disk tier
        if self.host is not None and self.cache is not None:
            from_host = max(from_host, self.promote(prompt, len(prompt) - 1, session.salt, keep=session) * block_size)
            from_disk = self._from_lower * block_size
        reuse, snapshot = self.best_prefix(session, prompt)
        if snapshot is not None and snapshot.host:
            from_host = max(from_host, self.restore(snapshot, self.pool.blocks_for(reuse), keep=session) * block_size)
            reuse, snapshot = self.best_prefix(session, prompt)
        cached: list[int] | None = None
        if self.cache is not None:
            own = session.slot.blocks[: reuse // block_size] if snapshot is None else ()
            found, blocks = self.cache.lookup(prompt, len(prompt) - 1, session.salt, held=own)
            if found > reuse:
                reuse, cached = found, blocks
        if cached is not None:
            session.slot.truncate(0, rereserve=False)  # releases nothing the lookup found for good
            reuse = min(reuse, self._adopt(session.slot, cached))
            self.cache.hits += 1
            self.cache.hit_tokens += reuse
        elif snapshot is None:
            session.slot.truncate(self.pool.blocks_for(reuse), rereserve=False)
        else:
            session.slot.truncate(0, rereserve=False)
            reuse = min(reuse, self._adopt(session.slot, snapshot.slot.blocks[: self.pool.blocks_for(reuse)]))
            snapshot.last_used = time.monotonic()
        if session.window_host:  # a rewind past the window: its sliding pages come back from the host tier
            self.restore_window(session, reuse, valid)
            self._free_windows(session, min(reuse, valid))
        if self.reach is None and not self.window_kept(session.slot.blocks, reuse):
            # sliding pages: the window before ``reuse`` went back to the pool, and the executor did not
            # say how far back its recomputation reaches (:meth:`window_start`): the prompt is recomputed
            reuse = 0
            session.slot.truncate(0, rereserve=False)
        session.tokens = list(prompt[:reuse])
        assert len(session.slot.blocks) * block_size >= reuse
        self._count_hit(reuse, min(reuse, from_host), min(reuse, from_disk, from_host))
        return reuse

    def _count_hit(self, reuse: int, from_host: int, from_disk: int = 0) -> None:
        """Count a request's reused positions by the tier they came from (``cache_source``):
        ``from_host`` came up from below the device, ``from_disk`` of them from the disk tier."""
        for tier, positions in (("disk", from_disk), ("host", from_host - from_disk), ("device", reuse - from_host)):
            if positions > 0:
                self.tier_hits[tier] += 1
                self.tier_hit_tokens[tier] += positions

    def restore_room(self, session: Session, prompt: Sequence[int]) -> int:
        """Device pages a request on ``session`` lacks to bring the session's host blocks back
        (after :meth:`make_room`): 0 when they fit, or nothing is in the host tier. The engine
        asks before :meth:`attach`, so a session whose blocks cannot come back yet keeps them
        in the host tier while its request waits."""
        if not session.host or not session.clean:
            return 0
        own = min(common_prefix(session.tokens, prompt), len(prompt) - 1)
        need = min(len(session.host), max(0, self.pool.blocks_for(own) - len(session.slot.blocks)))
        need *= self.pool.pages_per_block
        if need > self.pool.available_blocks:
            self.make_room(need, keep=session)
        return max(0, need - self.pool.available_blocks)

    def window_kept(self, blocks: Sequence[int], reuse: int) -> bool:
        """Whether ``blocks`` still hold the sliding layers' K/V of the ``window`` positions
        before ``reuse`` (always without sliding pages)."""
        if not self.pool.companions or reuse == 0:
            return True
        size = self.pool.block_size
        first = max(0, reuse - self.window) // size
        return all(self.pool.has_window(b) for b in blocks[first: self.pool.blocks_for(reuse)])

    def window_start(self, blocks: Sequence[int], reuse: int) -> int:
        """The first position a request reusing ``reuse`` positions of ``blocks`` computes: ``reuse``
        when the sliding layers' window before it is still on the device, else (a rewind past the
        window, docs/engine.md "Rewinds past the window") the start of the block ``reach`` positions
        before the first block of that window. From there on the request recomputes the sliding
        layers' K/V only (the full layers' stay), and those of the blocks from
        :meth:`window_exact` on come out exact."""
        if self.window_kept(blocks, reuse):
            return reuse
        size = self.pool.block_size
        exact = self.window_exact(reuse) * size
        return max(0, exact - (self.reach - self.window)) // size * size

    def window_exact(self, reuse: int) -> int:
        """The first block whose sliding K/V a window recomputation up to ``reuse`` makes exact (the
        block holding ``reuse - window``): a sliding layer's K/V at a position is exact once every
        sliding layer below had its ``window`` keys before it recomputed, ``window`` positions more
        for each (:meth:`window_start` starts ``reach = sliding layers x window`` before)."""
        return max(0, reuse - self.window) // self.pool.block_size

    def _adopt(self, slot: Slot, blocks: Sequence[int]) -> int:
        """Adopt ``blocks`` in order until the pool has no free block to revive a cached
        one (its reservations are running requests'); the positions adopted."""
        for block in blocks:
            try:
                slot.adopt(block)
            except PoolExhausted:
                break
        return len(slot.blocks) * self.pool.block_size

    # -- blocks on demand ------------------------------------------------------------
    def run_blocks(self, session: Session, reused: int, positions: int) -> int:
        """Blocks a request on ``session`` (attached with ``reused`` positions) must
        reserve so it can reach ``positions`` positions: one per block it does not
        hold yet, plus one for each block it may have to copy on write (the reused
        prefix's last, partial block when it is immutable, and the prompt's last
        partial block, which a snapshot may share)."""
        pool = self.pool
        slot = session.slot
        need = max(0, pool.blocks_for(positions) - len(slot.blocks))
        size = pool.block_size
        if reused % size and len(slot.blocks) > reused // size and pool.immutable(slot.blocks[reused // size]):
            need += 1
        if self.snapshot_capacity:
            need += 1
        return need

    def reserve_run(self, session: Session, blocks: int, pages: int = 0) -> bool:
        """Reserve ``blocks`` (and ``pages`` lone pages for a window recomputation) for a request
        starting on ``session``, making room (:meth:`make_room`) when the pool has not them free;
        False (nothing reserved) when even then it has not."""
        total = blocks * self.pool.pages_per_block + pages
        if total > self.pool.available_blocks:
            self.make_room(total, keep=session)
        if total > self.pool.available_blocks:
            return False
        session.slot.grow(blocks)
        session.slot.grow_pages(pages)
        return True

    def window_pages(self, reuse: int, start: int, rows: int) -> int:
        """Lone pages a window recomputation of ``start .. reuse`` holds at most, in steps of at most
        ``rows`` rows: its own sliding pages of the blocks one step writes and the ``window`` before."""
        if start >= reuse:
            return 0
        return self.pool.companions * (self.pool.blocks_for(min(rows, reuse - start) + self.window) + 1)

    def end_run(self, session: Session, computed: int) -> None:
        """A request on ``session`` ended with ``computed`` positions in the cache: blocks past
        them (rejected drafts, never-written reservations) go back to the pool."""
        slot = session.slot
        if len(slot.blocks) > self.pool.blocks_for(computed):
            slot.truncate(self.pool.blocks_for(computed), rereserve=False)
        slot.settle()

    def make_room(self, pages: int, keep: "Session | Snapshot | tuple | None" = None) -> None:
        """Free KV pages (blocks without sliding pages) until ``pages`` are available. With a host
        tier, idle holders move their blocks down first (:meth:`offload`): idle named sessions
        (soft or not) and snapshots, least recently used first. Then, what the host tier could
        not take is dropped: idle soft sessions, then snapshots, then (``--evict-idle-sessions``)
        idle named sessions, least recently used first. Their keyed blocks stay cached (and
        free) for the prefix cache. ``keep``: a holder (or a tuple of them) left alone."""
        pool = self.pool
        kept = keep if isinstance(keep, tuple) else (keep,)

        def spared(holder) -> bool:
            return any(holder is k for k in kept)

        if self.host is not None:
            movable = [s for s in self.named.values() if s.idle and s.clean and s.slot.blocks and not spared(s)]
            movable += [s for s in self.snapshots if s.slot.blocks and not spared(s)]
            for holder in sorted(movable, key=lambda h: h.last_used):
                if pool.available_blocks >= pages:
                    return
                self.offload(holder)

        def victims():
            idle = sorted((s for s in self.named.values() if s.idle and not spared(s) and s.slot.blocks),
                          key=evict_order(time.monotonic()))
            yield from (s for s in idle if s.soft)
            yield from sorted((s for s in self.snapshots if not spared(s)), key=lambda s: s.last_used)
            if self.evict_idle:
                yield from (s for s in idle if not s.soft)

        for victim in list(victims()):
            if pool.available_blocks >= pages:
                return
            if isinstance(victim, Snapshot):
                self.snapshots.remove(victim)
                self._free_host(victim)
                victim.slot.close()
            else:
                self.drop(victim)
                self.evictions += 1

    # -- the host tier (engine/kv_host.py) -------------------------------------------
    def offload(self, holder: "Session | Snapshot") -> bool:
        """Move an idle holder's blocks (a session's or a snapshot's) to the host tier: its
        K/V copied into host pages, its device blocks released (keyed ones stay cached in the
        pool until it reuses them). The host tier makes room by letting go of its least
        recently used holders that may be lost (:meth:`_host_room`). False (nothing moved)
        when there is no host tier or it cannot take them."""
        host, pool = self.host, self.pool
        if host is None or holder.host or not holder.slot.blocks:
            return False
        blocks = holder.slot.blocks[: pool.blocks_for(len(holder.tokens))]
        items = [([b, *(pool.companion_pages(b) or ())], pool.key(b)) for b in blocks]
        # a block the host tier's prefix cache holds already (same key: same K/V) is taken from there
        there = [self.host_cached.get(key) if key is not None else None for _, key in items]
        copy = [item for item, found in zip(items, there)
                if found is None or len(found.pages) < len(item[0])]
        need = sum(len(pages) for pages, _ in copy)
        if need > host.free_pages:
            self._host_room(need, keep=holder)
            there = [self.host_cached.get(key) if key is not None else None for _, key in items]
            copy = [item for item, found in zip(items, there)
                    if found is None or len(found.pages) < len(item[0])]
        try:
            copied = iter(host.offload(copy))
        except HostFull:
            return False
        moved = []
        for item, found in zip(items, there):
            if found is None or len(found.pages) < len(item[0]):
                moved.append(next(copied))
            else:
                moved.append(self.host_cached.pop(item[1]))
        holder.host = moved
        if len(holder.tokens) > len(blocks) * pool.block_size:  # (never: a holder fills its blocks)
            holder.tokens = holder.tokens[: len(blocks) * pool.block_size]
        holder.slot.truncate(0, rereserve=False)
        self.offloads += 1
        return True

    def _host_room(self, pages: int, keep=None) -> None:
        """Free host pages until ``pages`` are: the host tier's prefix cache first (its blocks go
        to the tier below when there is one), then holders in the host tier that may be lost
        (soft sessions, snapshots, with ``--evict-idle-sessions`` named sessions), least
        recently used first, whose keyed blocks join that cache before it lets go of them."""
        host = self.host
        sessions = sorted((s for s in self.named.values() if s.host and s.idle and s is not keep
                           and (s.soft or self.evict_idle)), key=evict_order(time.monotonic()))
        snapshots = sorted((s for s in self.snapshots if s.host and s is not keep), key=lambda s: s.last_used)
        victims = [*(s for s in sessions if s.soft), *snapshots, *(s for s in sessions if not s.soft)]
        while host.free_pages < pages:
            if self.window_lru:  # sliding pages kept for rewinds go first: losing them costs a window's recompute
                self._window_free(*next(iter(self.window_lru)), dropped=True)
            elif self.host_cached:
                _, block = self.host_cached.popitem(last=False)
                host.free([block], hand_down=True)
            elif victims:
                victim = victims.pop(0)
                if isinstance(victim, Snapshot):
                    self.snapshots.remove(victim)
                    self._free_host(victim)
                    victim.slot.close()
                else:
                    self.drop(self._lost(victim, "evicted"))
                    self.evictions += 1
            else:
                return

    # -- sliding pages in the host tier (docs/engine.md "Rewinds past the window") ----------------
    def window_down(self, session: Session, items: Sequence[tuple[int, int]]) -> None:
        """Blocks ``items`` (``(index, block)``) of ``session`` leave every window and give their sliding
        pages back (:meth:`Scheduler._trim_window`): with a host tier, a named session's sliding pages of
        them are copied to host pages first, so that a later rewind past the window brings them back
        (:meth:`restore_window`) instead of recomputing. They take free host pages, or those of older
        such copies (least recently copied first), never other holders' room; what does not fit is
        not copied (newest kept)."""
        host, pool = self.host, self.pool
        if host is None or session.name is None or not items:
            return
        per = pool.companions
        for index, _ in items:
            if index in session.window_host:
                self._window_free(session, index)
        while host.free_pages < per * len(items) and self.window_lru:
            self._window_free(*next(iter(self.window_lru)), dropped=True)
        items = list(items)[len(items) - host.free_pages // per:] if host.free_pages < per * len(items) else items
        if not items:
            return
        moved = host.offload([(pool.companion_pages(block), None) for _, block in items], count=False)
        for (index, _), block in zip(items, moved):
            session.window_host[index] = block
            self.window_lru[(session, index)] = None
        self.window_offloaded_blocks += len(moved)

    def restore_window(self, session: Session, reuse: int, valid: int) -> bool:
        """A request reuses ``reuse`` positions of ``session`` whose sliding layers' window left the
        device: bring back, from the host tier, the sliding pages of the blocks that window covers
        (:meth:`window_exact` on) into fresh device pages, so that nothing is recomputed. Only when the
        host tier holds every one of them, and they hold the prompt's K/V (``reuse <= valid``, the
        positions the session's transcript shares with the prompt); whether they came back (else the
        request recomputes the window, :meth:`window_start`)."""
        pool, host = self.pool, self.host
        if not pool.companions or host is None or reuse == 0 or reuse > valid:
            return False
        blocks = session.slot.blocks
        lacking = [i for i in range(self.window_exact(reuse), pool.blocks_for(reuse))
                   if not pool.has_window(blocks[i])]
        if not lacking or any(i not in session.window_host for i in lacking):
            return False
        need = len(lacking) * pool.companions
        if need > pool.available_blocks:
            self.make_room(need, keep=session)  # (may let go of sliding pages in the host tier)
        if need > pool.available_blocks or any(i not in session.window_host for i in lacking):
            return False
        started = time.perf_counter()
        moved = [session.window_host.pop(i) for i in lacking]  # out of the LRU: no room made below takes them
        for i in lacking:
            del self.window_lru[(session, i)]
        pool.reserve(need)
        pages = pool.take_pages(need)
        pairs: list[tuple[int, int]] = []
        for n, (i, block) in enumerate(zip(lacking, moved)):
            own = pages[n * pool.companions:(n + 1) * pool.companions]
            pairs.extend(zip(block.pages, own))
            pool.adopt_companions(blocks[i], own)
        host.restore(pairs, 0)
        host.free(moved)
        self.window_restores += 1
        self.window_restored_blocks += len(lacking)
        host.restore_seconds += time.perf_counter() - started
        return True

    def _window_free(self, session: Session, index: int, dropped: bool = False) -> None:
        self.host.free([session.window_host.pop(index)])
        del self.window_lru[(session, index)]
        self.window_dropped_blocks += dropped

    def _free_windows(self, session: Session, keep: int = 0) -> None:
        """Let go of ``session``'s sliding pages in the host tier except those of blocks wholly within
        its first ``keep`` positions."""
        size = self.pool.block_size
        for index in [i for i in session.window_host if (i + 1) * size > keep]:
            self._window_free(session, index)

    def _free_host(self, holder: "Session | Snapshot") -> None:
        """Let go of a holder's host blocks: keyed ones join the host tier's prefix cache
        (:attr:`host_cached`, where a later prompt finds them), the others are freed."""
        if holder.host:
            self._keep_cached(holder.host)
            holder.host = []

    def _keep_cached(self, blocks: Sequence[HostBlock]) -> None:
        for block in blocks:
            if block.key is not None and block.key not in self.host_cached:
                self.host_cached[block.key] = block
            else:
                self.host.free([block])

    def restore(self, holder: "Session | Snapshot", blocks: int, keep=None) -> int:
        """Bring a holder's host blocks back to the device until it has its first ``blocks`` there
        (making room, :meth:`make_room`, with ``keep`` and the holder spared); the rest are let go
        of. A block whose key the device pool still holds is shared from there, the others are
        copied back (and keyed again). Returns the blocks the holder has on the device afterwards.
        (A holder's host blocks follow those it kept on the device: all of them, or the last ones
        only where blocks on demand moved part of a session down, engine/kv_suspend.py.)"""
        host, pool = self.host, self.pool
        wanted = holder.host[:max(0, blocks - len(holder.slot.blocks))]
        need = len(wanted) * pool.pages_per_block
        if need > pool.available_blocks:
            self.make_room(need, keep=(holder, *(keep if isinstance(keep, tuple) else (keep,))))
        started = time.perf_counter()
        pairs: list[tuple[int, int]] = []
        copied = 0
        for moved in wanted:
            shared = share_from_pool(pool, holder.slot, moved)
            if shared:
                continue
            if shared is None or pool.available_blocks < pool.pages_per_block:
                break
            copy_back(pool, holder.slot, moved, pairs)
            copied += 1
        host.restore(pairs, copied)
        self._keep_cached(holder.host)  # the restored blocks' host copies too: evicted again, they need no copy
        holder.host = []
        host.restores += 1
        host.restore_seconds += time.perf_counter() - started
        kept_positions = len(holder.slot.blocks) * pool.block_size
        if len(holder.tokens) > kept_positions:
            holder.tokens = holder.tokens[:kept_positions]
        return len(holder.slot.blocks)

    def evicted_to_host(self, block: int, key: bytes) -> None:
        """The pool evicts cached block ``block`` (keyed ``key``, :attr:`KVPool.on_evict`): its
        K/V moves to the host tier, where a later prompt finds it (:meth:`promote`), unless the
        host tier holds that key already or has no page to spare for it."""
        host, pool = self.host, self.pool
        if host.holds(key):
            return
        pages = [block, *(pool.companion_pages(block) or ())]
        if host.free_pages < len(pages):
            self._host_room(len(pages))
        if host.free_pages < len(pages):
            return
        self.host_cached[key] = host.offload([(pages, key)])[0]

    def promote(self, prompt: Sequence[int], limit: int, salt: str | None, keep=None) -> int:
        """Copy the prompt's full blocks that only the host tier's prefix cache holds back into
        the device pool as cached blocks (making room, :meth:`make_room`, with ``keep``
        spared), so that the prefix cache's lookup finds them; then those of the chain that
        follow in the tier below (disk: :meth:`_promote_lower`). How many came back; the
        tier below's part of them is left in ``_from_lower``."""
        pool, host = self.pool, self.host
        self._from_lower = 0
        if not self.host_cached and host.lower is None:
            return 0
        size = pool.block_size
        parent = chain_root(salt)
        wanted: list[tuple[bytes, HostBlock]] = []  # the chain's blocks missing on the device, in order
        below: list[bytes] = []  # the chain's blocks after those, found in the tier below
        pinned: list[int] = []  # the chain's cached device blocks, held meanwhile so no allocation evicts them
        for index in range(min(len(prompt) // size, pool.blocks_for(limit))):
            key = block_key(parent, prompt[index * size:(index + 1) * size])
            parent = key
            found = None if below else pool.lookup(key)
            if found is not None:
                pinned.append(pool.share(found))
                continue
            moved = None if below else self.host_cached.get(key)
            if moved is not None:
                wanted.append((key, moved))
            elif host.lower is not None and host.lower.contains(key):
                below.append(key)
            else:
                break
        try:
            came = self._promote(wanted, keep)
            if came == len(wanted) and below:
                self._from_lower = self._promote_lower(below, keep)
            return came + self._from_lower
        finally:
            for block in reversed(pinned):
                pool.release(block)

    def _promote_lower(self, keys: Sequence[bytes], keep) -> int:
        """Bring the blocks keyed ``keys`` (consecutive blocks of one prefix chain, in order) up
        from the tier below the host tier into the device pool as cached blocks, through host
        pages, as many at a time as the host tier has room for (device room is made first, so
        nothing pushes them out of the host tier on the way); stops at the first that does not
        come (gone, or its file failed a check: engine/kv_disk.py). How many came."""
        pool, host = self.pool, self.host
        per = pool.pages_per_block
        came = 0
        started = time.perf_counter()
        while came < len(keys):
            want = len(keys) - came
            if pool.available_blocks < want * per:
                self.make_room(want * per, keep=keep)
            want = min(want, pool.available_blocks // per)
            if host.free_pages < want * per:
                self._host_room(want * per, keep=keep)
            want = min(want, host.free_pages // per)
            if want < 1:
                break
            batch = []
            for key in keys[came:came + want]:
                moved = host.fetch(key, per)
                if moved is None:
                    break
                batch.append((key, moved))
            pairs: list[tuple[int, int]] = []
            held: list[int] = []  # held until their K/V is in: an allocation could evict them
            for key, moved in batch:
                new = pool.allocate()
                pages = [new, *(pool.companion_pages(new) or ())]
                if len(moved.pages) < len(pages):  # its sliding pages had left the device before
                    pool.drop_companions(new)
                    pages = [new]
                pairs.extend(zip(moved.pages, pages))
                pool.register(new, key)
                held.append(new)
            host.restore(pairs, len(batch))
            for new in held:
                pool.release(new)  # cached: free, found by the lookup
            host.free([moved for _, moved in batch])
            came += len(batch)
            if len(batch) < want:
                break
        host.restore_seconds += time.perf_counter() - started
        return came

    def write_through(self, session: Session, until: float) -> int:
        """Write ``session``'s keyed full blocks to the tier below the host tier (disk) when they
        are not there yet, retained until ``until`` (a Unix time; blocks there already get it
        too): the residencies that ask for it (engine/retention.py). Copies go through free
        host pages (making host room when there are none); how many blocks were written."""
        host, pool = self.host, self.pool
        lower = host.lower if host is not None else None
        if lower is None:
            return 0
        items: list[tuple[list[int], bytes]] = []
        for block in session.slot.blocks[: len(session.tokens) // pool.block_size]:
            key = pool.key(block)
            if key is None:
                continue
            if not lower.retain(key, until):  # a block stored already only has its retention extended
                items.append(([block, *(pool.companion_pages(block) or ())], key))
        written = 0
        while items:
            if host.free_pages < pool.pages_per_block:
                self._host_room(pool.pages_per_block, keep=session)
            chunk, room = [], host.free_pages
            while items and len(items[0][0]) <= room:
                room -= len(items[0][0])
                chunk.append(items.pop(0))
            if not chunk:
                break
            for (_, key), data in zip(chunk, host.read_blocks([pages for pages, _ in chunk])):
                written += bool(lower.put(key, data, until))
        return written

    def _still_cached(self, wanted: list[tuple[bytes, HostBlock]]) -> list[tuple[bytes, HostBlock]]:
        """The leading part of ``wanted`` still in the host tier's prefix cache, as it was found."""
        kept = 0
        while kept < len(wanted) and self.host_cached.get(wanted[kept][0]) is wanted[kept][1]:
            kept += 1
        return wanted[:kept]

    def _promote(self, wanted: list[tuple[bytes, HostBlock]], keep) -> int:
        pool, host = self.pool, self.host
        if not wanted:
            return 0
        need = len(wanted) * pool.pages_per_block
        if need > pool.available_blocks:
            self.make_room(need, keep=keep)
            wanted = self._still_cached(wanted)  # holders moved down may have pushed some out of the host tier
        started = time.perf_counter()
        for key, _ in wanted:  # taken out of the host tier's cache, so no room made below lets go of them
            del self.host_cached[key]
        pairs: list[tuple[int, int]] = []
        held: list[int] = []  # the new device blocks, held until their K/V is in (an allocation could evict them)
        for key, moved in wanted:
            if pool.available_blocks < pool.pages_per_block or pool.lookup(key) is not None:
                break
            new = copy_to_new_block(pool, moved, pairs)
            pool.register(new, key)
            held.append(new)
        came = len(held)
        host.restore(pairs, came)
        for new in held:
            pool.release(new)  # cached: free, found by the lookup
        host.free([moved for _, moved in wanted[:came]])
        for key, moved in wanted[came:]:  # back into the host tier's cache
            self.host_cached[key] = moved
        host.restore_seconds += time.perf_counter() - started
        return came

    def kv_shortfall(self, blocks: int) -> str:
        """Why ``blocks`` could not be reserved, with the numbers (a 503's message)."""
        if self.on_demand is not None and self.on_demand.refused_pages:
            return self.on_demand.shortfall()  # the guarantee over device plus host refused it
        pool = self.pool
        idle = sum(pool.pages(b) for s in self.named.values() if s.idle for b in s.slot.blocks)
        if pool.companions:  # counted in pages
            blocks *= pool.pages_per_block
            return (f"the KV cache is full: a request needs {blocks} KV pages (a block of {pool.block_size} "
                    f"positions is {pool.pages_per_block} pages with its sliding layers'), {pool.available_blocks} "
                    f"of {pool.num_blocks} are free; idle named sessions hold {idle}{self._host_numbers()}"
                    + ("" if self.evict_idle else " (start the server with --evict-idle-sessions to evict idle ones)"))
        hint = "" if self.evict_idle else " (start the server with --evict-idle-sessions to evict idle ones)"
        return (f"the KV cache is full: a request needs {blocks} KV blocks of {pool.block_size} positions, "
                f"{pool.available_blocks} of {pool.num_blocks} are free; idle named sessions hold {idle}"
                f"{self._host_numbers()}{hint}")

    def _host_numbers(self) -> str:
        """The host tier's part of a 503's message: its pages, and what holds them."""
        host = self.host
        if host is None:
            return "; no host tier (--kv-offload-memory 0, or the executor offers none)"
        held = sum(len(b.pages) for h in [*self.named.values(), *self.snapshots] for b in h.host)
        windows = sum(len(b.pages) for s in self.named.values() for b in s.window_host.values())
        return (f"; the host tier (--kv-offload-memory) has {host.free_pages} of {host.num_pages} pages free, "
                f"sessions and snapshots that may not be lost hold {held}"
                + (f" (sliding pages kept for rewinds hold {windows}, let go of first)" if windows else ""))

    def publish(self, session: Session) -> None:
        """Key the session's computed full blocks in the prefix cache (when on)."""
        if self.cache is not None:
            self.cache.publish(session.tokens, session.slot.blocks, session.salt)

    def snapshot(self, session: Session) -> None:
        """Keep the session's current prefix as a snapshot (LRU, ``--prefix-cache-entries``)."""
        if self.snapshot_capacity == 0 or not session.tokens:
            return
        tokens = tuple(session.tokens)
        for snap in self.snapshots:
            if snap.salt == session.salt and snap.tokens[: len(tokens)] == tokens:  # already covered
                snap.last_used = time.monotonic()
                return
        if len(self.snapshots) >= self.snapshot_capacity:
            oldest = min(self.snapshots, key=lambda s: s.last_used)
            self.snapshots.remove(oldest)
            self._free_host(oldest)
            oldest.slot.close()
        slot = Slot(self.pool)
        for block in session.slot.blocks[: self.pool.blocks_for(len(tokens))]:
            slot.adopt(block)  # held by the session: costs the pool nothing
        self.snapshots.append(Snapshot(tokens, slot, session.salt))

    def stats(self) -> dict:
        return {
            "named": len(self.named),
            "idle": sum(1 for s in self.named.values() if s.idle),
            "anonymous": len(self.anonymous),
            "snapshots": len(self.snapshots),
            "evictions": self.evictions,
            "expired": self.expired,
            "closed": self.closed,
            **(self.cache.stats() if self.cache is not None else {"kv_blocks_cached": 0}),
        }


def share_from_pool(pool: KVPool, slot: Slot, moved: HostBlock) -> bool | None:
    """Bring a host block back by sharing the device block that still holds its key (with its
    sliding pages, where it has them): True when shared, False when the pool holds no such
    block, None when it does but sharing found the pool exhausted."""
    found = pool.lookup(moved.key) if moved.key is not None else None
    if found is None or (len(moved.pages) > 1 and not pool.has_window(found)):
        return False
    try:
        slot.adopt(found)
        return True
    except PoolExhausted:
        return None


def copy_to_new_block(pool: KVPool, moved: HostBlock, pairs: list[tuple[int, int]]) -> int:
    """A new device block for a host block's K/V: its (host page, device page) copies are added
    to ``pairs``; a block whose sliding pages had left the device before comes back without
    them. The caller checks the pool has the pages."""
    new = pool.allocate()
    pages = [new, *(pool.companion_pages(new) or ())]
    if len(moved.pages) < len(pages):
        pool.drop_companions(new)
        pages = [new]
    pairs.extend(zip(moved.pages, pages))
    return new


def copy_back(pool: KVPool, slot: Slot, moved: HostBlock, pairs: list[tuple[int, int]]) -> None:
    """:func:`copy_to_new_block` at the end of ``slot``, registered under the block's key."""
    new = copy_to_new_block(pool, moved, pairs)
    slot.blocks.append(new)
    if moved.key is not None:
        pool.register(new, moved.key)


def session_policy(config) -> str:
    """One line stating the session policy of a serve configuration (logged at start-up)."""
    slots = f"{config.max_sessions} slots shared by named sessions and anonymous requests"
    if config.session_idle_timeout is not None:
        keep = f"named sessions are closed after {config.session_idle_timeout:g} s idle"
    else:
        keep = "named sessions persist until DELETE /v1/sessions/{id}"
    if config.evict_idle_sessions:
        keep += "; idle ones are evicted LRU when slots run out (--evict-idle-sessions)"
    else:
        keep += ("; when every slot is held by a named session, a new session gets 503 session_capacity and an "
                 "anonymous request evicts the least recently used idle one")
    cache = "prefix caching on" if config.prefix_caching else "prefix caching off (--no-prefix-caching)"
    return f"sessions: {slots}; {keep}; {cache}; snapshots: {config.prefix_cache_entries}"
