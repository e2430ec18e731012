"""Tiny random Muse Glimmer checkpoints built with transformers (the numerical oracle).

Parity tests compare an executor with these models (transformers is a test
dependency; it is imported only when a model is built)."""

from __future__ import annotations

from pathlib import Path

import attrs

# A tiny text decoder: 6 layers, so the default layout has sliding+RoPE layers
# (0, 2, 3, 4) and full+NoPE layers (1, 5); an 8-token window is shorter than
# the 64-token parity prompt.
TINY_TEXT_CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
    max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1, eos_token_id=2,
)
TINY_VISION_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, pos_emb_height=4, pos_emb_width=4)


@attrs.frozen
class TinyModel:
    """A transformers reference model and the directory it was saved to."""

    model: object
    path: Path


def build_tiny_model(seed: int = 0, **text_overrides):
    """A float32 ``MuseGlimmerForConditionalGeneration`` with randomized norm weights
    (centered norms near 0, so the +1 matters; the final norm near 1)."""
    import torch
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(seed)
    config = MuseGlimmerConfig(text_config={**TINY_TEXT_CONFIG, **text_overrides},
                               vision_config=TINY_VISION_CONFIG, out_hidden_size=128,
                               projector_hidden_size=64)
    model = MuseGlimmerForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and name.endswith("layernorm.weight"):
                param.normal_(0.0, 0.3)
            elif name == "model.language_model.norm.weight":
                param.normal_(1.0, 0.2)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_tokenizer_data(vocab_size: int = 512):
    """Token metadata for a tiny GGUF: a valid byte-level BPE vocabulary (the 256 byte
    symbols, two merges, fillers) with bos 1, eos 2, eot 3."""
    from musegl_core.checkpoint.tokenizer_data import CONTROL, NORMAL, GGUFTokenizerData
    from musegl_core.tokenizer import byte_level_alphabet

    base = ["<pad>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot|>", *byte_level_alphabet(), "to", "tok"]
    tokens = tuple(base + [f"tok{i}" for i in range(len(base), vocab_size)])
    types = tuple([CONTROL] * 4 + [NORMAL] * (vocab_size - 4))
    return GGUFTokenizerData(tokens=tokens, token_types=types, merges=("t o", "to k"),
                             bos_token_id=1, eos_token_id=2, eot_token_id=3, padding_token_id=0,
                             chat_template="{{ messages }}")




# A tiny vision tower with both layer kinds: layer 0 is window attention (4x4-patch
# windows: the position table's side), layer 1 full attention.
TINY_VL_VISION_CONFIG = dict(TINY_VISION_CONFIG, num_hidden_layers=2)


def build_tiny_vl_model(seed: int = 0, **text_overrides):
    """A float32 vision-language ``MuseGlimmerForConditionalGeneration`` for image parity:
    a two-layer vision tower with randomized LayerNorms (so weights and biases matter),
    the text decoder of :func:`build_tiny_model`. With ``vocab_size=202048`` the
    image token id is the real ``<|patch|>`` (200092), for chat prompts."""
    import torch
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(seed)
    text = {**TINY_TEXT_CONFIG, **text_overrides}
    extra = {} if text["vocab_size"] > 200092 else {"image_token_id": 500, "video_token_id": 501}
    config = MuseGlimmerConfig(text_config=text, vision_config=TINY_VL_VISION_CONFIG, out_hidden_size=128,
                               projector_hidden_size=64, **extra)
    model = MuseGlimmerForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and name.endswith("layernorm.weight"):
                param.normal_(0.0, 0.3)
            elif name == "model.language_model.norm.weight":
                param.normal_(1.0, 0.2)
            elif "vision_tower" in name and ("norm" in name or "ln_" in name):
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif "vision_tower" in name and name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
