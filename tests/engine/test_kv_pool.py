"""KV pool accounting: reservations, sharing, exact return to baseline."""

import pytest

from musegl_core.engine.kv_pool import KVPool, PoolExhausted


def test_reserve_allocate_release_round_trip():
    pool = KVPool(num_blocks=8, block_size=4)
    pool.reserve(3)
    assert pool.available_blocks == 5
    blocks = [pool.allocate(reserved=True) for _ in range(3)]
    assert pool.reserved_blocks == 0 and pool.used_blocks == 3
    for b in blocks:
        pool.release(b)
    assert pool.free_blocks == 8 and pool.used_blocks == 0


def test_shared_block_returns_only_after_last_release():
    pool = KVPool(4, 16)
    b = pool.allocate()
    pool.share(b)
    pool.release(b)
    assert pool.used_blocks == 1
    pool.release(b)
    assert pool.used_blocks == 0
    with pytest.raises(ValueError):
        pool.release(b)


def test_exhaustion_is_reported_not_overcommitted():
    pool = KVPool(2, 16)
    pool.reserve(2)
    with pytest.raises(PoolExhausted):
        pool.allocate()
    with pytest.raises(PoolExhausted):
        pool.reserve(1)
    assert pool.blocks_for(33) == 3
