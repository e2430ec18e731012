"""The MLX executor on files quantized by the real tools (slow): llama.cpp's ``llama-quantize``
(Q4_K_M, Q6_K, Q8_0; built on first use, musegl_core/testing/llamacpp.py) and mlx-lm's
converter (4-bit, groups of 64). ``musegl generate --executor mlx`` is greedy-identical to
transformers running the weights MLX holds, dequantized, in float32 (for Q8_0 and Q4_K_M also
to transformers on the file's own values); for Q6_K, which MLX holds in its nearest form, the
test measures top-1 agreement with the file's own values instead."""

from __future__ import annotations

import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.fit import checkpoint_tensor_bytes
from musegl_core.testing.quantized_files import (
    WIDE_SHAPE,
    greedy_cli,
    llama_quantized,
    reference_greedy,
    resident_weight_bytes,
)
from musegl_core.testing.quantized_reference import reference_with_weights
from musegl_core.testing.reference_models import build_tiny_model

pytestmark = pytest.mark.slow

KINDS = ("Q4_K_M", "Q6_K", "Q8_0")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    model = build_tiny_model(seed=7, **WIDE_SHAPE)
    path = tmp_path_factory.mktemp("wide_hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def llama_files(wide, tmp_path_factory):
    from musegl_core.testing.llamacpp import LlamaCppUnavailable

    try:
        return llama_quantized(wide[1], tmp_path_factory.mktemp("llama"), KINDS)
    except LlamaCppUnavailable as exc:
        pytest.fail(f"llama-quantize is needed for this test: {exc}")


def mlx_held_reference(model, path):
    """transformers with the values the MLX executor holds for ``path`` (Q6_K in its MLX form)."""
    import mlx.core as mx
    import numpy as np

    from musegl_mlx.loader import checkpoint_weights
    from musegl_mlx.quant import QuantizedWeight

    class Held:
        def iter_weights(self):
            for name, weight in checkpoint_weights(load_checkpoint(path)):
                if isinstance(weight, QuantizedWeight):
                    values = mx.dequantize(mx.array(weight.packed), mx.array(weight.scales),
                                           mx.array(weight.biases), group_size=weight.group_size, bits=weight.bits)
                    yield name, np.array(values.astype(mx.float32))
                else:
                    yield name, np.asarray(weight, dtype=np.float32)

    return reference_with_weights(model, Held())


@pytest.mark.parametrize("kind", KINDS)
def test_llama_quantize_files_on_mlx_are_greedy_identical_to_transformers(wide, llama_files, kind):
    model, _ = wide
    path = llama_files[kind]
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(31)).tolist()
    ours = greedy_cli(path, "mlx", ids, NEW_TOKENS)
    held_model = mlx_held_reference(model, path)
    assert ours == reference_greedy(held_model, ids, NEW_TOKENS)
    checkpoint = load_checkpoint(path)
    exact_model = reference_with_weights(model, checkpoint)
    checkpoint.close()
    exact = reference_greedy(exact_model, ids, NEW_TOKENS)
    # teacher-forced top-1 agreement with the file's own values over 256 random positions
    probe = torch.randint(0, 512, (256,), generator=torch.Generator().manual_seed(32))[None]
    with torch.no_grad():
        agreement = float((held_model(input_ids=probe).logits.argmax(-1)
                           == exact_model(input_ids=probe).logits.argmax(-1)).float().mean())
    print(f"{kind}: greedy run equal to the file's values: {ours == exact}; top-1 agreement {agreement:.4f}")
    if kind in ("Q8_0", "Q4_K_M"):  # exact forms (Q4_K_M's few Q6_K matrices do not move its tokens here)
        assert ours == exact
    else:  # Q6_K in its nearest MLX form: 0.38 % RMS error on this file's matrices, 89 % top-1
        # agreement on this random model (whose logits are nearly flat: a harsh measure)
        from musegl_mlx.quant import q6_k_error

        checkpoint = load_checkpoint(path)
        errors = [q6_k_error(s) for s in checkpoint.iter_stored() if s.dtype == "q6_k"]
        checkpoint.close()
        assert errors and max(errors) < 0.005, max(errors)
        assert agreement >= 0.85


def test_mlx_lm_file_resident_bytes_are_its_tensor_bytes(tmp_path_factory):
    """Resident memory (RssAnon) the MLX executor adds loading an mlx-lm 4-bit file (the real
    vocabulary, so the file is 65 MB), against the file's tensor bytes: at most 1.1x."""
    pytest.importorskip("mlx_lm")
    from musegl_core.testing.mlx_lm_tools import mlx_lm_quantize

    model = build_tiny_model(seed=3, vocab_size=202048, num_hidden_layers=2, **WIDE_SHAPE)
    hf = tmp_path_factory.mktemp("big_hf")
    model.save_pretrained(hf)
    del model
    mlx4 = mlx_lm_quantize(hf, tmp_path_factory.mktemp("big_mlx") / "q4g64", bits=4, group_size=64)
    file_bytes = sum(checkpoint_tensor_bytes(mlx4).values())
    resident = resident_weight_bytes("mlx", mlx4)
    print(f"mlx-lm 4-bit: resident {resident} of file {file_bytes} ({resident / file_bytes:.3f}x)")
    assert resident <= 1.1 * file_bytes
