"""Build, choose and load ``weight_kernels.c`` (the stored-weight matrix products) with ctypes.

One C source is built per instruction set (a *kernel path*, see :data:`PATHS`), once
per machine with the system C compiler (``cc -O3 -march=native ...`` plus the path's
flags, through :func:`musegl_core.native.build`: cached per source, flags and compiler).
:func:`load` picks the best path the CPU has (``/proc/cpuinfo``): ``avx512fp16``, then
``avx512``, then ``avx2``; ``$MUSEGL_CPU_KERNELS`` forces one of them, or ``fallback``
(no kernels), and a forced path this CPU cannot run is refused with
:class:`KernelPathError`. Where no path runs (not x86-64, no AVX2, no compiler),
:func:`load` returns None, :func:`unavailable_reason` says why, and the executor
decodes the matrices to float32 (:class:`~musegl_cuda.cpu.stored_matrix.DenseMatrix`).
The kernels split rows over their own small thread pool (pthreads; see the C file),
sized by ``threads`` on the first call; each built library has its own pool.

Q4_K, Q5_K and Q6_K products multiply the integer weight codes by fixed-point integer
activations (``int``, the default); ``$MUSEGL_CPU_KQUANT=float`` builds the kernels that
decode those codes to float32 weights instead (``-DMW_KQUANT_FLOAT``), for comparison.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path

import attrs

from musegl_core import native
from musegl_core.errors import ConfigError

log = logging.getLogger("musegl.cuda")

SOURCE = Path(__file__).with_name("weight_kernels.c")
#: Every build's flags; ``-ffp-contract=off`` keeps the compiler from fusing a multiply and
#: an add the source keeps apart (the kernels' FMAs are explicit), so every kernel of a build
#: rounds the same way (see the C file on rows that do not depend on their batch).
BASE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-pthread")
ENV = "MUSEGL_CPU_KERNELS"
FALLBACK = "fallback"
#: How the k-quant (Q4_K, Q5_K, Q6_K) products compute: ``int`` (integer codes times
#: fixed-point activations, the default) or ``float`` (codes decoded to float32 weights).
KQUANT_ENV = "MUSEGL_CPU_KQUANT"
KQUANT_MODES = ("int", "float")


@attrs.frozen
class KernelPath:
    """One build of the kernels: the CPU flags (``/proc/cpuinfo`` names) it needs, the
    compiler flags that keep wider instruction sets out of it (``-mno-avx512fp16`` only
    where the CPU has AVX512-FP16, so a compiler that predates it need not know the
    option), and the code ``mw_path()`` reports for it."""

    name: str
    cpu_flags: tuple[str, ...]
    code: int
    summary: str
    disable: tuple[tuple[str, str], ...] = ()  # (cpu flag or "", compiler flag that turns it off)

    def compiler_flags(self, cpu: set[str]) -> tuple[str, ...]:
        return BASE_FLAGS + tuple(flag for cpu_flag, flag in self.disable if not cpu_flag or cpu_flag in cpu)


#: Best first: the default is the first one the CPU can run.
PATHS = (
    KernelPath("avx512fp16", ("avx512f", "avx512bw", "avx512_fp16", "f16c", "fma"), 3,
               "AVX-512 + F16C + FMA; prompt rows of f16 matrices in AVX512-FP16 arithmetic"),
    KernelPath("avx512", ("avx512f", "avx512bw", "f16c", "fma"), 2, "AVX-512 + F16C + FMA",
               disable=(("avx512_fp16", "-mno-avx512fp16"),)),
    KernelPath("avx2", ("avx2", "fma", "f16c"), 1, "AVX2 + FMA + F16C",
               disable=(("", "-mno-avx512f"),)),  # every compiler with AVX-512 knows this one
)
PATH_NAMES = tuple(p.name for p in PATHS)


class KernelPathError(ConfigError):
    """``$MUSEGL_CPU_KERNELS`` names no path, or a path this machine cannot run (one line)."""


@attrs.frozen
class Kernels:
    """A loaded build: its :class:`KernelPath` and the ctypes library."""

    path: KernelPath
    lib: ctypes.CDLL
    kquant: str = "int"  # one of KQUANT_MODES (how this build multiplies Q4_K/Q5_K/Q6_K)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def lanes(self) -> int:
        """Float32 values per vector of this build (16 for AVX-512, 8 for AVX2)."""
        return int(self.lib.mw_vector_lanes())

    @property
    def half_gemm(self) -> bool:
        """True where ``mw_gemm_f16`` (AVX512-FP16 prompt products) is built in."""
        return bool(self.lib.mw_has_gemm_f16())


_built: dict[tuple[str, str], Kernels | str] = {}  # (path name, k-quant mode) -> loaded kernels, or why not
_chosen: Kernels | None = None
_reason: str | None = None
_decided = False


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def path_named(name: str) -> KernelPath:
    for p in PATHS:
        if p.name == name:
            return p
    raise KernelPathError(f"{ENV}={name!r}: expected one of {', '.join((*PATH_NAMES, FALLBACK))}")


def missing_for(path: KernelPath) -> list[str]:
    """What this machine lacks to run ``path`` (empty: it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [f"an x86-64 CPU (this is {platform.machine() or 'unknown'})"]
    cpu = cpu_flags()
    if not cpu:
        return ["readable CPU flags (/proc/cpuinfo)"]
    return [f for f in path.cpu_flags if f not in cpu]


def runnable_paths() -> list[str]:
    """The paths this CPU has the instructions for, best first (whether they build is
    :func:`kernels`' business)."""
    return [p.name for p in PATHS if not missing_for(p)]


def kquant_mode() -> str:
    """``$MUSEGL_CPU_KQUANT`` (default ``int``); :class:`KernelPathError` for another value."""
    mode = os.environ.get(KQUANT_ENV, "").strip().lower() or KQUANT_MODES[0]
    if mode not in KQUANT_MODES:
        raise KernelPathError(f"{KQUANT_ENV}={mode!r}: expected one of {', '.join(KQUANT_MODES)}")
    return mode


def kernels(name: str, kquant: str | None = None) -> Kernels:
    """The kernels of path ``name``, built on first use; :class:`KernelPathError` (one line)
    when this machine cannot run or build them. ``kquant``: how they multiply the k-quants
    (default :func:`kquant_mode`)."""
    path = path_named(name)
    missing = missing_for(path)
    if missing:
        raise KernelPathError(f"the {path.name} kernels need {', '.join(missing)}, which this CPU lacks")
    kquant = kquant or kquant_mode()
    if kquant not in KQUANT_MODES:
        raise KernelPathError(f"k-quant products {kquant!r}: expected one of {', '.join(KQUANT_MODES)}")
    cached = _built.get((name, kquant))
    if cached is None:
        cached = _built[(name, kquant)] = _build(path, kquant)
    if isinstance(cached, str):
        raise KernelPathError(cached)
    return cached


def _build(path: KernelPath, kquant: str) -> Kernels | str:
    flags = path.compiler_flags(cpu_flags()) + (("-DMW_KQUANT_FLOAT",) if kquant == "float" else ())
    try:
        lib = ctypes.CDLL(str(native.build(SOURCE, flags, f"the stored-weight kernels ({path.name})")))
    except native.BuildError as exc:
        return str(exc)
    except OSError as exc:
        return f"loading the stored-weight kernels ({path.name}) failed: {exc}"
    lib.mw_path.argtypes = []
    lib.mw_path.restype = ctypes.c_int
    built = int(lib.mw_path())
    if built != path.code:
        names = {p.code: p.name for p in PATHS}
        return (f"the compiler built the {path.name} kernels as {names.get(built, built)!r} "
                f"(it does not know every instruction of {path.summary})")
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
    f32 = ctypes.c_float
    lib.mw_attention.argtypes = [p, i64, i64, i64, p, p, i64, p, p, p, i64, i64, f32, p, i32]
    lib.mw_attention.restype = i32
    lib.mw_vector_lanes.argtypes = []
    lib.mw_vector_lanes.restype = i32
    lib.mw_kquant_int.argtypes = []
    lib.mw_kquant_int.restype = i32
    if bool(lib.mw_kquant_int()) != (kquant == "int"):
        return f"the {path.name} kernels were built with the wrong k-quant products (expected {kquant})"
    return Kernels(path, lib, kquant)


def load() -> Kernels | None:
    """The kernels this process uses, chosen (and built) on first use: ``$MUSEGL_CPU_KERNELS``
    when set, else the best path that runs here; None where none does (the float32
    fallback). A forced path that cannot run raises :class:`KernelPathError`."""
    global _chosen, _reason, _decided
    if _decided:
        return _chosen
    forced = os.environ.get(ENV, "").strip().lower()
    kquant_mode()  # a bad $MUSEGL_CPU_KQUANT raises here, before any path is tried
    if forced == FALLBACK:
        _reason = f"{ENV}={FALLBACK}"
    elif forced:
        _chosen = kernels(forced)  # raises for a path that cannot run here, and stays undecided
        log.info("stored-weight kernels: %s (%s; %s=%s; k-quants in %s)", _chosen.name, _chosen.path.summary, ENV,
                 forced, _chosen.kquant)
    else:
        reasons = []
        for path in PATHS:
            if missing_for(path):
                continue
            try:
                _chosen = kernels(path.name)
                break
            except KernelPathError as exc:
                reasons.append(str(exc))
        if _chosen is not None:
            log.info("stored-weight kernels: %s (%s; k-quants in %s)", _chosen.name, _chosen.path.summary,
                     _chosen.kquant)
        else:
            _reason = "; ".join(reasons) or f"neither AVX2 nor AVX-512 here ({PATHS[-1].name} needs " \
                f"{', '.join(missing_for(PATHS[-1]))})"

    _decided = True
    if _chosen is None:
        log.warning("stored-weight kernels unavailable (%s): matrices are decoded to float32 and multiplied "
                    "by torch in blocks of exactly %d rows (prompt rows) or %d (sampled rows), so a row's "
                    "result does not depend on the rows beside it (slower than the kernels, and twice the "
                    "memory for f16/bf16 weights)", _reason, FALLBACK_ROWS, SAMPLED_ROWS)
    return _chosen


#: The float32 fallback multiplies prompt rows nobody samples in blocks of exactly this
#: many rows, and sampled rows in blocks of exactly SAMPLED_ROWS (see
#: :class:`~musegl_cuda.cpu.stored_matrix.DenseMatrix`).
FALLBACK_ROWS = 16
SAMPLED_ROWS = 2


def selected_path() -> str:
    """The name of the path :func:`load` chose (``fallback`` when none)."""
    chosen = load()
    return FALLBACK if chosen is None else chosen.name


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when the kernels are loaded or not tried yet)."""
    return _reason


def reset() -> None:
    """Forget the choice :func:`load` made (tests that change ``$MUSEGL_CPU_KERNELS``);
    built libraries stay loaded."""
    global _chosen, _reason, _decided
    _chosen, _reason, _decided = None, None, False
