"""The torch executor on a CUDA GPU (marked ``gpu``: skipped by default; run with ``-m gpu``).

Builds a small random GGUF with the project's writer (no transformers needed),
then checks on the GPU: the plugin offers ``cuda`` and ranks it first, float32
logits on CUDA match the CPU executor, bf16 (the CUDA default) stays close,
packed batched decoding matches one-at-a-time decoding, and a decode step's
time is printed for the record.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory):
    from musegl_core.checkpoint.config import TextConfig
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.hf_reader import expected_shape, text_weight_names
    from tests.support.tiny_models import tiny_tokenizer_data

    layout = TextConfig.default_layout(8)
    config = TextConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=8, num_heads=8,
                        num_kv_heads=2, head_dim=64, sliding_window=32, sliding=layout, rope=layout,
                        bos_token_id=1, eos_token_ids=(2,))
    rng = np.random.default_rng(0)
    weights = {}
    for name in text_weight_names(config):
        shape = expected_shape(config, name)
        if name.endswith("layernorm.weight"):
            weights[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "norm.weight":
            weights[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (0.05 * rng.standard_normal(shape)).astype(np.float32)
    path = tmp_path_factory.mktemp("gpu") / "model.gguf"
    write_text_gguf(path, config, weights, tiny_tokenizer_data(4096), file_type="f32")
    return path


def run_prompt(executor, prompt, handle=0):
    from musegl_core.engine.executor import SeqChunk, Step

    blocks = list(range(handle * 16, handle * 16 + 16))
    out = executor.step(Step([SeqChunk(handle, prompt, list(range(len(prompt))), blocks, logit_rows=True)]))
    return out.logits[handle].float().cpu()


def test_cuda_is_offered_and_preferred():
    from musegl_cuda.plugin import musegl_executors

    specs = {s.name: s for s in musegl_executors()}
    assert specs["cuda"].available()
    assert specs["cuda"].priority > specs["torch-cpu"].priority


def test_cuda_float32_matches_cpu_and_bf16_is_close(checkpoint_path):
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_cuda.executor import TorchExecutor

    prompt = list(np.random.default_rng(1).integers(4, 4096, size=100))
    results = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        executor = TorchExecutor(load_checkpoint(checkpoint_path), device=device, dtype=dtype)
        executor.allocate_kv(64)
        results[(device, dtype)] = run_prompt(executor, prompt)
        executor.close()
    cpu = results[("cpu", "float32")]
    diff32 = (results[("cuda", "float32")] - cpu).abs().max().item()
    diff16 = (results[("cuda", "bfloat16")] - cpu).abs().max().item()
    print(f"\nmax |logit diff| cuda fp32 vs cpu fp32: {diff32:.2e}; cuda bf16 vs cpu fp32: {diff16:.2e}")
    assert diff32 <= 1e-3  # TF32 may be enabled for matmuls on Hopper
    assert diff16 <= 0.5


def test_batched_decode_matches_single_on_cuda(checkpoint_path):
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.executor import TorchExecutor

    executor = TorchExecutor(load_checkpoint(checkpoint_path), device="cuda", dtype="float32")
    executor.allocate_kv(1024)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(4, 4096, size=n)) for n in (20, 35, 50, 64)]
    single = [run_prompt(executor, p, handle=i)[-1] for i, p in enumerate(prompts)]
    chunks = [SeqChunk(10 + i, p, list(range(len(p))), list(range(160 + 16 * i, 176 + 16 * i)), want_logits=True)
              for i, p in enumerate(prompts)]
    packed = executor.step(Step(chunks)).logits
    for i in range(len(prompts)):
        assert (packed[10 + i].float().cpu() - single[i]).abs().max().item() <= 1e-3
    # One decode step of 32 sequences, timed (figures for the record, not asserted).
    decode = [SeqChunk(100 + i, [5], [0], [512 + i], sample=True) for i in range(32)]
    executor.step(Step(decode))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        executor.step(Step([SeqChunk(c.seq, [7], [0], c.blocks, sample=True) for c in decode]))
    torch.cuda.synchronize()
    print(f"\n{torch.cuda.get_device_name()}: 32-sequence decode step {(time.perf_counter() - start) / 20 * 1e3:.2f} ms")
