"""``--kv-cache-dtype fp8`` on a CUDA GPU (marked ``gpu``; run with
``python -m pytest -q -m gpu plugins/cuda/tests/test_kv_fp8_gpu.py -n 0``).

The compiled kernels against the CPU reference (``kv_fp8_checks.py``, the same checks the
interpreted test runs), then the executor: an FP8 pool through the CUDA graphs (decode and
verify-shaped steps) gives exactly the dynamic path's ids and logits, float32 on the GPU
stays within float rounding of the CPU reference path, and a long prefill chunk's fused
(cuDNN) attention reads the dequantized keys like the paged kernel does.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checkpoint_support import write_gpu_checkpoint

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory):
    return write_gpu_checkpoint(tmp_path_factory.mktemp("gpu_fp8"))


def executor(path, device="cuda", dtype="bfloat16", kv="fp8", blocks=64, **kw):
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_cuda.executor import TorchExecutor

    ex = TorchExecutor(load_checkpoint(path), device=device, dtype=dtype, kv_cache_dtype=kv, **kw)
    ex.allocate_kv(blocks)
    return ex


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_kernels_match_the_reference_on_the_gpu(dtype):
    from kv_fp8_checks import check_fp8_attention, check_fp8_store

    dt = getattr(torch, dtype)
    check_fp8_store("cuda", dt, heads=8, kv_heads=2, head_dim=64)
    check_fp8_attention("cuda", dt, heads=8, kv_heads=2, head_dim=64, splits=(1, 3, 16))


def _decode(ex, prompts, steps, rows=1, feed=None):
    """Prefill each prompt, then ``steps`` steps of ``rows`` greedy rows per sequence (rows > 1:
    verify-shaped blocks, every row sampled, each fed the sequence's last id, as a draft would
    be): the ids of each step's last rows and the last step's logits. ``feed``: ids of another
    run (this function's first result), fed in place of this run's own (teacher forcing: both
    runs then read the same sequences, whatever their argmax picks)."""
    from musegl_core.engine.executor import SeqChunk, Step

    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
    out = ex.step(Step([SeqChunk(i, p, list(range(len(p))), tables[i], sample=1) for i, p in enumerate(prompts)]))
    ids = [[out.tokens[i][-1]] for i in range(len(prompts))]
    fed = [len(p) for p in prompts]
    logits = None
    for step in range(steps):
        last = [ids[i][-1] if feed is None else feed[i][step] for i in range(len(prompts))]
        chunks = [SeqChunk(i, [last[i]] * rows, list(range(fed[i], fed[i] + rows)), tables[i], sample=rows,
                           want_logits=True) for i in range(len(prompts))]
        out = ex.step(Step(chunks, width=rows * len(prompts)))  # 4 or 8: captured widths
        for i in range(len(prompts)):
            ids[i].append(out.tokens[i][-1])
            fed[i] += rows
        logits = [out.logits[i].float().cpu() for i in range(len(prompts))]
    return ids, logits


@pytest.mark.parametrize("rows", [1, 2])
def test_fp8_graphs_match_the_dynamic_path(checkpoint_path, rows):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(4, 4096, size=n).tolist() for n in (23, 51, 70, 9)]
    graphs = executor(checkpoint_path)
    assert graphs.graphs is not None and graphs.kv.dtype == torch.float8_e4m3fn
    with_graphs = _decode(graphs, prompts, 12, rows)
    graphs.close()
    dynamic = executor(checkpoint_path, forward_sizes=())
    assert dynamic.graphs is None
    without = _decode(dynamic, prompts, 12, rows)
    dynamic.close()
    assert with_graphs[0] == without[0]
    assert all(torch.allclose(a, b, atol=1e-3, rtol=1e-3) for a, b in zip(with_graphs[1], without[1]))


def test_fp8_float32_on_the_gpu_matches_the_cpu_reference(checkpoint_path):
    """Teacher-forced: the GPU and the float32 KV run are fed the FP8 CPU reference's ids. Free
    running, one argmax that float rounding flips (the near-flat logits of random weights; an
    e4m3 code a rounding lands on the other side of moves 1/16 of a value) sends the runs down
    different sequences, and their logits then differ by the logits' own size: 1.13 against
    FP8's 1.29 on an H100 (benchmarks/results/gpu_quantized_2026-12-07_h100), where the kernels
    in Triton's interpreter, fed the same ids, are within 0.006 of the reference against FP8's
    0.16-0.20 (float32, splits as on an H100; benchmarks/results/kv_fp8_cpu_parity_2026-12-07)."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(4, 4096, size=n).tolist() for n in (30, 64, 12, 40)]
    results = {}
    feed = None
    for device, kv in (("cpu", "fp8"), ("cuda", "fp8"), ("cpu", "auto")):
        ex = executor(checkpoint_path, device=device, dtype="float32", kv=kv)
        ids, results[device, kv] = _decode(ex, prompts, 6, feed=feed)
        feed = feed or [i[:-1] for i in ids]  # the reference's ids, fed to the other two
        ex.close()
    fp8_error = max(float((a - b).abs().max()) for a, b in zip(results["cpu", "fp8"], results["cpu", "auto"]))
    devices = max(float((a - b).abs().max()) for a, b in zip(results["cuda", "fp8"], results["cpu", "fp8"]))
    print(f"\nfp8 KV, float32: CUDA vs the CPU reference {devices:.2e}; fp8 vs float32 KV {fp8_error:.2e}")
    assert devices <= fp8_error / 10


def test_a_long_prefill_chunk_reads_fp8_keys_in_the_fused_attention(checkpoint_path):
    """The fused (cuDNN) attention of a long prefill chunk against the paged kernel, in bf16,
    with FP8 K/V and, as the baseline of the same run, with bf16 K/V. The two attentions sum in
    different orders and round P to bf16 in different places: with bf16 K/V their logits differ
    by up to 0.25 on this model (test_dense_attention's bound). FP8 adds one rounding in the
    fused path only (the gathered keys dequantized to bf16, 2^-9 of a value, as small as the
    rounding that stores bf16 K/V), so its distance is the baseline's kind and size: at most 3x
    the baseline, or 2^-5 of the largest logit (four bf16 units) where the baseline is tiny. A
    fixed 5 % of the largest logit failed on an H100 at 5.9 % (0.0518 of 0.883;
    benchmarks/results/gpu_quantized_2026-12-07_h100); a misread scale or byte moves whole
    attention rows, far outside."""
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.cuda import dense_attention

    prompt = np.random.default_rng(7).integers(4, 4096, size=1100).tolist()
    table = list(range(70))
    diffs, top = {}, 0.0
    for kv in ("fp8", "auto"):
        logits = {}
        for dense in (True, False):
            ex = executor(checkpoint_path, kv=kv, blocks=72, forward_sizes=())
            if not ex.dense_prefill:
                pytest.skip("no fused attention backend on this GPU")
            ex.dense_prefill = dense
            assert len(prompt) >= dense_attention.MIN_ROWS
            out = ex.step(Step([SeqChunk(1, prompt, list(range(len(prompt))), table, want_logits=True)]))
            logits[dense] = out.logits[1].float().cpu()
            ex.close()
        diffs[kv] = float((logits[True] - logits[False]).abs().max())
        top = max(top, float(logits[False].abs().max()))
    print(f"\nbf16, fused vs paged prefill attention: fp8 KV {diffs['fp8']:.2e}, bf16 KV {diffs['auto']:.2e}")
    assert diffs["fp8"] <= 0.25
    assert diffs["fp8"] <= max(3 * diffs["auto"], 2.0 ** -5 * top)
