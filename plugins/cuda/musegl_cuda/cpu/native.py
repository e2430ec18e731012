"""Build and load ``weight_kernels.c`` (the stored-weight matrix products) with ctypes.

The C file is compiled once per machine with the system C compiler
(``cc -O3 -march=native -pthread``, through :func:`musegl_core.native.build`: cached
per source, flags and compiler). The kernels split rows over their own small thread pool (pthreads; see
the C file), sized by ``threads`` on the first call.
:func:`load` returns None, with :func:`unavailable_reason` saying why, on a
machine without a C compiler or without AVX-512 (F, BW, F16C, FMA): the executor
then decodes the matrices to float32 at load.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from musegl_core import native

SOURCE = Path(__file__).with_name("weight_kernels.c")
FLAGS = ("-O3", "-march=native", "-pthread")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "f16c", "fma")

_lib: ctypes.CDLL | None = None
_reason: str | None = None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def load() -> ctypes.CDLL | None:
    """The kernels library, built on first use; None where it cannot run here."""
    global _lib, _reason
    if _lib is not None or _reason is not None:
        return _lib
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        _reason = f"the CPU lacks {', '.join(missing)}"
        return None
    try:
        lib = ctypes.CDLL(str(native.build(SOURCE, FLAGS, "the stored-weight kernels")))
    except native.BuildError as exc:
        _reason = str(exc)
        return None
    except OSError as exc:
        _reason = f"loading the stored-weight kernels failed: {exc}"
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.mw_matmul.argtypes = [i32, p, i64, i64, p, i64, i64, p, i64, i32]
    lib.mw_matmul.restype = None
    lib.mw_dequant_rows.argtypes = [i32, p, i64, p, i64, p, i32]
    lib.mw_dequant_rows.restype = None
    lib.mw_row_bytes.argtypes = [i32, i64]
    lib.mw_row_bytes.restype = i64
    lib.mw_has_gemm_f16.argtypes = []
    lib.mw_has_gemm_f16.restype = i32
    lib.mw_gemm_f16.argtypes = [p, i64, i64, p, i64, i64, p, i64, p, i32]
    lib.mw_gemm_f16.restype = i32
    _lib = lib
    return lib


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when the kernels are loaded or not tried yet)."""
    return _reason
