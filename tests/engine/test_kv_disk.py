"""The disk tier's block store (engine/kv_disk.py): bytes in, bytes out, keyed by content and
format; LRU within its size; crash-safe writes; integrity checks; an index that survives a restart."""

from __future__ import annotations

import logging
import os

import attrs
import pytest

from musegl_core.engine import kv_disk as kd
from musegl_core.engine.prefix_cache import ROOT, block_key
from musegl_core.testing.files import unwritable_dir

FMT = kd.BlockFormat(model="tiny-abc", kv_dtype="float32", layout="4x2x8", block_size=4)
OTHER = kd.BlockFormat(model="tiny-abc", kv_dtype="float8_e4m3", layout="4x2x8", block_size=4)


def key(i: int) -> bytes:
    return block_key(ROOT, [i, i + 1, i + 2, i + 3])


def payload(i: int, n: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(n))


FILE = kd._HEADER.size + 16 + 1000  # one stored block of payload(i)


def test_put_get_round_trip_and_miss(tmp_path):
    store = kd.DiskTier.open(tmp_path, 10 * FILE, FMT)
    assert store.put(key(1), payload(1))
    assert store.get(key(1)) == payload(1)
    assert store.get(key(2)) is None
    assert key(1) in store and key(2) not in store
    stats = store.stats()
    assert stats["kv_disk_hits"] == 1 and stats["kv_disk_misses"] == 1
    assert stats["kv_disk_bytes"] == FILE and stats["kv_disk_blocks"] == 1


def test_lru_eviction_keeps_within_size(tmp_path):
    store = kd.DiskTier.open(tmp_path, 3 * FILE, FMT)
    for i in range(3):
        store.put(key(i), payload(i))
    assert store.get(key(0)) == payload(0)  # now most recently used
    store.put(key(3), payload(3))  # evicts key(1), the least recently used
    assert key(1) not in store and store.get(key(1)) is None
    assert [store.get(key(i)) for i in (0, 2, 3)] == [payload(0), payload(2), payload(3)]
    assert store.used == 3 * FILE
    files = list(store.dir.rglob("*.kv"))
    assert len(files) == 3 and sum(f.stat().st_size for f in files) <= store.capacity
    assert not store.put(key(9), payload(9, 4 * FILE))  # larger than the whole store


def test_the_index_survives_a_restart_with_its_lru_order(tmp_path):
    store = kd.DiskTier.open(tmp_path, 3 * FILE, FMT)
    for i in range(3):
        store.put(key(i), payload(i))
        os.utime(store._path(key(i)), (1000 + i, 1000 + i))
    os.utime(store._path(key(0)), (2000, 2000))  # key(0) used last
    again = kd.DiskTier.open(tmp_path, 3 * FILE, FMT)
    assert again.report.blocks == 3 and again.used == 3 * FILE
    again.put(key(3), payload(3))  # evicts key(1): the oldest by the files' times
    assert key(1) not in again and again.get(key(0)) == payload(0)
    assert "found 3 blocks of this model and KV format" in again.startup_line()


def test_a_smaller_size_at_restart_evicts_down_to_it(tmp_path):
    store = kd.DiskTier.open(tmp_path, 4 * FILE, FMT)
    for i in range(4):
        store.put(key(i), payload(i))
    small = kd.DiskTier.open(tmp_path, 2 * FILE, FMT)
    assert small.used == 2 * FILE and len(list(small.dir.rglob("*.kv"))) == 2


def test_another_format_finds_nothing_and_says_so(tmp_path):
    store = kd.DiskTier.open(tmp_path, 4 * FILE, FMT)
    store.put(key(1), payload(1))
    other = kd.DiskTier.open(tmp_path, 4 * FILE, OTHER)
    assert other.get(key(1)) is None
    line = other.startup_line()
    assert "found 0 blocks of this model and KV format" in line
    assert "1 blocks" in line and "KV float32" in line and "not used, evicted first" in line
    # other formats' files go first when room is needed
    for i in range(2, 6):
        other.put(key(i), payload(i))
    assert not (store._path(key(1))).exists()
    assert all(other.get(key(i)) == payload(i) for i in range(2, 6))


@pytest.mark.parametrize("damage", ["truncate", "flip", "swap", "empty", "garbage"])
def test_a_damaged_file_is_a_logged_miss_never_wrong_bytes(tmp_path, caplog, damage):
    store = kd.DiskTier.open(tmp_path, 10 * FILE, FMT)
    store.put(key(1), payload(1))
    store.put(key(2), payload(2))
    path = store._path(key(1))
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[:-10])
    elif damage == "flip":
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    elif damage == "swap":  # another key's (valid) file under this key's name
        path.write_bytes(store._path(key(2)).read_bytes())
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(b"x" * len(raw))
    with caplog.at_level(logging.WARNING, logger="musegl.kv_disk"):
        assert store.get(key(1)) is None
    assert "treated as a miss" in caplog.text
    assert not path.exists() and key(1) not in store
    assert store.stats()["kv_disk_corrupt_blocks"] == 1
    assert store.get(key(2)) == payload(2)


def test_a_crash_mid_write_leaves_no_block_and_the_restart_cleans_up(tmp_path):
    store = kd.DiskTier.open(tmp_path, 10 * FILE, FMT)
    store.put(key(1), payload(1))
    (tmp_path / kd.TMP / "deadbeef.part").write_bytes(b"half a block")  # a worker killed mid-write
    again = kd.DiskTier.open(tmp_path, 10 * FILE, FMT)
    assert again.report.removed_temporaries == 1 and not list((tmp_path / kd.TMP).iterdir())
    assert again.get(key(1)) == payload(1) and again.used == FILE


def test_a_file_deleted_by_hand_is_a_miss(tmp_path):
    store = kd.DiskTier.open(tmp_path, 10 * FILE, FMT)
    store.put(key(1), payload(1))
    store._path(key(1)).unlink()
    assert store.get(key(1)) is None and key(1) not in store and store.used == 0


def test_the_directory_must_be_writable(tmp_path):
    plain = tmp_path / "file"
    plain.write_text("x")
    with pytest.raises(kd.DiskTierError, match="is not a directory"):
        kd.DiskTier.open(plain, FILE, FMT)
    kd.check_dir(tmp_path / "new" / "deeper")  # creatable
    with unwritable_dir(tmp_path) as locked:
        with pytest.raises(kd.DiskTierError, match="is not writable"):
            kd.DiskTier.open(locked, FILE, FMT)
        with pytest.raises(kd.DiskTierError, match="not writable to create it"):
            kd.check_dir(locked / "sub")


def test_the_fingerprint_covers_every_field():
    base = FMT.fingerprint()
    for change in (dict(model="x"), dict(kv_dtype="bfloat16"), dict(layout="4x2x16"), dict(block_size=16)):
        assert attrs.evolve(FMT, **change).fingerprint() != base


def test_the_weights_identity_follows_the_files(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 100)
    first = kd.files_identity(model)
    assert kd.files_identity(model) == first
    os.utime(model / "model.safetensors", ns=(1, 1))  # rewritten in place
    assert kd.files_identity(model) != first
    assert kd.files_identity(model / "config.json") != kd.files_identity(model)
    assert kd.files_identity(tmp_path / "nothing").startswith("missing:")


def test_retained_blocks_go_last_and_their_retention_survives_a_restart(tmp_path):
    store = kd.DiskTier.open(tmp_path, 3 * FILE, FMT)
    now = store.clock()
    store.put(key(0), payload(0), until=now + 3600)  # least recently used, but retained
    store.put(key(1), payload(1))
    store.put(key(2), payload(2), until=now - 1)  # its retention is over
    store.put(key(3), payload(3))  # evicts key(1): the oldest without a running retention
    assert key(1) not in store and key(0) in store
    store.put(key(4), payload(4))  # then key(2)
    assert key(2) not in store and key(0) in store
    assert store.stats()["kv_disk_retained_blocks"] == 1
    again = kd.DiskTier.open(tmp_path, 3 * FILE, FMT)
    assert again._until == {key(0): now + 3600}
    again.put(key(3), payload(3), until=now + 7200)  # a later ask extends it, in the file too
    assert kd.DiskTier.open(tmp_path, 3 * FILE, FMT)._until[key(3)] == now + 7200
    assert again.get(key(3)) == payload(3)  # the header's retention is outside the payload's digest
    full = kd.DiskTier.open(tmp_path, 3 * FILE, FMT)
    for i in (5, 6, 7):
        full.put(key(i), payload(i))  # plain blocks churn; retained ones stay while others can go
    assert key(0) in full and key(3) in full
    full.put(key(8), payload(8), until=now + 60)  # evicts the plain key(7): all three are retained now
    full.put(key(9), payload(9))  # only retained ones are left to evict: the least recently used goes
    assert key(0) not in full and full.used <= full.capacity


def test_the_format_of_an_executors_blocks(tmp_path, caplog):
    from musegl_core.testing.example_executor import ExampleExecutor

    plain = ExampleExecutor(64)
    with pytest.raises(kd.DiskTierError, match="does not state what its K/V bytes depend on"):
        kd.block_format(plain)

    class Stating(ExampleExecutor):
        def kv_identity(self) -> str:
            return "weights abc"

    fmt = kd.block_format(Stating(64))
    assert "weights abc" in fmt.model and fmt.block_size == plain.block_size
    assert kd.block_format(Stating(64), companions=3).fingerprint() != fmt.fingerprint()
    with caplog.at_level(logging.INFO, logger="musegl.kv_disk"):
        store = kd.open_disk_tier(str(tmp_path / "kv"), 10 * FILE, fmt)
    assert store.blocks == 0 and "KV disk tier" in caplog.text and "found 0 blocks" in caplog.text


def test_an_engine_refuses_a_disk_tier_without_a_host_tier_above_it(tmp_path):
    from musegl_core.engine.engine import Engine, EngineConfig
    from musegl_core.errors import ConfigError
    from musegl_core.testing.example_executor import ExampleExecutor

    config = EngineConfig(max_context=64, kv_offload_dir=str(tmp_path), kv_offload_disk=1 << 20)
    with pytest.raises(ConfigError, match="--kv-offload-dir: the disk tier sits below the host tier"):
        Engine(ExampleExecutor(64), None, config, lambda event: None)


def test_the_room_line_states_the_disk_tier():
    from musegl_core.engine.kv_memory import room_line

    line = room_line(device_blocks=100, block_size=16, block_bytes=1024, max_context=64, host_bytes=64 * 1024,
                     disk_bytes=10 * (1024 + kd._HEADER.size + 16))
    assert line.endswith("; disk tier 10.71 KiB = 160 positions = 2 sessions of --max-context 64")
    assert "disk tier" not in room_line(device_blocks=100, block_size=16, block_bytes=1024, max_context=64)
