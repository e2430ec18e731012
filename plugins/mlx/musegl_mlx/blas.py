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
It then runs one product and checks that the shim saw it. Where any of this is
not possible (not Linux, no wheel, no compiler, MLX already imported,
``MUSEGL_MLX_BLAS=reference``) MLX keeps its own BLAS and :func:`status` says
why. MLX's bfloat16/float16 CPU products do not go through BLAS at all, which
is why the executor computes in float32 on the CPU when the routing is on
(``musegl_mlx.executor.resolve_dtype``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import sys
from pathlib import Path

import attrs

from musegl_core import native

log = logging.getLogger("musegl.mlx")

SHIM_SOURCE = Path(__file__).with_name("cblas_shim.c")
#: ``reference`` keeps MLX's own BLAS (for comparisons); anything else routes where possible.
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
        shim_path = native.build(SHIM_SOURCE, ("-O2",), "the MLX BLAS shim")
        openblas = ctypes.CDLL(str(openblas_path), mode=ctypes.RTLD_GLOBAL)
        shim = ctypes.CDLL(str(shim_path), mode=ctypes.RTLD_GLOBAL)
    except native.BuildError as exc:
        return BlasStatus(False, reason=str(exc))
    except OSError as exc:
        return BlasStatus(False, reason=f"loading OpenBLAS or the shim failed: {exc}")
    shim.musegl_blas_route(ctypes.cast(openblas.scipy_cblas_sgemm, ctypes.c_void_p))
    shim.musegl_blas_calls.restype = ctypes.c_long

    try:
        import mlx.core as mx

        a = mx.ones((8, 8), dtype=mx.float32, stream=mx.cpu)
        mx.eval(mx.matmul(a, a, stream=mx.cpu))
    except Exception as exc:  # no usable MLX: the plugin reports that on its own
        return BlasStatus(False, reason=f"MLX cannot run ({type(exc).__name__}: {exc})")
    if shim.musegl_blas_calls() == 0:
        return BlasStatus(False, reason="MLX did not call the routed cblas_sgemm (its BLAS is bound elsewhere)")
    return BlasStatus(True, library=openblas_path.name)


def routed() -> bool:
    """True when MLX's float32 CPU products run on OpenBLAS (routes first if not done)."""
    return route().routed
