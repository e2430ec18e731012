"""Blocks on demand for running requests, and suspension to the host tier (docs/engine.md
"Running requests: blocks on demand, suspended to the host tier").

Where the host tier is on (``--kv-offload-memory``, an executor with the ``HostKV``
capability), a running request reserves nothing at admission: it takes KV blocks as it grows,
prefill chunk by chunk and decode block by block (:meth:`OnDemand.secure`, asked by the
scheduler for each sequence a step carries). When the device pool has not the blocks a step
needs:

1. idle holders make room as before (:meth:`SessionTable.make_room`): idle named sessions and
   snapshots move to the host tier, least recently used first, and what the host tier cannot
   take is dropped in the documented order; then named sessions whose next request only waits
   in the queue move down too;
2. then running sequences of **lower priority** than the one that grows are **suspended**: their
   blocks, from the last one back, are copied to host pages and released on the device
   (:meth:`OnDemand._suspend`). Priority is admission order: the request admitted first comes
   first, so the request admitted last is suspended first. A suspended sequence stays a running
   request (its stream just pauses); it is never recomputed and never failed.
3. A sequence that still finds no room (nothing of lower priority is left to suspend) waits a
   step, its blocks kept.

Suspended sequences come back (:meth:`OnDemand.resume`, before each step is planned), admitted
first first, when the device has room for their blocks and one more block for themselves and for
each running sequence admitted before them (the hysteresis that keeps a resumed sequence from
being suspended again at the next block boundary); room is made for them as for growth, running
sequences admitted after them being suspended, since they come first. While any sequence is
suspended, new requests wait.

**The admission guarantee, over both tiers.** A request starts only when everything that may
not be lost still fits in device plus host pages at its end (:meth:`OnDemand.lacking`): the
pages each running request may reach (its prompt and ``max_tokens``, counted as today's
reservation was, :meth:`SessionTable.run_blocks`), the pages of named sessions that may not be
lost (without ``--evict-idle-sessions``; and those whose next request waits in the queue), and,
with sliding pages, one block's pages of slack for the granularity of moves; and a request that
may reach more pages than the device has never starts (it runs with all its blocks there). Snapshots, soft sessions and the prefix
cache's blocks may be dropped and are not counted. Under that bound the running request admitted
first can always grow: whatever the device lacks, the host tier has free (the counted pages
exceed what is held by at least what every running request may still take), so moving lower
priority sequences down always makes its room; it ends, and the next one is first. A request that
cannot fit even with nothing else running is refused (503, naming both tiers' numbers); one that
could fit later waits.

Sequences in a rewind past the sliding layers' window (their own sliding pages,
``Slot.window_pages``) are not suspended; they keep the pages they reserved at admission.

Tensor-free and backend-neutral: the copies are the executor's ``HostKV`` copies, through
:class:`~musegl_core.engine.kv_host.HostTier`.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from musegl_core.engine.kv_host import HostBlock, HostFull
from musegl_core.engine.request import Phase, SequenceState
from musegl_core.engine.sessions import Session, SessionTable, copy_back, share_from_pool


class OnDemand:
    """The running sequences' KV books where the host tier is on (see the module docstring)."""

    def __init__(self, sessions: SessionTable):
        if sessions.host is None:
            raise ValueError("blocks on demand for running requests need the host tier")
        self.sessions = sessions
        self.pool = sessions.pool
        self.host = sessions.host
        #: per running sequence (by handle): the pages it may reach by its end (the admission guarantee)
        self.ceilings: dict[int, int] = {}
        #: per suspended sequence (by handle): its last blocks, in the host tier, in order
        self.parked: dict[int, list[HostBlock]] = {}
        self.suspensions = 0  # sequences suspended (each time one went down)
        self.resumptions = 0  # sequences resumed
        self.suspended_blocks = 0  # blocks moved down by suspensions
        self.resumed_blocks = 0  # blocks brought back by resumptions
        self.refused_pages = 0  # the pages the last refused request may reach (its 503's numbers)
        self.never = False  # the last refused request may reach more pages than the device has

    # -- admission ---------------------------------------------------------------------------
    def ceiling(self, session: Session, blocks: int, pages: int = 0) -> int:
        """The pages a request on ``session`` may reach: the pages of the blocks it holds after
        attaching (with sliding pages, only the companions still kept: those that left the window
        never come back to this request), every page of the ``blocks`` it may still take
        (:meth:`SessionTable.run_blocks`), plus ``pages`` lone pages of a window recomputation."""
        pool = self.pool
        return sum(pool.pages(b) for b in session.slot.blocks) + blocks * pool.pages_per_block + pages

    def pinned(self, exclude: Session | None = None) -> int:
        """Pages, on the device and in the host tier, of named sessions that may not be lost: those
        not running whose request waits in the queue, and, without ``--evict-idle-sessions``, every
        idle one that is not soft."""
        pool, table = self.pool, self.sessions
        total = 0
        for session in table.named.values():
            if session is exclude or session.active:
                continue
            if session.waiting or (not session.soft and not table.evict_idle):
                total += sum(pool.pages(b) for b in session.slot.blocks)
                total += sum(len(b.pages) for b in session.host)
        return total

    @property
    def committed(self) -> int:
        """Pages the running sequences may reach by their ends."""
        return sum(self.ceilings.values())

    @property
    def capacity(self) -> int:
        """Device pages plus host pages."""
        return self.pool.num_blocks + self.host.num_pages

    @property
    def slack(self) -> int:
        """Pages the guarantee keeps free for the granularity of moves: none when a block is one page
        (every move frees what it takes), a block's pages with sliding pages (a block moved down may
        be fewer pages than the one taken)."""
        return self.pool.pages_per_block if self.pool.companions else 0

    def lacking(self, session: Session, ceiling: int) -> int:
        """Pages a request on ``session`` that may reach ``ceiling`` pages lacks to start now: 0
        when it may (the guarantee holds with it), else how many (a positive count also while
        any sequence is suspended: new requests wait for them)."""
        self.never = ceiling > self.pool.num_blocks
        if self.never:  # it runs with every block on the device: it never could
            self.refused_pages = ceiling
            return ceiling - self.pool.num_blocks
        if self.parked:
            return self.pool.pages_per_block
        short = self.committed + ceiling + self.pinned(exclude=session) + self.slack - self.capacity
        if short > 0:
            self.refused_pages = ceiling
        return max(0, short)

    def started(self, seq: SequenceState, ceiling: int) -> None:
        self.ceilings[seq.handle] = ceiling

    def finish(self, seq: SequenceState) -> int:
        """``seq`` ends: its suspended blocks are let go of (keyed ones stay in the host tier's prefix
        cache); the positions whose K/V it still has on the device."""
        self.ceilings.pop(seq.handle, None)
        parked = self.parked.pop(seq.handle, None)
        if parked:
            self.sessions._keep_cached(parked)
        return min(seq.computed, len(seq.session.slot.blocks) * self.pool.block_size)

    def shortfall(self) -> str:
        """A 503's message: why the last refused request cannot run, with both tiers' numbers."""
        pool, host = self.pool, self.host
        unit = "pages" if pool.companions else "blocks"
        return (f"the KV cache is full: a request may reach {self.refused_pages} KV {unit} of {pool.block_size} "
                f"positions (its prompt and max_tokens); the device pool has {pool.num_blocks} and the host tier "
                f"{host.num_pages}, running requests may reach {self.committed} and named sessions that may not be "
                f"lost hold {self.pinned()}{self.sessions._host_numbers()}"
                + ("" if self.sessions.evict_idle else
                   " (start the server with --evict-idle-sessions to evict idle ones)"))

    # -- growth ----------------------------------------------------------------------------
    def need(self, seq: SequenceState, start: int, end: int) -> int:
        """Blocks ``seq`` must take to write positions ``start .. end-1`` (new blocks and
        copies on write), beyond what its slot has reserved already."""
        pool = self.pool
        slot = seq.session.slot
        if end <= seq.rewound:  # a window recomputation writes its own pages, reserved at admission
            return 0
        size = pool.block_size
        cow = sum(pool.immutable(slot.blocks[i])
                  for i in range(start // size, min(len(slot.blocks), pool.blocks_for(end))))
        return max(0, max(0, pool.blocks_for(end) - len(slot.blocks)) + cow - slot.reserved)

    def is_suspended(self, seq: SequenceState) -> bool:
        return seq.handle in self.parked

    def secure(self, seq: SequenceState, blocks: int, running: Sequence[SequenceState], *,
               suspend: bool = True) -> bool:
        """Reserve ``blocks`` more blocks for ``seq``'s next step (its slot takes them in the step).
        When the pool has not them: idle holders make room, then (``suspend``) running sequences
        of lower priority are suspended, the last admitted first. False (nothing reserved) when
        there is still no room: ``seq`` skips this step."""
        if blocks <= 0:
            return True
        pool = self.pool
        pages = blocks * pool.pages_per_block
        if pool.available_blocks < pages and suspend:
            self.make_room(pages, seq, running)
        if pool.available_blocks < pages:
            return False
        seq.session.slot.grow(blocks)
        return True

    def make_room(self, pages: int, seq: SequenceState, running: Sequence[SequenceState]) -> None:
        """Free device pages for ``seq`` until ``pages`` are available: idle holders first, then
        named sessions whose request waits in the queue, then lower-priority running sequences."""
        pool, table = self.pool, self.sessions
        keep = tuple(s.session for s in running)
        table.make_room(pages, keep=keep)
        for session in list(table.named.values()):
            if pool.available_blocks >= pages:
                return
            if session.active or not session.slot.blocks or any(session is k for k in keep):
                continue
            if not session.clean:  # a dirty session reuses nothing of its blocks
                session.slot.truncate(0, rereserve=False)
                session.tokens = []
            elif not table.offload(session):  # the host tier cannot take it whole: its last blocks
                self._move_tail(session, pages - pool.available_blocks)
        for victim in sorted(running, key=lambda s: s.handle, reverse=True):
            if pool.available_blocks >= pages or victim.handle <= seq.handle:
                return
            if self._suspendable(victim):
                self._suspend(victim, pages - pool.available_blocks)

    def _move_tail(self, session: Session, short: int) -> None:
        """Move an idle named session's last blocks to the host tier, as many as the device is
        ``short`` of pages for (or as fit): its host blocks then follow those it keeps on the device
        (:meth:`SessionTable.restore` brings them back in order). Named sessions that may not be
        lost are moved down in part where the host tier cannot take them whole."""
        pool, host = self.pool, self.host
        slot = session.slot
        items = [[b, *(pool.companion_pages(b) or ())] for b in slot.blocks[: pool.blocks_for(len(session.tokens))]]
        if host.free_pages < short:
            self.sessions._host_room(short, keep=session)  # the host tier's prefix cache, droppable holders
        count, taken = 0, 0
        for pages in reversed(items):
            if taken + len(pages) > host.free_pages or taken >= short:
                break
            taken += len(pages)
            count += 1
        if count == 0:
            return
        keep = len(items) - count
        moved = host.offload([(pages, pool.key(block)) for pages, block in zip(items[keep:], slot.blocks[keep:])])
        session.host = moved + session.host
        slot.truncate(keep, rereserve=False)
        table = self.sessions
        table.offloads += 1

    def _suspendable(self, seq: SequenceState) -> bool:
        slot = seq.session.slot
        return (seq.phase is not Phase.FINISHED and bool(slot.blocks)
                and not slot.window_pages and not slot.page_reserve)

    def _suspend(self, seq: SequenceState, short: int) -> None:
        """Move ``seq``'s blocks to the host tier, from its last block back: all of them when the
        host tier can take them, else at least the pages the device is ``short`` of, or what fits."""
        pool, host, table = self.pool, self.host, self.sessions
        slot = seq.session.slot
        slot.settle()  # what it reserved (rejected drafts' blocks) goes back too
        items = [[b, *(pool.companion_pages(b) or ())] for b in slot.blocks]
        total = sum(len(p) for p in items)
        if host.free_pages < total:
            table._host_room(total, keep=seq.session)
        room = host.free_pages
        if room < total:  # the host tier takes the last blocks it can, enough to cover ``short`` if it may
            taken, count = 0, 0
            for pages in reversed(items):
                if taken + len(pages) > room:
                    break
                taken += len(pages)
                count += 1
                if taken >= short:
                    break
        else:
            count = len(items)
        if count == 0:
            return
        keep = len(items) - count
        try:
            moved = host.offload([(pages, pool.key(block)) for pages, block in zip(items[keep:], slot.blocks[keep:])])
        except HostFull:
            return
        slot.truncate(keep, rereserve=False)
        seq.drafts = []
        newly = seq.handle not in self.parked
        self.parked[seq.handle] = moved + self.parked.get(seq.handle, [])
        self.suspended_blocks += len(moved)
        if newly:
            self.suspensions += 1

    # -- resumption --------------------------------------------------------------------------
    def resume(self, running: Sequence[SequenceState]) -> list[SequenceState]:
        """Bring suspended sequences back, the first admitted first: a sequence comes back when the
        device has room for its blocks and one more block for itself and for each running sequence
        admitted before it (that margin keeps it from being suspended again at the next block
        boundary). Room is made as for growth (:meth:`make_room`): idle holders first, then running
        sequences admitted after it are suspended, since it comes before them. The first admitted
        of all running sequences comes back block by block when the tiers are so full that its
        blocks and the blocks moved down for them must take turns (every block it brings back frees
        host pages for the next one moved down). The sequences resumed."""
        if not self.parked:
            return []
        pool = self.pool
        per = pool.pages_per_block
        resumed = []
        for seq in sorted((s for s in running if s.handle in self.parked), key=lambda s: s.handle):
            parked = self.parked[seq.handle]
            older = sum(1 for s in running if s.handle < seq.handle and s.handle not in self.parked)
            extra = per * (older + 1)
            while parked:
                want = len(parked) * per + extra
                if pool.available_blocks < want:
                    self.make_room(want, seq, running)
                if pool.available_blocks >= want:
                    fit = len(parked)
                elif older == 0:  # nobody may suspend it again: bring back what fits, then make more room
                    fit = min(len(parked), pool.available_blocks // per)
                else:
                    fit = 0
                if fit == 0:
                    break
                self._restore(seq, parked[:fit])
                self.resumed_blocks += fit
                del parked[:fit]
            if parked:
                break  # the sequences admitted after it wait behind it
            del self.parked[seq.handle]
            self.resumptions += 1
            resumed.append(seq)
        return resumed

    def _restore(self, seq: SequenceState, parked: list[HostBlock]) -> None:
        """Copy a suspended sequence's host blocks back after the blocks it kept on the device; a
        block whose key the device pool still holds (with its sliding pages) is shared from there."""
        pool, host = self.pool, self.host
        slot = seq.session.slot
        pairs: list[tuple[int, int]] = []
        copied = 0
        for moved in parked:
            if share_from_pool(pool, slot, moved):
                continue
            copy_back(pool, slot, moved, pairs)  # (admission counted its pages)
            copied += 1
        host.restore(pairs, copied)
        self.sessions._keep_cached(parked)

    # -- what the metrics read ---------------------------------------------------------------
    def suspended_now(self) -> int:
        return len(self.parked)

    def stats(self) -> dict:
        return {
            "kv_suspended": self.suspensions,
            "kv_resumed": self.resumptions,
            "kv_suspended_blocks": self.suspended_blocks,
            "kv_resumed_blocks": self.resumed_blocks,
            "kv_requests_suspended": len(self.parked),
            "kv_pages_committed": self.committed,
        }


def runnable(seqs: Iterable[SequenceState], on_demand: OnDemand | None) -> list[SequenceState]:
    """``seqs`` without the suspended ones."""
    if on_demand is None or not on_demand.parked:
        return list(seqs)
    return [s for s in seqs if s.handle not in on_demand.parked]
