"""The float32 GGUF the GPU tests serve: 8 layers, hidden 512, 8 query / 2 KV heads, a
4,096-entry vocabulary, seeded random weights (norms near their working values)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_gpu_checkpoint(directory: Path) -> Path:
    """Write ``directory/model.gguf`` (with the tiny tokenizer) and return its path."""
    from musegl_core.checkpoint.config import TextConfig
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.hf_reader import expected_shape, text_weight_names
    from musegl_core.testing.reference_models import tiny_tokenizer_data

    layout = TextConfig.default_layout(8)
    config = TextConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=8, num_heads=8,
                        num_kv_heads=2, head_dim=64, sliding_window=32, sliding=layout, rope=layout,
                        bos_token_id=1, eos_token_ids=(2,))
    rng = np.random.default_rng(0)
    weights = {}
    for name in text_weight_names(config):
        shape = expected_shape(config, name)
        scale, base = (0.1, 1.0) if name == "norm.weight" else (0.1, 0.0) if name.endswith("layernorm.weight") \
            else (0.05, 0.0)
        weights[name] = (base + scale * rng.standard_normal(shape)).astype(np.float32)
    path = Path(directory) / "model.gguf"
    write_text_gguf(path, config, weights, tiny_tokenizer_data(4096), file_type="f32")
    return path
