"""MLX's CPU build on Linux, with an optimized BLAS under its float32 products.

The ``mlx-cpu`` wheel links the netlib *reference* BLAS: its ``sgemm`` is a
plain loop, so a float32 product runs at a few GFLOP/s and costs about
linearly in its rows (measured on 2 cores, a 50512 x 1024 float32 product:
36 ms for 1 row, 143 ms for 4, 575 ms for 16). Routed to OpenBLAS the same
products take 17, 17 and 19 ms, and a 512-row prefill product runs at
~260 GFLOP/s. The shim also keeps a row's result independent of how many rows
share its product (see ``cblas_shim.c``).

:func:`route` does the routing, once per process and before ``mlx.core`` is
imported (MLX binds ``cblas_sgemm`` when it is loaded; routing later has no
effect): it loads OpenBLAS from the ``scipy-openblas32`` wheel and a small shim
(``cblas_shim.c``, built at first use with the system C compiler) with
``RTLD_GLOBAL``, so MLX's ``cblas_sgemm`` is the shim's, which calls OpenBLAS.
It then runs one product and checks that the shim saw it, and checks that
OpenBLAS is *batch-invariant* on this CPU (:func:`batch_variance`: a row's
result does not change with the rows, columns or zero-padded depth beside it,
which seeded sampling alone and batched relies on); where it is not (seen with
OpenBLAS's Haswell kernels on an AMD EPYC: columns), the shim forwards to MLX's
own reference BLAS instead (``MUSEGL_MLX_BLAS=openblas`` routes anyway). Where
any of this is not possible (not Linux, no wheel, no compiler, MLX already
imported, ``MUSEGL_MLX_BLAS=reference``) MLX keeps its own BLAS and
:func:`route` says why. MLX's bfloat16/float16 CPU products do not go through BLAS at all, which
is why the executor computes in float32 on the CPU when the routing is on
(``musegl_mlx.precision``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

import attrs

from musegl_core import native

log = logging.getLogger("musegl.mlx")

SHIM_SOURCE = Path(__file__).with_name("cblas_shim.c")
SHIM_FLAGS = ("-O2", "-pthread")
#: ``reference`` keeps MLX's own BLAS (for comparisons); ``openblas`` routes even where OpenBLAS
#: is not batch-invariant on this CPU; anything else routes where possible.
ENV = "MUSEGL_MLX_BLAS"


@attrs.frozen
class BlasStatus:
    """What :func:`route` did: ``routed`` True when MLX's float32 products run on
    ``library``; otherwise ``reason`` says why not (one line)."""

    routed: bool
    library: str | None = None
    reason: str | None = None


def _openblas() -> Path:
    try:
        wheel = importlib.import_module("scipy_openblas32")
    except ImportError as exc:
        raise native.BuildError("the scipy-openblas32 wheel is not installed (pip install scipy-openblas32)") from exc
    found = sorted((Path(wheel.__file__).parent / "lib").glob("libscipy_openblas*.so*"))
    if not found:
        raise native.BuildError("the scipy-openblas32 wheel has no libscipy_openblas library")
    return found[0]


@functools.cache
def route() -> BlasStatus:
    """Route MLX's ``cblas_sgemm`` to OpenBLAS (see the module docstring); call it
    before the first ``import mlx.core``. Cached: the first call decides."""
    if not sys.platform.startswith("linux"):
        return BlasStatus(False, reason="MLX uses the platform's BLAS here (Accelerate on macOS)")
    if os.environ.get(ENV, "").lower() == "reference":
        return BlasStatus(False, reason=f"{ENV}=reference")
    if "mlx.core" in sys.modules:
        return BlasStatus(False, reason="mlx.core was imported before musegl could route its BLAS")
    try:
        openblas_path = _openblas()
        shim_path = native.build(SHIM_SOURCE, SHIM_FLAGS, "the MLX BLAS shim")
        openblas = ctypes.CDLL(str(openblas_path), mode=ctypes.RTLD_GLOBAL)
        shim = ctypes.CDLL(str(shim_path), mode=ctypes.RTLD_GLOBAL)
    except native.BuildError as exc:
        return BlasStatus(False, reason=str(exc))
    except OSError as exc:
        return BlasStatus(False, reason=f"loading OpenBLAS or the shim failed: {exc}")
    # OpenBLAS's own threads would split a product along M or N by its shape (a row's result would
    # then depend on its batch); it runs single-threaded and the shim splits columns itself
    threads = max(1, int(openblas.scipy_openblas_get_num_threads()))
    openblas.scipy_openblas_set_num_threads(1)
    shim.musegl_blas_route(ctypes.cast(openblas.scipy_cblas_sgemm, ctypes.c_void_p), ctypes.c_int(threads),
                           ctypes.c_int(1))
    shim.musegl_blas_calls.restype = ctypes.c_long
    try:
        import mlx.core as mx

        a = mx.ones((8, 8), dtype=mx.float32, stream=mx.cpu)
        mx.eval(mx.matmul(a, a, stream=mx.cpu))
    except Exception as exc:  # no usable MLX: the plugin reports that on its own
        return BlasStatus(False, reason=f"MLX cannot run ({type(exc).__name__}: {exc})")
    if shim.musegl_blas_calls() == 0:
        return BlasStatus(False, reason="MLX did not call the routed cblas_sgemm (its BLAS is bound elsewhere)")
    variance = batch_variance(shim.cblas_sgemm)
    if variance is not None and os.environ.get(ENV, "").lower() != "openblas":
        # MLX binds to the shim whatever happens now: the shim forwards to MLX's own BLAS instead
        reference = _reference_sgemm()
        if reference is not None:
            shim.musegl_blas_route(reference, ctypes.c_int(1), ctypes.c_int(0))
            return BlasStatus(False, reason=f"OpenBLAS on this CPU is not batch-invariant ({variance}); MLX keeps "
                                            f"its reference BLAS (set {ENV}=openblas to route anyway)")
        log.warning("OpenBLAS on this CPU is not batch-invariant (%s) and MLX's own BLAS was not found: "
                    "routed anyway; a seeded request can sample differently alone and batched", variance)
    return BlasStatus(True, library=openblas_path.name)


def _reference_sgemm() -> ctypes.c_void_p | None:
    """``cblas_sgemm`` of the BLAS library the mlx-cpu wheel ships (loaded privately), if found."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = sorted(Path(next(iter(spec.submodule_search_locations))).parent.glob("mlx_cpu.libs/libblas*.so*"))
    for path in libs:
        try:
            return ctypes.cast(ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL).cblas_sgemm, ctypes.c_void_p)
        except (OSError, AttributeError):
            continue
    return None


def batch_variance(sgemm) -> str | None:
    """None when a row's result through ``sgemm`` (a ``cblas_sgemm``) is the same whatever
    shares its product: other rows, other columns (keys of longer sequences in a padded
    attention product) or a zero-padded depth (their zero probabilities); otherwise what
    changed it. Measured on a few small shapes, in a few milliseconds."""
    import numpy as np

    def product(x: np.ndarray, w: np.ndarray) -> np.ndarray:  # x @ w.T, row-major
        x, w = np.ascontiguousarray(x), np.ascontiguousarray(w)
        m, k = x.shape
        n = w.shape[0]
        out = np.zeros((m, n), dtype=np.float32)
        fp = ctypes.POINTER(ctypes.c_float)
        sgemm(101, 111, 112, m, n, k, ctypes.c_float(1.0), x.ctypes.data_as(fp), k, w.ctypes.data_as(fp), k,
              ctypes.c_float(0.0), out.ctypes.data_as(fp), n)
        return out

    rng = np.random.default_rng(0)
    for n, k in ((100, 128), (1000, 128), (40, 64), (300, 16), (64, 256)):
        x = rng.standard_normal((300, k), dtype=np.float32)
        w = rng.standard_normal((n + 40, k), dtype=np.float32)
        ref = product(x, w[:n])[0]
        for m in (1, 2, 5, 17, 64):
            if not np.array_equal(product(x[:m], w[:n])[0], ref):
                return f"a row's result changed with {m} rows instead of 300 (n={n}, k={k})"
        for extra in (1, 17, 40):
            if not np.array_equal(product(x[:1], w[:n + extra])[0, :n], ref):
                return f"a row's result changed with {n + extra} columns instead of {n} (k={k})"
        for pad in (3, 32):
            xp = np.concatenate([x[:1], np.zeros((1, pad), np.float32)], axis=1)
            wp = np.concatenate([w[:n], rng.standard_normal((n, pad), dtype=np.float32)], axis=1)
            if not np.array_equal(product(xp, wp)[0], ref):
                return f"a row's result changed with a depth of {k + pad} zero-padded from {k} (n={n})"
    return None


def routed() -> bool:
    """True when MLX's float32 CPU products run on OpenBLAS (routes first if not done)."""
    return route().routed
