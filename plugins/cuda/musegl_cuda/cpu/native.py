"""Build and load ``weight_kernels.c`` (the stored-weight matrix products) with ctypes.

The C file is compiled once per machine with the system C compiler
(``cc -O3 -march=native -pthread``) into the musegl cache (``$MUSEGL_CACHE_DIR``,
default the user cache dir)/kernels, named by a hash of the source and the compiler
flags. The kernels split rows over their own small thread pool (pthreads; see
the C file), sized by ``threads`` on the first call.
:func:`load` returns None, with :func:`unavailable_reason` saying why, on a
machine without a C compiler or without AVX-512 (F, BW, F16C, FMA): the executor
then decodes the matrices to float32 at load.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("weight_kernels.c")
FLAGS = ("-O3", "-march=native", "-pthread", "-shared", "-fPIC")
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


def cache_dir() -> Path:
    from musegl_core.tiny import _cache_root  # the cache the tiny checkpoints use

    return _cache_root() / "kernels"


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(out), str(SOURCE)], check=True,
                       capture_output=True, text=True)
        os.replace(out, target)  # atomic: concurrent builders each publish a whole file


def load() -> ctypes.CDLL | None:
    """The kernels library, built on first use; None where it cannot run here."""
    global _lib, _reason
    if _lib is not None or _reason is not None:
        return _lib
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if missing:
        _reason = f"the CPU lacks {', '.join(missing)}"
        return None
    if compiler is None:
        _reason = "no C compiler (cc/gcc) to build the stored-weight kernels"
        return None
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        _reason = f"the kernel source {SOURCE.name} is not installed ({exc.strerror})"
        return None
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + compiler.encode()).hexdigest()[:16]
    target = cache_dir() / f"weight_kernels-{key}.so"
    try:
        if not target.exists():
            _compile(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        _reason = f"building the stored-weight kernels failed: {detail.strip().splitlines()[-1] if detail.strip() else exc}"
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.mw_matmul.argtypes = [i32, p, i64, i64, p, i64, i64, p, i64, i32]
    lib.mw_matmul.restype = None
    lib.mw_dequant_rows.argtypes = [i32, p, i64, p, i64, p, i32]
    lib.mw_dequant_rows.restype = None
    lib.mw_row_bytes.argtypes = [i32, i64]
    lib.mw_row_bytes.restype = i64
    _lib = lib
    return lib


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when the kernels are loaded or not tried yet)."""
    return _reason
