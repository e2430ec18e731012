"""A fixed malloc threshold, so memory for large request bodies goes back to the OS.

glibc serves allocations above its mmap threshold (128 KiB) with ``mmap`` and
returns them on ``free``, but raises the threshold each time such a block is
freed (up to 32 MiB). After the first large body (a 10 MiB prompt, a data-URL
image) every later one of that size comes from the heap, whose top is only
trimmed when it is free, so a server's resident memory ratchets up with the
largest burst of concurrent large requests it has seen. Setting the threshold
explicitly turns that adjustment off. Both processes call :func:`fix_mmap_threshold`
at start; elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("musegl.allocator")

M_MMAP_THRESHOLD = -3  # mallopt parameter numbers from glibc's malloc.h
MMAP_THRESHOLD = 256 * 1024


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes; True when it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    log.debug("malloc mmap threshold %s at %d bytes", "fixed" if done else "not fixed", threshold)
    return done


def release_free_heap() -> bool:
    """Give the free pages inside glibc's heap back to the system (``malloc_trim(0)``);
    True when glibc did. Loading weights frees many short-lived buffers below the mmap
    threshold (per-matrix conversions) between the long-lived small ones, and the heap
    keeps those holes resident: on a small GGUF Q6_K file loaded into MLX they were half
    again the weights' bytes. Elsewhere (macOS, musl) it does nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False  # not glibc
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
