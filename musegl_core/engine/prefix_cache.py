"""Automatic prefix caching: content-addressed reuse of full KV blocks.

The design is vLLM's and nano-vllm's: every *full* block of a computed
sequence gets a key, the hash of its tokens chained with the key of the
block before it, so a key identifies the whole prefix up to the end of that
block (tokens and positions), not just the block's own tokens. Keys live in
the :class:`~musegl_core.engine.kv_pool.KVPool`, which keeps a keyed block's
K/V after its last holder lets go (a *cached* block) and evicts cached blocks
least recently released first, only when an allocation needs the room.

A later prompt walks its own full blocks, computing the same chain, and
adopts every block whose key the pool knows, held by someone else (shared,
copy-on-write at the first write) or cached (revived). Partial blocks are
never keyed: a block is keyed only once it is full and computed, and a keyed
block is never written in place, so a key always describes what the block
holds.

The hash is BLAKE2b-128 over the parent key and the token ids: a collision
would silently serve another prefix's K/V, so Python's ``hash`` is not used.
Image rows enter as their identity keys (:mod:`musegl_core.engine.identity`).

A request's ``cache_salt`` enters the chain at the first block: the chain of a
salted request starts from :func:`chain_root` of its salt instead of
:data:`ROOT`, so no key of one salt can equal a key of another (or of the
unsalted space), and a request can only ever find blocks computed by requests
with the same salt. Without this, ``cached_tokens`` (and the time to the first
token) tells a client whether someone else sent a given prompt.
"""

from __future__ import annotations

import array
import hashlib
from typing import Sequence

import attrs

from musegl_core.engine.kv_pool import KVPool

ROOT = b"musegl-prefix-v1"


def chain_root(salt: str | None) -> bytes:
    """The parent key of a prompt's first block: :data:`ROOT` without a salt,
    else a digest of the salt (length-prefixed, so no salt is a prefix of another)."""
    if salt is None:
        return ROOT
    data = salt.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(ROOT, digest_size=16, person=b"cache_salt")
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)
    return digest.digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block holding ``tokens`` after the prefix keyed ``parent``."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array.array("q", tokens).tobytes())
    return digest.digest()


@attrs.define
class PrefixCache:
    """Publishes computed blocks under their keys and finds them again."""

    pool: KVPool
    hits: int = 0  # requests that reused blocks found here
    hit_tokens: int = 0  # prompt positions those requests reused

    def publish(self, tokens: Sequence[int], blocks: Sequence[int], salt: str | None = None) -> None:
        """Key every full block of a sequence whose first ``len(tokens)`` positions
        are computed (``blocks[i]`` holds positions ``i*size .. i*size+size-1``),
        in the key space of ``salt``."""
        size = self.pool.block_size
        parent = chain_root(salt)
        for index in range(min(len(tokens) // size, len(blocks))):
            block = blocks[index]
            known = self.pool.key(block)
            if known is None:
                known = block_key(parent, tokens[index * size : (index + 1) * size])
                self.pool.register(block, known)  # False: an equal block is keyed already
            parent = known

    def lookup(self, prompt: Sequence[int], limit: int, salt: str | None = None,
               held: Sequence[int] = ()) -> tuple[int, list[int]]:
        """The longest keyed prefix of ``prompt`` in the key space of ``salt``:
        (positions to reuse, at most ``limit``; the blocks holding them).

        ``held``: blocks known to hold the prompt's first full blocks (a session's own,
        where its transcript matches the prompt, in the same key space): those that are
        keyed are taken with their keys instead of hashing the prompt again, so a turn
        hashes only its new blocks."""
        size = self.pool.block_size
        parent = chain_root(salt)
        blocks: list[int] = []
        most = min(len(prompt) // size, self.pool.blocks_for(limit))
        for block in held[:most]:
            key = self.pool.key(block)
            if key is None:
                break
            blocks.append(block)
            parent = key
        for index in range(len(blocks), most):
            key = block_key(parent, prompt[index * size : (index + 1) * size])
            block = self.pool.lookup(key)
            if block is None:
                break
            blocks.append(block)
            parent = key
        reuse = min(len(blocks) * size, limit)
        return reuse, blocks[: self.pool.blocks_for(reuse)]

    def stats(self) -> dict:
        return {
            "kv_blocks_cached": self.pool.cached_blocks,
            "prefix_cache_hits": self.hits,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_evicted_blocks": self.pool.evicted,
        }
