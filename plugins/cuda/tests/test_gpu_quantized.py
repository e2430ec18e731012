"""Quantized weights as stored on a CUDA GPU (marked ``gpu``: skipped by default).

    OUT=/some/folder python -m pytest -q -m gpu plugins/cuda/tests/test_gpu_quantized.py

* the kernels against gguf-py's dequantizers and the FP8 references in bf16
  (:mod:`quantized_checks`);
* a Q4_K_M-typed GGUF served by the cuda executor as stored (decode graphs, launches
  ahead) against the CPU float32 reference of the same file, in float32 and bf16, and
  greedy decoding through the graphs equal to the same executor without graphs;
* ``--quantization fp8`` on the float32 GPU checkpoint, weight-only and W8A8, in
  float32 and bf16, against the torch-cpu executor on the same quantized weights;
* the products' micro benchmark (``benchmarks/gpu_quantized_products.py``: bf16, the
  GGUF types, FP8 weight-only and W8A8 at 1, 32 and 64 rows and a 2,048-row chunk).

Every result is a JSON line in ``$OUT/quantized_gpu.jsonl`` (the working directory
without ``OUT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HERE = Path(__file__).resolve().parent
RESULTS = Path(os.environ.get("OUT", ".")) / "quantized_gpu.jsonl"


def record(**fields) -> None:
    with open(RESULTS, "a") as f:
        f.write(json.dumps(fields) + "\n")


def test_kernels_match_the_references_in_bf16():
    from quantized_checks import check_fp8, check_gguf

    for row in check_gguf("cuda", torch.bfloat16, rows=(1, 32, 64, 300)) + check_fp8("cuda", torch.bfloat16,
                                                                                     rows=(1, 32, 64, 300)):
        record(part="kernel", **row)


def test_decode_gemv_and_w8a8_activations_match_the_references_in_bf16():
    from quantized_checks import check_gemv, check_quantize_rows

    for row in check_gemv("cuda", torch.bfloat16, rows=(1, 2, 5, 8), n=300, k=2048):
        record(part="gemv", **row)
    check_quantize_rows("cuda", torch.bfloat16, m=70, k=6656)


def _prompt_logits(executor, prompt) -> torch.Tensor:
    from musegl_core.engine.executor import SeqChunk, Step

    out = executor.step(Step([SeqChunk(0, prompt, list(range(len(prompt))), list(range(16)), logit_rows=True)]))
    return torch.as_tensor(out.logits[0]).float().cpu()


def _greedy(executor, prompt, steps: int) -> list[int]:
    from step_support import greedy_ids  # also run on the CPU (test_decode_helpers.py)

    return greedy_ids(executor, [int(t) for t in prompt], steps)


def _agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.argmax(-1) == want.argmax(-1)).float().mean())


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_q4_k_m_file_on_cuda_as_stored(tmp_path):
    """float32 activations on the GPU must match the CPU's float32 on the dequantized file
    (1e-3 of the largest logit, every row's top-1); bf16 is recorded and must agree on 90 %
    of the rows (random blocks give near-ties that bf16 rounding can swap; the issue's 99 %
    is for real checkpoints)."""
    from q4km_support import small_config, write_q4_k_m

    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_cuda.executor import TorchExecutor

    path = write_q4_k_m(tmp_path, small_config(layers=8))
    prompt = list(np.random.default_rng(2).integers(4, 500, size=200))
    reference = TorchExecutor(load_checkpoint(path), device="cpu", dtype="float32", weights="upcast")
    reference.allocate_kv(64)
    want = _prompt_logits(reference, prompt)
    reference.close()
    results = {}
    for dtype, graphs in (("float32", True), ("bfloat16", True), ("bfloat16", False)):
        executor = TorchExecutor(load_checkpoint(path), device="cuda", dtype=dtype,
                                 forward_sizes=None if graphs else ())
        assert executor.weights == "stored" and set(executor.weight_bytes) == {"q4_k", "q6_k"}
        executor.allocate_kv(64)
        results[dtype, graphs] = (_prompt_logits(executor, prompt), _greedy(executor, prompt[:50], 12))
        executor.close()
    f32, bf16 = results["float32", True][0], results["bfloat16", True][0]
    record(part="q4_k_m", float32_rel_err=_relative(f32, want), float32_top1=_agreement(f32, want),
           bf16_rel_err=_relative(bf16, want), bf16_top1=_agreement(bf16, want),
           greedy_graphs=results["bfloat16", True][1], greedy_eager=results["bfloat16", False][1])
    assert _relative(f32, want) < 1e-3 and _agreement(f32, want) == 1.0
    assert _agreement(bf16, want) >= 0.9
    assert results["bfloat16", True][1] == results["bfloat16", False][1]


@pytest.mark.parametrize("w8a8_rows", [1, 10**9], ids=["w8a8", "weight-only"])
def test_quantization_fp8_on_cuda(tmp_path, w8a8_rows):
    """Against the torch-cpu executor on the same quantized weights (float32, exact there):
    weight-only in float32 within 1e-3; W8A8 (activations rounded to e4m3) and bf16
    recorded, top-1 on 90 % of the rows."""
    from gpu_checkpoint_support import write_gpu_checkpoint

    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_cuda.executor import TorchExecutor

    path = write_gpu_checkpoint(tmp_path)
    prompt = list(np.random.default_rng(1).integers(4, 4096, size=100))
    cpu = TorchExecutor(load_checkpoint(path), device="cpu", dtype="float32", quantization="fp8")
    cpu.allocate_kv(64)
    want = _prompt_logits(cpu, prompt)
    cpu.close()
    for dtype in ("float32", "bfloat16"):
        executor = TorchExecutor(load_checkpoint(path), device="cuda", dtype=dtype, quantization="fp8",
                                 w8a8_rows=w8a8_rows)
        assert executor.weights == "stored" and set(executor.weight_bytes) == {"f8_e4m3"}
        executor.allocate_kv(64)
        got = _prompt_logits(executor, prompt)
        greedy = _greedy(executor, prompt[:40], 8)
        executor.close()
        record(part="fp8", dtype=dtype, w8a8_rows=w8a8_rows, rel_err=_relative(got, want),
               top1=_agreement(got, want), greedy=greedy)
        if dtype == "float32" and w8a8_rows > 1:
            assert _relative(got, want) < 1e-3
        assert _agreement(got, want) >= 0.9


@pytest.mark.timeout(1500)  # every format at four widths, graphs captured for each
def test_products_micro_benchmark():
    script = HERE.parents[2] / "benchmarks" / "gpu_quantized_products.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(RESULTS), "--layers", "2",
                           "--rows", "1,8,64,2048"], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
