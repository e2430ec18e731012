"""A small GGUF with the tensor types of a ``llama-quantize`` Q4_K_M file.

gguf-py has no k-quant quantizer, so the matrices are random GGUF blocks
(:func:`quantized_checks.random_blocks`) of the types llama.cpp's Q4_K_M policy
gives each tensor: Q6_K for ``output.weight`` and for ``attn_v`` / ``ffn_down`` of
the layers ``use_more_bits`` picks (the first and last eighth, and every third one
between), Q4_K for the rest; the norms float32. The reference for every test is
the same file read by :meth:`Checkpoint.read` (gguf-py's dequantizers).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from quantized_checks import random_blocks

from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.gguf_writer import _add_metadata, _gguf_tensors, add_tokenizer_metadata
from musegl_core.checkpoint.hf_reader import expected_shape, text_weight_names
from musegl_core.testing.reference_models import tiny_tokenizer_data


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int) -> str:
    """The type of GGUF tensor ``name`` in a Q4_K_M file."""
    if name == "output.weight":
        return "q6_k"
    if name.startswith("blk.") and name.split(".")[2] in ("attn_v", "ffn_down"):
        return "q6_k" if use_more_bits(int(name.split(".")[1]), layers) else "q4_k"
    return "q4_k"


def small_config(layers: int = 2) -> TextConfig:
    """Rows of 256 values (k-quant super-blocks) everywhere: hidden 256, 4 x 64 query heads,
    2 KV heads, MLP 512, a 512-entry vocabulary."""
    layout = TextConfig.default_layout(layers)
    return TextConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=64, sliding_window=8, sliding=layout, rope=layout,
                      bos_token_id=1, eos_token_ids=(2,))


def write_q4_k_m(directory: Path, config: TextConfig | None = None, seed: int = 0) -> Path:
    """Write ``directory/q4_k_m.gguf`` and return its path."""
    config = config or small_config()
    rng = np.random.default_rng(seed)
    norms = {n: (rng.standard_normal(expected_shape(config, n)) * 0.1).astype(np.float32)
             for n in text_weight_names(config) if n.endswith("norm.weight")}
    norms["norm.weight"] += 1.0
    path = Path(directory) / "q4_k_m.gguf"
    writer = gguf.GGUFWriter(str(path), "muse-glimmer")
    try:
        _add_metadata(writer, config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "Muse Glimmer Q4_K_M test")
        add_tokenizer_metadata(writer, tiny_tokenizer_data(config.vocab_size), config.vocab_size)
        plan = []
        for index, (name, make, shape) in enumerate(_gguf_tensors(config, norms, False)):
            if len(shape) == 1:
                writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
                plan.append((make, None))
                continue
            qtype = q4_k_m_type(name, config.num_layers)
            data = random_blocks(qtype, shape[0], shape[1], seed=seed * 1000 + index)
            writer.add_tensor_info(name, data.shape, np.dtype(np.uint8), data.nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[qtype.upper()])
            plan.append((None, data))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for make, data in plan:
            writer.write_tensor_data(np.ascontiguousarray(make(), dtype=np.float32) if data is None else data)
    finally:
        writer.close()
    return path
