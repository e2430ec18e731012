"""The disk tier: KV blocks in files, below the host tier (``--kv-offload-dir``, ``--kv-offload-disk``).

A backend-neutral store: bytes in, bytes out. A block's file is named by its
**content key**: the prefix cache's chained token hash
(:func:`~musegl_core.engine.prefix_cache.block_key`), which names the whole
prefix up to the end of the block, under a directory named by the
**format fingerprint** (:class:`BlockFormat`): everything besides the tokens
that changes a block's K/V bytes (the model's weights, the KV dtype, the
executor's KV layout, the block size). A key of one format can therefore
never find another format's bytes, and a server started on another model or
KV format finds nothing of the first and says so at start-up
(:meth:`DiskTier.open`).

**Crash-safe writes.** A block is written to a temporary file under
``.tmp/`` and renamed into place, so a file under its key is whole or absent
(a crash leaves at most a temporary file, removed at the next start).
**Integrity.** Every file starts with a header (magic, format fingerprint,
key, payload length, BLAKE2b-128 of the payload) that :meth:`DiskTier.get`
checks in full: a truncated, corrupt or misplaced file is a miss, logged and
deleted, never another block's K/V. No ``fsync``: a block lost or torn by a
power cut is such a miss.

**Survives a restart.** The index is the directory itself: :meth:`DiskTier.open`
scans it (file sizes and modification times, no payload read), so the blocks
of the same format are found again after the worker or the host restarts.
**LRU within the size.** A hit touches the file's modification time, so the
least recently used order survives a restart too; a block put when the store
is full evicts first the files of other formats (oldest first), then the least
recently used blocks of this one whose retention is over (or that have none),
then, only if that is not enough, retained ones, least recently used first.
A block's retention (``until``, a Unix time: the client asked for it,
engine/retention.py) is kept in its header, so it survives a restart too.
Sizes count whole files (header included).

Thread-safe: the index is guarded by a lock; file I/O runs outside it, so a
writer thread and the engine thread may use one store (a ``get`` racing the
eviction of its file is a miss).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
import uuid
from pathlib import Path

import attrs

from musegl_core.engine.kv_memory import human

log = logging.getLogger("musegl.kv_disk")

MAGIC = b"MGKVBLK1"
#: magic, fingerprint (16), key length (1), payload length (8), payload digest (16), kept until (a Unix time, 0:
#: no retention); then the key, then the payload
_HEADER = struct.Struct("<8s16sBQ16sd")
_UNTIL = struct.Struct("<d")
_UNTIL_AT = _HEADER.size - _UNTIL.size
SUFFIX = ".kv"
FORMAT_FILE = "format.json"
MARKER = "MUSEGL-KV-DISK-TIER"
TMP = ".tmp"


class DiskTierError(Exception):
    """The disk tier cannot be used as configured (a one-line reason for the operator)."""


@attrs.frozen
class BlockFormat:
    """Everything that changes a block's K/V bytes besides the tokens it holds.

    ``model``: the identity of the weights (a digest of the checkpoint, as the
    executor's loader states it); ``kv_dtype``: ``--kv-cache-dtype`` as stored
    (``bfloat16``, ``float8_e4m3``, ...); ``layout``: the executor's KV format
    (layers, KV heads, head size, page layout, the speculator's context store);
    ``block_size``: positions a block holds."""

    model: str
    kv_dtype: str
    layout: str
    block_size: int

    def fingerprint(self) -> bytes:
        text = json.dumps(attrs.asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=16, person=b"musegl-kv-fmt").digest()

    def describe(self) -> str:
        return f"model {self.model}, KV {self.kv_dtype}, layout {self.layout}, block {self.block_size}"


@attrs.frozen
class OpenReport:
    """What :meth:`DiskTier.open` found."""

    blocks: int  # blocks of this format, usable
    bytes: int  # their file bytes
    foreign_blocks: int  # blocks of other formats (never read; evicted first)
    foreign_bytes: int
    foreign_formats: tuple[str, ...]  # their descriptions, as their format.json states them
    removed_temporaries: int  # unfinished writes of a crashed worker, removed


def payload_digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class DiskTier:
    """A file-backed block store of ``capacity`` bytes under ``root`` for blocks of ``fmt``.

    It is the tier below the host tier (the ``KVTier`` interface of engine/kv_host.py:
    :attr:`name`, :meth:`contains`, :meth:`put`, :meth:`get`)."""

    name = "disk"  # the cache_source label of its hits

    def __init__(self, root: str | os.PathLike, capacity: int, fmt: BlockFormat):
        self.root = Path(root)
        self.capacity = capacity
        self.format = fmt
        self._fp = fmt.fingerprint()
        self.dir = self.root / self._fp.hex()
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> file bytes, LRU first
        self._until: dict[bytes, float] = {}  # key -> kept until (Unix time), for retained blocks only
        self.clock = time.time
        self._foreign: list[tuple[float, Path, int]] = []  # (mtime, path, bytes) of other formats, oldest last
        self.used = 0  # file bytes held (both kinds)
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.write_bytes = 0
        self.read_bytes = 0
        self.evicted = 0
        self.corrupt = 0
        self.report: OpenReport | None = None

    # -- opening ---------------------------------------------------------------------
    @classmethod
    def open(cls, root: str | os.PathLike, capacity: int, fmt: BlockFormat) -> "DiskTier":
        """Create or reopen the store: index the blocks a previous worker left, note other formats'."""
        store = cls(root, capacity, fmt)
        store._open()
        return store

    def _open(self) -> None:
        check_dir(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / MARKER).write_text("musegl's KV disk tier (--kv-offload-dir): one directory per model and "
                                            "KV format; safe to delete while no server uses it\n")
            self.dir.mkdir(exist_ok=True)
            fmt_file = self.dir / FORMAT_FILE
            if not fmt_file.exists():
                tmp = self.root / f"{FORMAT_FILE}.{uuid.uuid4().hex}"
                tmp.write_text(json.dumps(attrs.asdict(self.format), sort_keys=True))
                os.replace(tmp, fmt_file)
            tmp_dir = self.root / TMP
            removed = 0
            if tmp_dir.exists():
                for entry in os.scandir(tmp_dir):
                    os.unlink(entry.path)
                    removed += 1
            tmp_dir.mkdir(exist_ok=True)
        except OSError as exc:
            raise DiskTierError(f"--kv-offload-dir {self.root}: {exc.strerror or exc}") from None
        own: list[tuple[float, bytes, int]] = []
        foreign_formats = []
        for sub in sorted(os.scandir(self.root), key=lambda e: e.name):
            if not sub.is_dir(follow_symlinks=False) or sub.name == TMP or len(sub.name) != 32:
                continue
            mine = sub.name == self.dir.name
            if not mine:
                foreign_formats.append(_read_format(Path(sub.path)))
            for path, stat in _block_files(Path(sub.path)):
                if mine:
                    try:
                        key = bytes.fromhex(path.name[: -len(SUFFIX)])
                    except ValueError:
                        continue
                    own.append((stat.st_mtime, key, stat.st_size, _read_until(path)))
                else:
                    self._foreign.append((stat.st_mtime, path, stat.st_size))
                self.used += stat.st_size
        for _, key, size, until in sorted(own):
            self._lru[key] = size
            if until:
                self._until[key] = until
        self._foreign.sort(reverse=True)  # oldest last: popped first
        with self._lock:
            victims = self._make_room(0)  # a smaller --kv-offload-disk than last time: evict down to it
        _unlink_all(victims)
        self.report = OpenReport(len(self._lru), sum(self._lru.values()), len(self._foreign),
                                 sum(size for _, _, size in self._foreign), tuple(foreign_formats), removed)

    # -- blocks ----------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    def contains(self, key: bytes) -> bool:
        """Whether a block is indexed under ``key`` (its file is checked only by :meth:`get`)."""
        with self._lock:
            return key in self._lru

    __contains__ = contains

    @property
    def blocks(self) -> int:
        return len(self._lru)

    def put(self, key: bytes, data: bytes, until: float = 0.0) -> bool:
        """Store ``data`` under ``key`` (replacing nothing: a key names its content), retained until
        ``until`` (a Unix time; 0: no retention; a block stored already keeps the later of its own and
        this). False when it cannot be stored: larger than the whole store, or the disk refused the
        write (logged)."""
        if not 0 < len(key) < 256:
            raise ValueError("a block key is 1..255 bytes")
        size = _HEADER.size + len(key) + len(data)
        extend = False
        with self._lock:
            known = key in self._lru
            if known:
                self._lru.move_to_end(key)
                extend = until > self._until.get(key, 0.0)
                if extend:
                    self._until[key] = until
            elif size > self.capacity:
                return False
            else:
                victims = self._make_room(size)
                self.used += size  # counted now, so concurrent writers do not overfill
                self._lru[key] = size
                if until:
                    self._until[key] = until
        if known:
            if extend:
                _write_until(self._path(key), until)
            return True
        _unlink_all(victims)
        header = _HEADER.pack(MAGIC, self._fp, len(key), len(data), payload_digest(data), until)
        path = self._path(key)
        tmp = self.root / TMP / f"{uuid.uuid4().hex}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(key)
                f.write(data)
            path.parent.mkdir(exist_ok=True)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("disk tier: could not write a block to %s: %s", path, exc)
            _unlink_all([tmp])
            self._forget(key)
            return False
        with self._lock:
            self.writes += 1
            self.write_bytes += size
        return True

    def retain(self, key: bytes, until: float) -> bool:
        """Keep a stored block at least until ``until`` (a Unix time; a later retention it has
        stays); False when no block is stored under ``key``."""
        with self._lock:
            if key not in self._lru:
                return False
            if until <= self._until.get(key, 0.0):
                return True
            self._until[key] = until
        _write_until(self._path(key), until)
        return True

    def get(self, key: bytes) -> bytes | None:
        """The payload stored under ``key``, or None: absent, or its file failed a check (logged, deleted)."""
        with self._lock:
            if key not in self._lru:
                self.misses += 1
                return None
            self._lru.move_to_end(key)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:  # evicted meanwhile, or deleted by hand
            self._forget(key)
            with self._lock:
                self.misses += 1
            return None
        except OSError as exc:
            return self._bad(key, path, f"unreadable ({exc})")
        problem = self._check(raw, key)
        if problem:
            return self._bad(key, path, problem)
        data = raw[_HEADER.size + len(key):]
        try:
            os.utime(path)  # most recently used: the LRU order survives a restart
        except OSError:
            pass
        with self._lock:
            self.hits += 1
            self.read_bytes += len(raw)
        return data

    def discard(self, key: bytes) -> None:
        path = self._path(key)
        if self._forget(key):
            _unlink_all([path])

    def _check(self, raw: bytes, key: bytes) -> str | None:
        if len(raw) < _HEADER.size:
            return f"truncated: {len(raw)} bytes, shorter than its header"
        magic, fp, key_len, length, digest, _ = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            return "not a musegl KV block (bad magic)"
        if fp != self._fp:
            return "written for another model or KV format"
        if raw[_HEADER.size:_HEADER.size + key_len] != key:
            return "holds another key"
        body = len(raw) - _HEADER.size - key_len
        if body != length:
            return f"truncated: {body} of {length} payload bytes"
        if payload_digest(raw[_HEADER.size + key_len:]) != digest:
            return "corrupt: payload digest mismatch"
        return None

    def _bad(self, key: bytes, path: Path, problem: str) -> None:
        log.warning("disk tier: %s %s; treated as a miss and deleted", path, problem)
        with self._lock:
            self.corrupt += 1
            self.misses += 1
        self.discard(key)
        return None

    def _forget(self, key: bytes) -> bool:
        with self._lock:
            size = self._lru.pop(key, None)
            self._until.pop(key, None)
            if size is None:
                return False
            self.used -= size
            return True

    def _make_room(self, size: int) -> list[Path]:
        """Drop index entries until ``size`` more bytes fit (lock held): other formats' files, then
        this format's blocks without a running retention, then retained ones, least recently used
        first each; the files to delete."""
        victims: list[Path] = []

        def over() -> bool:
            return self.used + size > self.capacity

        while over() and self._foreign:
            _, path, freed = self._foreign.pop()
            victims.append(path)
            self.used -= freed
            self.evicted += 1
        if not over():
            return victims
        now = self.clock()
        for retained in (False, True):
            chosen = []
            need = self.used + size - self.capacity
            for key, freed in self._lru.items():  # least recently used first
                if (self._until.get(key, 0.0) > now) == retained:
                    chosen.append(key)
                    need -= freed
                    if need <= 0:
                        break
            for key in chosen:
                self.used -= self._lru.pop(key)
                self._until.pop(key, None)
                victims.append(self._path(key))
                self.evicted += 1
            if not over():
                break
        return victims

    # -- reporting -------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            return {
                "kv_disk_bytes": self.used,
                "kv_disk_capacity_bytes": self.capacity,
                "kv_disk_blocks": len(self._lru),
                "kv_disk_retained_blocks": sum(1 for until in self._until.values() if until > self.clock()),
                "kv_disk_hits": self.hits,
                "kv_disk_misses": self.misses,
                "kv_disk_written_bytes": self.write_bytes,
                "kv_disk_read_bytes": self.read_bytes,
                "kv_disk_evicted_blocks": self.evicted,
                "kv_disk_corrupt_blocks": self.corrupt,
            }

    def startup_line(self, block_bytes: int | None = None) -> str:
        """The disk tier's part of the start-up report: its size, what it found of this format, and
        of others (never used; evicted first)."""
        r = self.report
        line = f"disk tier {self.root}: {human(self.capacity)}"
        if block_bytes:
            line += f" = {self.capacity // (block_bytes + _HEADER.size + 16):,} blocks of {self.format.block_size} positions"
        if r is None:
            return line
        line += (f"; found {r.blocks:,} block{'s' if r.blocks != 1 else ''} of this model and KV format "
                 f"({human(r.bytes)})")
        if r.foreign_blocks or r.foreign_formats:
            line += (f"; {r.foreign_blocks:,} blocks ({human(r.foreign_bytes)}) of another model or KV format "
                     f"({'; '.join(r.foreign_formats)}): not used, evicted first")
        if r.removed_temporaries:
            line += f"; removed {r.removed_temporaries} unfinished write(s) of a previous worker"
        return line


def block_format(executor, companions: int = 0) -> BlockFormat:
    """The format of ``executor``'s blocks: its ``kv_identity()`` (an optional executor method: the
    weights and how they are computed; :class:`DiskTierError` without it), its KV dtype and
    layout, its block size. ``companions``: sliding pages per block (a block's bytes are then
    its pages')."""
    identity = getattr(executor, "kv_identity", None)
    if not callable(identity):
        raise DiskTierError(f"the {executor.info.backend!r} executor does not state what its K/V bytes depend on "
                            "(the optional kv_identity(), docs/executor.md), so blocks on disk could not be told "
                            "apart by model")
    info = executor.info
    kv_dtype = getattr(executor, "kv_cache_dtype", "auto")
    return BlockFormat(model=f"{info.name}: {identity()}",
                       kv_dtype=f"{kv_dtype} ({info.dtype} activations)",
                       layout=(f"{info.backend}, {info.num_layers} layers, {executor.kv_bytes_per_block()} bytes "
                               f"a block in {1 + companions} page{'s' if companions else ''}"),
                       block_size=executor.block_size)


def open_disk_tier(path: str, capacity: int, fmt: BlockFormat) -> DiskTier:
    """Open the disk tier of ``--kv-offload-dir``/``--kv-offload-disk`` and log what it found (one
    line); :class:`DiskTierError` when it cannot be used (a one-line reason)."""
    store = DiskTier.open(Path(path).expanduser(), capacity, fmt)
    line = store.startup_line()
    free = free_bytes(store.root)
    if free is not None and free + store.used < capacity:
        line += f"; the file system has {human(free)} free, less than --kv-offload-disk leaves to fill"
    log.info("KV %s", line)
    return store


def files_identity(path: str | os.PathLike) -> str:
    """A digest naming a checkpoint's weights as stored: each file's name, size and modification
    time (a directory's files, recursively), not its bytes, which would take minutes to hash for
    the 30B; a file rewritten in place changes its time, so a rewritten checkpoint is another
    model. ``missing:PATH`` when there is no such file."""
    root = Path(path)
    if not root.exists():
        return f"missing:{root}"
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        stat = file.stat()
        name = file.name if file == root else str(file.relative_to(root))
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def check_dir(root: Path) -> None:
    """Refuse a ``--kv-offload-dir`` that is not a writable directory (or cannot be created)."""
    if root.exists():
        if not root.is_dir():
            raise DiskTierError(f"--kv-offload-dir {root} is not a directory")
        if not os.access(root, os.W_OK | os.X_OK):
            raise DiskTierError(f"--kv-offload-dir {root} is not writable")
        return
    parent = root.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise DiskTierError(f"--kv-offload-dir {root} does not exist and {parent} is not writable to create it")


def free_bytes(root: Path) -> int | None:
    """Free bytes on the file system that holds (or would hold) ``root``."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def _read_until(path: Path) -> float:
    """The retention in a block file's header (0 when none, or the header cannot be read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) == _HEADER.size and head[:len(MAGIC)] == MAGIC:
            return _UNTIL.unpack_from(head, _UNTIL_AT)[0]
    except OSError:
        pass
    return 0.0


def _write_until(path: Path, until: float) -> None:
    """Rewrite a block file's retention in place (8 bytes of its header; the payload digest does not
    cover them)."""
    try:
        with open(path, "r+b") as f:
            f.seek(_UNTIL_AT)
            f.write(_UNTIL.pack(until))
    except FileNotFoundError:  # evicted, or still being written (with its own retention)
        pass
    except OSError as exc:
        log.warning("disk tier: could not extend the retention of %s: %s", path, exc)


def _read_format(sub: Path) -> str:
    try:
        fields = json.loads((sub / FORMAT_FILE).read_text())
        return BlockFormat(**fields).describe()
    except (OSError, ValueError, TypeError):
        return f"unknown format {sub.name}"


def _block_files(sub: Path):
    for shard in os.scandir(sub):
        if not shard.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(shard.path):
            if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                yield Path(entry.path), entry.stat()


def _unlink_all(paths) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("disk tier: could not delete %s: %s", path, exc)

