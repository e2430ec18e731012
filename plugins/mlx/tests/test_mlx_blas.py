"""MLX's float32 CPU products routed to OpenBLAS (``musegl_mlx.blas``, Linux only)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from musegl_mlx import blas
from musegl_mlx.executor import resolve_dtype

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the routing exists for MLX's Linux CPU build")


def status_in_subprocess(code: str, **env: str) -> str:
    """``repr(blas.route())`` in a fresh interpreter after running ``code``."""
    script = f"{code}\nfrom musegl_mlx import blas\nprint(blas.route())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=True)
    return done.stdout.strip()


@linux
def test_float32_products_go_through_openblas():
    """Routed; or, where OpenBLAS is not batch-invariant on this CPU, still through the shim,
    which then forwards to MLX's own BLAS (and says why)."""
    status = blas.route()
    assert status.routed or "not batch-invariant" in status.reason, status.reason
    import ctypes

    import mlx.core as mx

    from musegl_core import native

    shim = ctypes.CDLL(str(native.build(blas.SHIM_SOURCE, blas.SHIM_FLAGS, "the MLX BLAS shim")))
    shim.musegl_blas_calls.restype = ctypes.c_long
    before = shim.musegl_blas_calls()
    a = mx.ones((16, 32), dtype=mx.float32, stream=mx.cpu)
    mx.eval(mx.matmul(a, a.T, stream=mx.cpu))
    assert shim.musegl_blas_calls() > before


@linux
@pytest.mark.parametrize(("n", "k"), [(512, 64), (64, 64), (17, 33), (100, 128), (1000, 128), (256, 1024)])
def test_a_row_is_the_same_whatever_the_rows_beside_it(n, k):
    """OpenBLAS's one-row and small-matrix paths round differently from its general
    kernel; the shim pads small products so a row's result never depends on the
    row count (the same seeded request alone and after a prefix-cache hit, or batched)."""
    import mlx.core as mx

    rng = np.random.default_rng(n * 1000 + k)
    w = mx.array(rng.standard_normal((n, k), dtype=np.float32))
    x = mx.array(rng.standard_normal((300, k), dtype=np.float32))
    reference = np.array((x @ w.T)[0])
    for rows in (1, 2, 3, 5, 12, 18, 70):
        assert np.array_equal(np.array((x[:rows] @ w.T)[0]), reference), rows
    # the transposed-A layout (x stored k x rows) takes the same padding
    xt = mx.contiguous(x.T)
    for rows in (1, 3, 18):
        assert np.array_equal(np.array((xt[:, :rows].T @ w.T)[0]), reference), rows


@linux
def test_default_dtype_is_float32_on_the_routed_cpu():
    import mlx.core as mx

    assert mx.default_device().type == mx.DeviceType.cpu
    assert resolve_dtype(None) == (mx.float32 if blas.routed() else mx.bfloat16)
    assert resolve_dtype("bfloat16") == mx.bfloat16


@linux
def test_batch_variance_check():
    """The check passes MLX's reference BLAS (a plain loop: a row's sum never depends on its
    neighbours) and catches a BLAS whose results depend on the columns beside a row."""
    import ctypes

    reference = blas._reference_sgemm()
    assert reference is not None
    fn = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                          ctypes.c_float, ctypes.c_void_p, ctypes.c_int)
    exact = fn(reference.value)
    assert blas.batch_variance(exact) is None

    def wobbly(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        exact(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
        if n % 2:  # an odd column count nudges every result by one unit in the last place
            out = np.ctypeslib.as_array(ctypes.cast(c, ctypes.POINTER(ctypes.c_float)), shape=(m * ldc,))
            out[:] = np.nextafter(out, np.float32(np.inf))

    assert "columns" in blas.batch_variance(wobbly)


@linux
def test_routing_can_be_forced():
    assert "routed=True" in status_in_subprocess("", MUSEGL_MLX_BLAS="openblas")


@linux
def test_opt_out_and_late_routing_say_why():
    assert "MUSEGL_MLX_BLAS=reference" in status_in_subprocess("", MUSEGL_MLX_BLAS="reference")
    assert "imported before" in status_in_subprocess("import mlx.core")
