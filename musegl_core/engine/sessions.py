"""Session slots, named sessions and prefix snapshots (docs/sessions.md).

A **slot** is a budget of KV blocks (enough for ``--max-context`` positions)
that one resident session owns. Named sessions keep their slot, transcript and
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

Block accounting is exact: a slot's ``reserved`` blocks plus the blocks it
holds always equal its budget, and a block shared by several holders is
counted in each holder's budget (so sharing can only leave the pool with
spare room, never short of it). Releasing a request returns every block that
no session or snapshot still holds.
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

import attrs

from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.prefix_cache import PrefixCache
from musegl_core.engine.replay import ReplayLog


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


@attrs.define(eq=False)
class Slot:
    """A KV budget: ``len(blocks) + reserved == budget`` at all times."""

    pool: KVPool
    budget: int
    blocks: list[int] = attrs.field(factory=list)
    reserved: int = 0

    @classmethod
    def open(cls, pool: KVPool, budget: int) -> "Slot":
        pool.reserve(budget)
        return cls(pool, budget, [], budget)

    def take_block(self) -> int:
        if self.reserved < 1:
            raise RuntimeError("slot budget exhausted")
        self.reserved -= 1
        return self.pool.allocate(reserved=True)

    def adopt(self, block: int) -> None:
        """Hold a shared block (counted in this slot's budget)."""
        if self.reserved < 1:
            raise RuntimeError("slot budget exhausted")
        self.pool.unreserve(1)
        self.reserved -= 1
        self.blocks.append(self.pool.share(block))

    def copy_on_write(self, index: int) -> tuple[int, int] | None:
        """Replace immutable block ``blocks[index]`` (shared, or keyed by the prefix
        cache) by a private copy; returns (src, dst) for the executor to copy, or
        None when the pool handed the same block back (a cached block evicted for
        its own copy: its contents are already in place)."""
        old = self.blocks[index]
        if not self.pool.immutable(old):
            raise RuntimeError("copy-on-write of a block nobody else holds")
        self.pool.release(old)  # held elsewhere or cached, so its contents stay
        self.pool.reserve(1)
        self.reserved += 1
        new = self.take_block()
        self.blocks[index] = new
        return None if new == old else (old, new)

    def truncate(self, keep: int) -> None:
        """Release every block after the first ``keep``; the budget is kept."""
        dropped = self.blocks[keep:]
        del self.blocks[keep:]
        for block in reversed(dropped):  # the tail first, so cached tails are evicted first
            self.pool.release(block)
        self.pool.reserve(len(dropped))
        self.reserved += len(dropped)

    def close(self) -> None:
        self.truncate(0)
        self.pool.unreserve(self.reserved)
        self.reserved = 0


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
    clean: bool = True
    confirmed: bool = False
    active: bool = False
    waiting: collections.deque = attrs.field(factory=collections.deque)
    last_used: float = attrs.field(factory=time.monotonic)
    replay: ReplayLog = attrs.field(factory=ReplayLog)

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting


@attrs.define(eq=False)
class Snapshot:
    tokens: tuple[int, ...]
    slot: Slot
    salt: str | None = None  # only sessions of this salt reuse it
    last_used: float = attrs.field(factory=time.monotonic)


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
                 prefix_caching: bool = True, idle_timeout: float | None = None, soft_idle_timeout: float = 600.0):
        self.pool = pool
        self.max_sessions = max_sessions
        self.budget = pool.blocks_for(max_context)
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

    @staticmethod
    def pool_blocks(block_size: int, *, max_sessions: int, max_context: int, snapshots: int) -> int:
        """Blocks a pool needs so every slot and snapshot can fill its budget."""
        return (max_sessions + snapshots) * -(-max_context // block_size)

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

    def _free_a_slot(self, anonymous: bool = False) -> None:
        """Make room for one more session, or :class:`CapacityError`. Soft sessions give way
        first; then, with ``--evict-idle-sessions``, the least recently used idle named
        session is evicted. Without it, so is it for an anonymous request when no slot
        would free on its own (no anonymous request or soft session running): anonymous
        work always finds room, and named sessions cannot lock a server. A session with a
        request running or queued is never evicted."""
        if self.slots_in_use < self.max_sessions:
            return
        soft = self._idle_soft()  # soft sessions give way first, with or without --evict-idle-sessions
        if soft:
            self.drop(min(soft, key=lambda s: s.last_used))
            self.evictions += 1
            return
        frees_on_its_own = bool(self.anonymous) or any(s.active and s.soft for s in self.named.values())
        if self.evict_idle or (anonymous and not frees_on_its_own):
            idle = [s for s in self.named.values() if s.idle]
            if idle:
                victim = min(idle, key=lambda s: s.last_used)
                self.drop(victim)
                self.evictions += 1
                return
        raise CapacityError(
            f"all {self.max_sessions} session slots (--max-sessions) are in use"
            + ("" if self.evict_idle else " (start the server with --evict-idle-sessions to evict idle ones)")
        )

    def open(self, name: str | None, salt: str | None = None, soft: bool = False) -> tuple[Session, bool]:
        """The session for ``name`` (created with ``salt`` when new), or a temporary
        one when None. :class:`SaltMismatch` when ``name`` exists with another salt."""
        self.expire_idle()
        if name is not None and name in self.named:
            session = self.named[name]
            if session.salt != salt:
                raise SaltMismatch(f"session {name!r} was opened with a different cache_salt")
            return session, False
        self._free_a_slot(anonymous=name is None)
        session = Session(name, Slot.open(self.pool, self.budget), salt=salt, soft=soft and name is not None)
        if name is None:
            self.anonymous.add(session)
        else:
            self.named[name] = session
        return session, True

    def drop(self, session: Session) -> None:
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
        ones idle longer than ``--soft-session-idle-timeout``; how many."""
        now = time.monotonic() if now is None else now

        def timeout(session: Session) -> float | None:
            return self.soft_idle_timeout if session.soft else self.idle_timeout

        stale = [s for s in self.named.values()
                 if s.idle and timeout(s) is not None and now - s.last_used > timeout(s)]
        for session in stale:
            self.drop(session)
        self.expired += len(stale)
        return len(stale)

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
        transcript, a snapshot or the prefix cache, whichever is longest; returns it."""
        reuse, snapshot = self.best_prefix(session, prompt)
        block_size = self.pool.block_size
        cached: list[int] | None = None
        if self.cache is not None:
            own = session.slot.blocks[: reuse // block_size] if snapshot is None else ()
            found, blocks = self.cache.lookup(prompt, len(prompt) - 1, session.salt, held=own)
            if found > reuse:
                reuse, cached = found, blocks
        if cached is not None:
            session.slot.truncate(0)  # releases nothing the lookup found for good: no allocation between
            for block in cached:
                session.slot.adopt(block)
            self.cache.hits += 1
            self.cache.hit_tokens += reuse
        elif snapshot is None:
            session.slot.truncate(self.pool.blocks_for(reuse))
        else:
            session.slot.truncate(0)
            for block in snapshot.slot.blocks[: self.pool.blocks_for(reuse)]:
                session.slot.adopt(block)
            snapshot.last_used = time.monotonic()
        session.tokens = list(prompt[:reuse])
        assert len(session.slot.blocks) * block_size >= reuse
        return reuse

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
            oldest.slot.close()
        slot = Slot.open(self.pool, self.budget)
        for block in session.slot.blocks[: self.pool.blocks_for(len(tokens))]:
            slot.adopt(block)
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
