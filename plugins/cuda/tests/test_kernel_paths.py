"""The stored-weight kernel paths (avx512fp16, avx512, avx2) and the float32 fallback:
each path this CPU can run against a float64 reference, rows bit for bit independent of
the rows beside them, the run-time choice and its override (``MUSEGL_CPU_KERNELS``)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from musegl_cuda.cpu import fixed_blocks, native
from musegl_cuda.cpu.stored_matrix import DenseMatrix, HalfRows, StoredMatrix, stored_matrix
from stored_weights_support import stored_weight

DTYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"]
LANES = {"avx512fp16": 16, "avx512": 16, "avx2": 8}
AVX512_FLAGS = {"avx512f", "avx512bw", "avx512_fp16"}


@pytest.fixture(autouse=True)
def fresh_choice():
    """Every test starts and ends with no kernel path chosen yet."""
    native.reset()
    yield
    native.reset()


def path_kernels(name: str) -> native.Kernels:
    try:
        return native.kernels(name)
    except native.KernelPathError as exc:
        pytest.skip(f"{name} kernels do not run here: {exc}")


def assert_float32_accuracy(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``y`` is ``x @ w^T`` to float32 rounding: each output within 1e-5 of its natural
    size ``sqrt(x² @ w²ᵀ)`` of the float64 product (1e-6 on average)."""
    exact = x.double() @ w.double().T
    scale = (x.double().pow(2) @ w.double().pow(2).T).sqrt()
    error = (y.double() - exact).abs() / scale
    assert error.max() < 1e-5 and error.mean() < 1e-6, (float(error.max()), float(error.mean()))


def assert_rows_ignore_their_batch(matmul, x: torch.Tensor) -> None:
    """Row r of any product of consecutive rows equals the 1-row product of row r, bit for bit."""
    singles = torch.cat([matmul(x[i:i + 1]) for i in range(x.shape[0])])
    for lo, hi in ((0, 2), (0, 3), (0, 4), (0, 5), (0, 8), (0, 9), (0, 16), (0, 32), (0, 33), (0, 64),
                   (0, x.shape[0]), (37, x.shape[0]), (3, 12), (5, 6)):
        got = matmul(x[lo:hi])
        assert torch.equal(got, singles[lo:hi]), f"rows {lo}:{hi} differ from their 1-row products"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", native.PATH_NAMES)
def test_path_products_are_accurate_and_rows_ignore_their_batch(path, dtype):
    """42 weight rows (whole register tiles and two left over), 70 activation rows (the
    decode kernels up to 32, the wide products above): float32 accuracy against float64,
    and every row the same bits in a product of 1 to 70 rows."""
    kernels = path_kernels(path)
    assert kernels.lib.mw_path() == kernels.path.code and kernels.lib.mw_vector_lanes() == LANES[path]
    stored = stored_weight(dtype, 42, 512)
    matrix = StoredMatrix.from_stored(stored, kernels)
    assert matrix.kernels is kernels
    w = torch.from_numpy(stored.to_float32())
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(1))
    assert_float32_accuracy(matrix.matmul(x), x, w)
    assert_rows_ignore_their_batch(matrix.matmul, x)
    assert torch.equal(matrix.dequantize(), w)


def path_kernels_kquant(name: str, kquant: str) -> native.Kernels:
    try:
        return native.kernels(name, kquant)
    except native.KernelPathError as exc:
        pytest.skip(f"{name} kernels do not run here: {exc}")


@pytest.mark.parametrize("kquant", native.KQUANT_MODES)
@pytest.mark.parametrize("dtype", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("path", native.PATH_NAMES)
def test_k_quant_decode_tiles_give_the_wide_products_bits(path, dtype, kquant):
    """Both k-quant products give every row the same bits at every row count, over several
    super-blocks of random codes and scale bytes (every 6-bit scale/min packing), whole 4-row
    tiles and 3 rows left over. Float kernels: the decode tiles (up to 8 activation rows)
    decode several sub-blocks at once (Q6_K halves, Q4_K pairs, looked up by vpermps on
    AVX-512) while the wide products (more rows) decode 32 values at a time into a float32
    scratch, all gguf-py's floats. Integer products: 1 to 8 rows in 1-row and 4-row weight
    tiles, 24 rows in 4 x TILE_MR tiles, one order of float operations per super-block."""
    kernels = path_kernels_kquant(path, kquant)
    assert kernels.kquant == kquant and kernels.lib.mw_kquant_int() == (kquant == "int")
    stored = stored_weight(dtype, 43, 1024, seed=5)
    matrix = StoredMatrix.from_stored(stored, kernels)
    w = torch.from_numpy(stored.to_float32())
    assert torch.equal(matrix.dequantize(), w)
    x = torch.randn(24, 1024, generator=torch.Generator().manual_seed(6))
    wide = matrix.matmul(x)  # 24 rows: the scratch path
    assert_float32_accuracy(wide, x, w)
    for lo, hi in ((0, 1), (1, 3), (3, 7), (7, 15), (15, 16)):  # 1, 2, 4, 8 and 1 rows: the decode tiles
        assert torch.equal(matrix.matmul(x[lo:hi]), wide[lo:hi]), (lo, hi)


def relative_errors(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    exact = x.double() @ w.double().T
    return (y.double() - exact).abs() / (x.double().pow(2) @ w.double().pow(2).T).sqrt()


@pytest.mark.parametrize("dtype", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("path", native.PATH_NAMES)
def test_k_quant_integer_products_are_as_accurate_as_the_float_kernels(path, dtype):
    """The integer products (activations in 2 x int16 fixed point per 256 values, error
    below 2^-29 of a block's largest |x|) against float64, with outliers 100x the other
    activations in some blocks: each output's error relative to its natural size is of
    float32's order and on average below the float kernels' (measured: about half)."""
    int_kernels, float_kernels = path_kernels_kquant(path, "int"), path_kernels_kquant(path, "float")
    stored = stored_weight(dtype, 64, 2048, seed=8)
    w = torch.from_numpy(stored.to_float32())
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 2048, generator=g) * torch.where(torch.rand(6, 2048, generator=g) < 0.01, 100.0, 1.0)
    errors = {}
    for kernels in (int_kernels, float_kernels):
        errors[kernels.kquant] = relative_errors(StoredMatrix.from_stored(stored, kernels).matmul(x), x, w)
    assert errors["int"].max() < 2e-6 and errors["int"].mean() < errors["float"].mean(), \
        {mode: (float(e.max()), float(e.mean())) for mode, e in errors.items()}


def q6_k_blocks(scales: list[int], n: int) -> np.ndarray:
    """n rows of one Q6_K super-block: every code 0 (q - 32 = -32), the given 16 int8 scales, d = 1."""
    block = np.zeros(210, np.uint8)
    block[192:208] = np.array(scales, np.int8).view(np.uint8)
    block[208:210] = np.array([1.0], np.float16).view(np.uint8)
    return np.tile(block, (n, 1))


@pytest.mark.parametrize("path", native.PATH_NAMES)
def test_k_quant_integer_sums_hold_their_extremes(path):
    """The integer lane sums at their bounds (weights (q - 32) * scale = -32 * -128 = 4096 or
    -32 * 127 = -4064, activations whose limbs are H = +-(2^14 - 1) or L = -2^14, +2^14 - 1;
    one value 2^29 - 2^15 makes the block's scale 1, so X = x) give the float64 product to
    float32 rounding: no int32 lane wraps (AVX2's 32 products a lane reach -2^31)."""
    from musegl_core.checkpoint.stored import StoredTensor

    kernels = path_kernels_kquant(path, "int")
    top = float((1 << 29) - (1 << 15))
    rows = []
    for value in (-16384.0, 16383.0, top, -top):
        row = torch.full((256,), value)
        row[255] = top
        rows.append(row)
    x = torch.stack(rows)
    for scale in (-128, 127):
        stored = StoredTensor("w", "q6_k", (4, 256), q6_k_blocks([scale] * 16, 4))
        w = torch.from_numpy(stored.to_float32())
        y = StoredMatrix.from_stored(stored, kernels).matmul(x)
        assert relative_errors(y, x, w).max() < 1e-6, (scale, y[:, 0], (x.double() @ w.double().T)[:, 0])


@pytest.mark.parametrize("dtype", ["q4_k", "q6_k"])
@pytest.mark.parametrize("path", native.PATH_NAMES)
def test_k_quant_integer_products_of_zero_and_non_finite_rows(path, dtype):
    """An all-zero activation row gives zeros; a row with an infinity or NaN gives NaN in
    every output (its blocks have no fixed-point scale) and leaves the other rows' bits alone."""
    kernels = path_kernels_kquant(path, "int")
    matrix = StoredMatrix.from_stored(stored_weight(dtype, 12, 512), kernels)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(4))
    x[1] = 0.0
    x[2, 300] = float("inf")
    x[3, 7] = float("nan")
    y = matrix.matmul(x)
    assert torch.equal(y[1], torch.zeros(12))
    assert torch.isnan(y[2]).all() and torch.isnan(y[3]).all()
    assert torch.equal(y[0], matrix.matmul(x[:1])[0])


def test_k_quant_mode_is_int_by_default_and_float_on_request(monkeypatch):
    """``$MUSEGL_CPU_KQUANT``: unset, the integer products; ``float`` builds the float kernels;
    another value is refused (by the kernels' choice and by the pre-serve check)."""
    from musegl_core.errors import ConfigError
    from musegl_core.plugins.specs import ExecutorOptions
    from musegl_cuda import plugin

    if not native.runnable_paths():
        pytest.skip("no kernel path runs here")
    monkeypatch.delenv(native.KQUANT_ENV, raising=False)
    chosen = native.load()
    if chosen is None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    assert chosen.kquant == "int" and chosen.lib.mw_kquant_int() == 1
    native.reset()
    monkeypatch.setenv(native.KQUANT_ENV, "float")
    chosen = native.load()
    assert chosen.kquant == "float" and chosen.lib.mw_kquant_int() == 0
    native.reset()
    monkeypatch.setenv(native.KQUANT_ENV, "int8")
    with pytest.raises(native.KernelPathError, match="MUSEGL_CPU_KQUANT='int8': expected one of int, float"):
        native.load()
    spec = {s.name: s for s in plugin.musegl_executors()}["torch-cpu"]
    with pytest.raises(ConfigError, match="MUSEGL_CPU_KQUANT"):
        spec.check(ExecutorOptions(model="missing.gguf"))


@pytest.mark.parametrize("path", native.PATH_NAMES)
def test_other_gguf_types_run_the_f32_kernels(path, monkeypatch):
    """A type without its own kernel (Q5_0 here) is decoded to float32 at load and run by
    the kernels' f32 path, so its rows ignore their batch too."""
    path_kernels(path)
    monkeypatch.setenv(native.ENV, path)
    stored = stored_weight("q5_0", 40, 256)
    matrix = stored_matrix(stored)
    assert isinstance(matrix, StoredMatrix) and matrix.dtype == "f32" and matrix.kernels.name == path
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(2))
    assert_float32_accuracy(matrix.matmul(x), x, torch.from_numpy(stored.to_float32()))
    assert_rows_ignore_their_batch(matrix.matmul, x)


def test_float32_fallback_rows_ignore_their_batch():
    """The fallback (no kernels, or rows that do not fill 32-value blocks): torch's GEMM on
    fixed 16-row blocks, each row's bits the same in any product, on one torch thread or
    the default count."""
    rng = np.random.default_rng(3)
    w = torch.from_numpy(rng.standard_normal((300, 96)).astype(np.float32))
    matrix = DenseMatrix(w, "f16")
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(4))
    assert_float32_accuracy(matrix.matmul(x), x, w)
    assert_rows_ignore_their_batch(matrix.matmul, x)
    with fixed_blocks.torch_threads(1):
        assert torch.equal(matrix.matmul(x), torch.cat([matrix.matmul(x[i:i + 1]) for i in range(70)]))


def test_float32_fallback_prompt_rows_and_sampled_rows_each_ignore_their_batch():
    """The fallback runs sampled rows in 2-row blocks and prompt rows nobody samples
    (``HalfRows.half``) in 16-row blocks: a sampled row gets the same bits whatever rows
    share its step, and so does a prompt row, however its prompt is cut into chunks."""
    rng = np.random.default_rng(5)
    w = torch.from_numpy(rng.standard_normal((300, 96)).astype(np.float32))
    matrix = DenseMatrix(w, "f16")
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(6))
    sampled = [i % 9 == 4 for i in range(40)]
    mixed = matrix.matmul(x, HalfRows.of(sampled))
    assert_float32_accuracy(mixed, x, w)
    prompt_rows = fixed_blocks.fixed_block_linear(x, w, native.FALLBACK_ROWS)
    for i, flag in enumerate(sampled):
        if flag:  # a sampled row: its decode-step product alone
            assert torch.equal(mixed[i:i + 1], matrix.matmul(x[i:i + 1]))
        else:  # a prompt row: the same in a chunk of other rows, or alone in its chunk
            assert torch.equal(mixed[i:i + 1], prompt_rows[i:i + 1])
            alone = matrix.matmul(x[i:i + 1].repeat(2, 1), HalfRows.of([False, True]))
            assert torch.equal(alone[0:1], mixed[i:i + 1])
    assert_rows_ignore_their_batch(matrix.matmul, x)


def test_default_is_the_best_path_the_cpu_has():
    runnable = native.runnable_paths()
    if not runnable:
        pytest.skip("no kernel path runs on this CPU")
    chosen = native.load()
    assert chosen is not None and chosen.name == runnable[0] and native.selected_path() == runnable[0]


def test_an_avx2_cpu_gets_the_avx2_path(monkeypatch):
    """What an AVX2-only CPU (an AMD EPYC before Zen 4) sees: the flags without AVX-512."""
    flags = native.cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU lacks AVX2 + FMA + F16C")
    monkeypatch.setattr(native, "cpu_flags", lambda: {f for f in flags if not f.startswith("avx512")})
    assert native.runnable_paths() == ["avx2"]
    assert native.load().name == "avx2"
    monkeypatch.setenv(native.ENV, "avx512")
    native.reset()
    with pytest.raises(native.KernelPathError, match="avx512 kernels need avx512f, avx512bw, which this CPU lacks"):
        native.load()


def test_override_forces_each_runnable_path_or_the_fallback(monkeypatch):
    for name in native.runnable_paths():
        monkeypatch.setenv(native.ENV, name)
        native.reset()
        assert native.load().name == name and native.selected_path() == name
    monkeypatch.setenv(native.ENV, "fallback")
    native.reset()
    assert native.load() is None and native.selected_path() == "fallback"
    assert native.unavailable_reason() == "MUSEGL_CPU_KERNELS=fallback"
    assert isinstance(stored_matrix(stored_weight("f16", 8, 64)), DenseMatrix)


def test_override_refuses_an_unknown_path(monkeypatch):
    monkeypatch.setenv(native.ENV, "avx9")
    with pytest.raises(native.KernelPathError, match="expected one of avx512fp16, avx512, avx2, fallback"):
        native.load()


def test_no_vector_path_falls_back_and_says_so(monkeypatch, caplog):
    """A CPU with neither AVX2 nor AVX-512: the float32 fallback, one warning naming why."""
    monkeypatch.setattr(native, "cpu_flags", lambda: {"sse2", "sse4_2", "avx"})
    with caplog.at_level(logging.WARNING, logger="musegl.cuda"):
        assert native.load() is None
    assert "neither AVX2 nor AVX-512" in native.unavailable_reason()
    assert any("stored-weight kernels unavailable" in r.message and "16 rows" in r.message for r in caplog.records)
    assert isinstance(stored_matrix(stored_weight("q8_0", 8, 64)), DenseMatrix)
    monkeypatch.setenv(native.ENV, "avx2")
    native.reset()
    with pytest.raises(native.KernelPathError, match="avx2 kernels need avx2"):
        native.load()


PRODUCTS_SCRIPT = """
import sys, numpy as np, torch
torch.set_num_threads(int(sys.argv[1]))
sys.path.insert(0, sys.argv[3])
from test_kernel_paths import stored_weight
from musegl_cuda.cpu.stored_matrix import StoredMatrix
from musegl_cuda.cpu.attention import RowKeys, attend
from musegl_cuda.cpu import native
kernels = native.load()
x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1))
out = [StoredMatrix.from_stored(stored_weight(d, 42, 512), kernels).matmul(x[:m]).numpy()
       for d in ("f16", "q8_0", "q4_k", "q6_k") for m in (1, 5, 40)]
k = torch.randn(100, 2, 32, generator=torch.Generator().manual_seed(2))
q = torch.randn(30, 8, 32, generator=torch.Generator().manual_seed(3))
keys = RowKeys(torch.arange(100), torch.zeros(30, dtype=torch.long), torch.arange(71, 101), 100, 99, 0)
out.append(attend(q, k, k, keys, 0, 0.2, kernels).numpy())
np.savez(sys.argv[2], *out)
"""


def test_results_do_not_depend_on_the_thread_count(tmp_path):
    """The kernels' pool splits rows by its size; an output's bits must not care (two
    processes, one and three threads)."""
    import subprocess
    import sys
    from pathlib import Path

    if native.load() is None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    here = str(Path(__file__).parent)
    files = []
    for threads in (1, 3):
        target = tmp_path / f"t{threads}.npz"
        subprocess.run([sys.executable, "-c", PRODUCTS_SCRIPT, str(threads), str(target), here], check=True)
        files.append(np.load(target))
    assert len(files[0].files) == 13
    for name in files[0].files:
        assert np.array_equal(files[0][name], files[1][name]), name


def test_serve_check_refuses_a_bad_override_before_loading(monkeypatch, tmp_path):
    """``musegl serve``'s pre-serve check (the torch-cpu spec's ``check``) refuses an
    unknown path and one this CPU lacks, in one line, before any worker starts."""
    from musegl_core.errors import ConfigError
    from musegl_core.plugins.specs import ExecutorOptions
    from musegl_cuda import plugin

    spec = {s.name: s for s in plugin.musegl_executors()}["torch-cpu"]
    options = ExecutorOptions(model=str(tmp_path / "missing.gguf"))
    monkeypatch.setenv(native.ENV, "avx9")
    with pytest.raises(ConfigError, match="expected one of"):
        spec.check(options)
    monkeypatch.setattr(native, "cpu_flags", lambda: {"sse2", "avx"})
    monkeypatch.setenv(native.ENV, "avx2")
    with pytest.raises(ConfigError, match="MUSEGL_CPU_KERNELS=avx2: the avx2 kernels need avx2, fma, f16c"):
        spec.check(options)
