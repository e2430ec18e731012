"""Loaded by every Python process started with this folder on ``PYTHONPATH`` (benchmarks/memtrace.py).

On ``SIGUSR2`` the process writes, under ``$MUSEGL_MEMTRACE_DIR``, ``<pid>-<n>.pickle``: the live
objects counted by type after a full ``gc.collect()`` and the lengths of the large containers; under
``malloc``, glibc's bytes in use and free (``mallinfo2``), pymalloc's arenas, the resident bytes
(and with ``$MUSEGL_MEMTRACE_TRIM``, the resident bytes again after ``malloc_trim(0)``); and a
``tracemalloc`` snapshot when tracing (``PYTHONTRACEMALLOC``). No endpoint and no server code is involved: the signal handler runs
in the main thread between two bytecodes."""

import os
import signal

_DIR = os.environ.get("MUSEGL_MEMTRACE_DIR")


def _dump(signum, frame) -> None:  # pragma: no cover - runs inside the traced server
    import collections
    import gc
    import pickle
    import tracemalloc

    gc.collect()
    counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    # the sizes of the large containers: a dict or list that keeps growing shows here by its length
    sizes = collections.Counter()
    for o in gc.get_objects():
        if isinstance(o, (dict, list, set, collections.deque, collections.OrderedDict)) and len(o) >= 500:
            first = next(iter(o), None)
            sizes[f"{type(o).__qualname__}#{id(o)} first={first!r:.100}"] = len(o)
    snapshot = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
    malloc = {**_mallinfo(), **_pymalloc(), **_smaps()}
    if os.environ.get("MUSEGL_MEMTRACE_TRIM"):  # how much of the RSS malloc_trim gives back
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        malloc["rss_trimmed"] = _smaps().get("rss", 0)
    n = len([f for f in os.listdir(_DIR) if f.startswith(f"{os.getpid()}-") and f.endswith(".pickle")])
    path = os.path.join(_DIR, f"{os.getpid()}-{n}.pickle")
    with open(path + ".part", "wb") as out:
        pickle.dump({"counts": counts, "sizes": sizes, "snapshot": snapshot, "malloc": malloc}, out)
    os.replace(path + ".part", path)  # whole, or not there


def _mallinfo() -> dict:
    """glibc's ``mallinfo2``: bytes in use (arenas and mmapped blocks) and free bytes the arenas keep."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Info
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"in_use": info.uordblks + info.hblkhd, "mmapped": info.hblkhd, "arena_free": info.fordblks}


def _pymalloc() -> dict:
    """Bytes in pymalloc's arenas (mapped directly, outside malloc): ``sys._debugmallocstats``."""
    import re
    import sys
    import tempfile

    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    arenas = re.search(r"# arenas allocated current\s*=\s*([\d,]+)", text)
    used = re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", text)
    if not arenas:
        return {}
    return {"pymalloc_arenas": int(arenas.group(1).replace(",", "")) * (1 << 20),
            "pymalloc_used": int(used.group(1).replace(",", "")) if used else 0}


def _smaps() -> dict:
    """Resident bytes, anonymous and file-backed (``/proc/self/smaps_rollup``)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line and not line.startswith("0"))
    except OSError:
        return {}
    kib = {k: int(v.split()[0]) * 1024 for k, v in fields.items() if v.strip().endswith("kB")}
    return {"rss": kib.get("Rss", 0), "anonymous": kib.get("Anonymous", 0), "file": kib.get("Pss_File", 0)}


if _DIR:
    signal.signal(signal.SIGUSR2, _dump)
