"""Shared prefill: a prompt waits for the blocks another running prompt is computing.

The prefix cache (:mod:`musegl_core.engine.prefix_cache`) lets a prompt reuse
the blocks of prompts that were computed *before* it arrived. Agents start
together: thirty-two conversations that open with the same 12k-token system
prompt and tool list arrive within a second, and each would prefill those
12k positions itself, because none of them is computed when the others are
admitted. :class:`PrefillSharing` closes that gap in two moves:

* **Publish as you go.** After every step, the full blocks a prefilling
  sequence has computed are keyed in the prefix cache at once
  (:meth:`PrefillSharing.computed`), not only when its whole prompt is done.
* **Follow, then adopt.** Before the scheduler hands out prefill rows, a
  prefilling sequence whose next block is the one an *earlier* prefilling
  sequence (its leader, ahead of it in first-come first-served order) is
  computing now gets no rows this step: it *follows* (:meth:`PrefillSharing.ready`).
  Every step, a sequence adopts the blocks the cache now holds for its next
  positions (shared, like any prefix-cache hit; its ``cached`` count grows, so
  ``usage.prompt_tokens_details.cached_tokens`` says so), and once its prompt
  parts from the leader's it prefills its own rows.

The leader's blocks are computed once instead of once per conversation, and a
follower waits no longer than it would have taken to compute them itself: the
leader is ahead of it in the prefill order, so its rows come first either way.

What follows what is decided on the chained block keys of the prompts
(:func:`~musegl_core.engine.prefix_cache.block_key`, salted like the cache:
requests of different ``cache_salt`` never follow each other). Only a
sequence that has computed nothing itself since it was admitted follows or
adopts, and only at a block boundary, so an executor only ever sees a
sequence's first chunk start past positions it did not compute, as it does
after any prefix-cache hit. A sequence follows only a leader that will
compute the block, so when a leader ends or is cancelled its followers
prefill from where the cache leaves them.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from musegl_core.engine.kv_pool import KVPool, PoolExhausted
from musegl_core.engine.prefix_cache import PrefixCache, block_key, chain_root
from musegl_core.engine.request import SequenceState


def prompt_chain(keys: Sequence[int], prompt_len: int, block_size: int, salt: str | None) -> list[bytes]:
    """The prefix-cache keys of the full blocks a sequence may reuse: blocks that
    end before its last prompt position (which it always computes, to sample)."""
    chain, parent = [], chain_root(salt)
    for index in range(max(0, prompt_len - 1) // block_size):
        parent = block_key(parent, keys[index * block_size:(index + 1) * block_size])
        chain.append(parent)
    return chain


@attrs.define
class PrefillSharing:
    """Publishes prefill progress and makes prompts follow the leaders they share
    blocks with (see the module docstring)."""

    pool: KVPool
    cache: PrefixCache
    #: prompt positions adopted from a running sequence's published progress
    shared_tokens: int = 0
    #: requests that adopted any
    shared_requests: int = 0
    #: steps x sequences that followed (got no rows, waiting for a leader's blocks)
    follow_steps: int = 0
    _chains: dict[int, list[bytes]] = attrs.field(factory=dict)  # by sequence handle
    _shared: set[int] = attrs.field(factory=set)  # handles counted in shared_requests
    _followed: set[int] = attrs.field(factory=set)  # handles that followed a leader at least once

    def chain(self, seq: SequenceState) -> list[bytes]:
        chain = self._chains.get(seq.handle)
        if chain is None:
            salt = getattr(seq.session, "salt", None)
            chain = self._chains[seq.handle] = prompt_chain(seq.keys, seq.prompt_len, self.pool.block_size, salt)
        return chain

    def forget(self, seq: SequenceState) -> None:
        """``seq`` left the batch."""
        self._chains.pop(seq.handle, None)
        self._shared.discard(seq.handle)
        self._followed.discard(seq.handle)

    def _next_block(self, seq: SequenceState) -> int | None:
        """The index of the block ``seq`` would compute next, when it may still
        follow or adopt: it computed nothing itself and stands at a block boundary."""
        if seq.computed != seq.cached or seq.computed % self.pool.block_size:
            return None
        return seq.computed // self.pool.block_size

    def adopt(self, seq: SequenceState) -> int:
        """Take the cache's blocks for ``seq``'s next positions; how many positions."""
        index = self._next_block(seq)
        if index is None:
            return 0
        chain = self.chain(seq)
        found = []
        while index + len(found) < len(chain):
            block = self.pool.lookup(chain[index + len(found)])
            if block is None:
                break
            found.append(block)
        if not found:
            return 0
        slot = seq.session.slot
        slot.truncate(index)  # blocks past ``computed`` hold nothing yet
        adopted = 0
        for block in found:
            try:
                slot.adopt(block)
            except PoolExhausted:  # blocks on demand: no free block to revive a cached one
                break
            adopted += 1
        if not adopted:
            return 0
        positions = adopted * self.pool.block_size
        seq.computed += positions
        seq.cached += positions
        self.shared_tokens += positions
        if seq.handle not in self._shared:
            self._shared.add(seq.handle)
            self.shared_requests += 1
        return positions

    def _follows(self, seq: SequenceState, ahead: Sequence[SequenceState]) -> bool:
        index = self._next_block(seq)
        size = self.pool.block_size
        if index is None or (index + 1) * size > seq.prompt_len - 1:  # not a block it may reuse
            return False
        lo, hi = index * size, (index + 1) * size
        mine = seq.keys[lo:hi]
        for leader in ahead:
            # a leader works on this very block: not done with it, not behind it (one that is
            # behind would first compute what this sequence already holds, and it goes first)
            if not lo <= leader.computed < hi or leader.keys[lo:hi] != mine:
                continue
            theirs = self.chain(leader)  # the same tokens there: is it the same prefix?
            if index < len(theirs) and theirs[index] == self.chain(seq)[index]:
                return True
        return False

    def ready(self, prefilling: list[SequenceState]) -> list[SequenceState]:
        """The prefilling sequences (in scheduling order) that get rows this step:
        a sequence that followed a leader first adopts what the cache now holds for
        it; a follower is left out. Prompts are hashed only where an earlier
        prefilling prompt holds the same tokens at the block in question (what
        the cache held at admission, a sequence took then)."""
        if len(prefilling) == 1 and prefilling[0].handle not in self._followed:
            return prefilling
        size = self.pool.block_size
        ready: list[SequenceState] = []
        # earlier prefilling sequences by their first block: a leader shares it (whole prefixes match)
        ahead: dict[tuple[int, ...], list[SequenceState]] = {}
        for seq in prefilling:
            if seq.handle in self._followed:
                self.adopt(seq)
            head = tuple(seq.keys[:size])
            if self._follows(seq, ahead.get(head, ())):
                self.follow_steps += 1
                self._followed.add(seq.handle)
            else:
                ready.append(seq)
            ahead.setdefault(head, []).append(seq)
        return ready

    def computed(self, seq: SequenceState) -> None:
        """A step computed prompt rows of ``seq`` (its prompt not done yet): key its full blocks."""
        self.cache.publish(seq.keys[:seq.computed], seq.blocks, getattr(seq.session, "salt", None))

    def stats(self) -> dict:
        return {"prefill_shared_tokens": self.shared_tokens, "prefill_shared_requests": self.shared_requests,
                "prefill_follow_steps": self.follow_steps}
