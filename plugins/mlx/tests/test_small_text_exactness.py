"""Exactness on the small-text checkpoint (slow), on torch-cpu and MLX.

The small-text checkpoint is the shape of ``musegl make-tiny --preset bench`` that the CPU
benchmarks serve (hidden 1024, 8 layers, 8 query / 2 KV heads of 128, MLP 2816, the real
202048-token vocabulary): a random transformers model of that shape, written by musegl's
converter as a float32 GGUF and quantized by llama.cpp's own ``llama-quantize`` (Q4_K_M, Q6_K,
Q8_0), and converted by mlx-lm's converter (4-bit, groups of 64). ``musegl generate`` (greedy,
float32) on each file equals transformers running the file's weights dequantized, in float32;
on MLX, whose Q6_K form is not the file's (docs/mlx.md), the files holding Q6_K matrices equal
transformers running the values MLX holds; the error MLX's form adds to the logits
(teacher-forced, 128 positions) must stay below the file's own error against the float32 model
the files were made from, and top-1 agreement with the file's values is printed. The tiny
model's cases are test_llama_quantize_exactness.py (torch-cpu), test_mlx_real_quantizers.py
and test_mlx_quant.py (MLX and mlx-lm).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.testing.quantized_files import greedy_cli, llama_quantized, reference_greedy
from musegl_core.testing.quantized_reference import reference_with_weights
from musegl_core.testing.reference_models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_mlx_real_quantizers import mlx_held_reference  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

#: ``musegl_core.tiny.PRESETS["bench"]`` in transformers' names
SMALL_TEXT = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, intermediate_size=2816, sliding_window=256, vocab_size=202048)
KINDS = ("Q4_K_M", "Q6_K", "Q8_0")
NEW_TOKENS = 24
PROMPT = 40


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    """(transformers model, {file kind: path}) for the small-text checkpoint."""
    from musegl_core.testing.llamacpp import LlamaCppUnavailable

    pytest.importorskip("mlx_lm")
    from musegl_core.testing.mlx_lm_tools import mlx_lm_quantize

    model = build_tiny_model(seed=11, **SMALL_TEXT)
    hf = tmp_path_factory.mktemp("small_text_hf")
    model.save_pretrained(hf)
    try:
        files = llama_quantized(hf, tmp_path_factory.mktemp("small_text_llama"), KINDS)
    except LlamaCppUnavailable as exc:
        pytest.fail(f"llama-quantize is needed for this test: {exc}")
    (files["Q4_K_M"].parent / "model-f32.gguf").unlink()  # 2 GB the tests no longer need
    files["mlx-lm 4-bit"] = mlx_lm_quantize(hf, tmp_path_factory.mktemp("small_text_mlx") / "q4g64", bits=4,
                                            group_size=64)
    return model, files


def prompt() -> list[int]:
    return torch.randint(0, 512, (PROMPT,), generator=torch.Generator().manual_seed(41)).tolist()


@pytest.mark.parametrize("kind", [*KINDS, "mlx-lm 4-bit"])
def test_small_text_on_torch_cpu_is_greedy_identical_to_transformers(small_text, kind):
    model, files = small_text
    checkpoint = load_checkpoint(files[kind])
    reference = reference_with_weights(model, checkpoint)
    checkpoint.close()
    expected = reference_greedy(reference, prompt(), NEW_TOKENS)
    del reference
    gc.collect()
    assert greedy_cli(files[kind], "torch-cpu", prompt(), NEW_TOKENS) == expected


@pytest.mark.parametrize("kind", [*KINDS, "mlx-lm 4-bit"])
def test_small_text_on_mlx_is_greedy_identical_to_transformers(small_text, kind):
    from musegl_core.engine.fit import checkpoint_tensor_bytes

    model, files = small_text
    path = files[kind]
    checkpoint = load_checkpoint(path)
    exact_model = reference_with_weights(model, checkpoint)
    checkpoint.close()
    exact = reference_greedy(exact_model, prompt(), NEW_TOKENS)
    probe = torch.randint(0, 512, (128,), generator=torch.Generator().manual_seed(42))[None]
    with torch.no_grad():
        file_logits = exact_model(input_ids=probe).logits
        original = model(input_ids=probe).logits  # the float32 model the files came from
    del exact_model
    gc.collect()
    ours = greedy_cli(path, "mlx", prompt(), NEW_TOKENS)
    if "q6_k" not in checkpoint_tensor_bytes(path):  # every matrix in an exact MLX form
        assert ours == exact
        return
    held_model = mlx_held_reference(model, path)
    assert ours == reference_greedy(held_model, prompt(), NEW_TOKENS)
    with torch.no_grad():
        held = held_model(input_ids=probe).logits

    def relative(a, b) -> float:
        return float((a - b).norm() / b.norm())

    agreement = float((held.argmax(-1) == file_logits.argmax(-1)).float().mean())
    print(f"{kind} on MLX: greedy equal to the file's values: {ours == exact}; top-1 agreement with the file "
          f"{agreement:.4f}; logits' relative error: MLX vs file {relative(held, file_logits):.4f}, "
          f"file vs the float32 model {relative(file_logits, original):.4f}")
    # the error Q6_K's MLX form (6-bit groups of 32) adds is below the file's own quantization error
    # (this random model's logits are nearly flat, so top-1 agreement says little: the Q4_K_M file
    # itself agrees with the float32 model on 2 % of 512 positions)
    assert relative(held, file_logits) < relative(file_logits, original)
