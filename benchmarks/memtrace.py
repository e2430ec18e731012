"""Memory figures from inside a running server, without an endpoint: :func:`enable` (before the
server starts) puts ``benchmarks/memtrace_site`` on ``PYTHONPATH``, whose ``sitecustomize`` makes
every Python process of the server dump, on ``SIGUSR2``, its live object counts, malloc's bytes in
use, pymalloc's arenas and its resident bytes (and a ``tracemalloc`` snapshot when tracing);
:func:`dump` signals the processes and reads what they wrote (benchmarks/soak.py,
benchmarks/memory_growth.py)."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

SITE = Path(__file__).parent / "memtrace_site"


def enable(folder: Path, *, frames: int = 0, trim: bool = False) -> None:
    """Set this process's environment so that a server started from it dumps into ``folder``
    (``frames``: ``tracemalloc`` frames per allocation, 0 for no tracing; ``trim``: after each
    dump, ``malloc_trim(0)`` and the resident bytes read again)."""
    os.environ["MUSEGL_MEMTRACE_DIR"] = str(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))
    if trim:
        os.environ["MUSEGL_MEMTRACE_TRIM"] = "1"
    if frames:
        os.environ["PYTHONTRACEMALLOC"] = str(frames)


def dump(procs: dict, folder: Path) -> dict:
    """Signal each process to dump; wait for its file; return {name: loaded dump}."""
    before = {name: len(list(folder.glob(f"{p.pid}-*.pickle"))) for name, p in procs.items()}
    for p in procs.values():
        os.kill(p.pid, signal.SIGUSR2)
    out = {}
    deadline = time.monotonic() + 300
    for name, p in procs.items():
        path = folder / f"{p.pid}-{before[name]}.pickle"
        while not path.exists():  # written under another name, then renamed
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} wrote no snapshot")
            time.sleep(0.2)
        with open(path, "rb") as f:
            out[name] = pickle.load(f)
    return out


def live_mib(found: dict) -> float:
    """The memory a process uses, MiB: malloc's bytes in use (arenas and mapped blocks) and the bytes
    in pymalloc's allocated blocks (its arenas are mapped outside malloc). Neither the free space
    malloc keeps nor pymalloc's partly used arenas count (the RSS counts both)."""
    malloc = found.get("malloc", {})
    return round((malloc.get("in_use", 0) + malloc.get("pymalloc_used", 0)) / 2**20, 1)
