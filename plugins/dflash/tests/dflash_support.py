"""Tiny random DFlash drafts built with transformers (the numerical oracle) for the tests."""

from __future__ import annotations

from pathlib import Path

# Fits the demo checkpoint (musegl make-tiny "tiny": hidden 64, 4 layers, vocabulary 202048).
DEMO_DRAFT_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, sliding_window=2048, block_size=16, mask_token_id=201818, target_layer_ids=[0, 1, 3],
    max_position_embeddings=4096,
)


def build_reference_draft(seed: int = 0, **overrides):
    """A float32 transformers ``MuseGlimmerAssistantModel`` (eager attention) with
    random weights and norm weights spread about 1, so every weight matters."""
    import torch
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    torch.manual_seed(seed)
    config = MuseGlimmerAssistantConfig(**{**DEMO_DRAFT_CONFIG, **overrides})
    config._attn_implementation = "eager"
    model = MuseGlimmerAssistantModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_enc.weight"):
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.1)
    return model


def save_draft(model, directory: Path, *, gguf: bool = False, tokenizer=None) -> Path:
    """Save ``model`` as a Hugging Face directory, or (``gguf``) as a DFlash GGUF in it."""
    directory.mkdir(parents=True, exist_ok=True)
    if not gguf:
        model.save_pretrained(directory)
        return directory
    from musegl_dflash.checkpoint import config_from_dict, write_draft_gguf

    config = config_from_dict(model.config.to_dict())
    weights = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    path = directory / "draft.gguf"
    write_draft_gguf(path, config, weights, tokenizer)
    return path


def same_draws(a: list, b: list) -> float:
    """The share of seeds that drew the same answer. Position-keyed numbers make it 1 in
    exact arithmetic; a verify chunk computes a row's logits in a wider forward than a
    plain decode step, so a draw whose number falls within float rounding of a
    boundary of the inverse CDF can flip (seen: 1 draw in 160 at temperature 1.5)."""
    return sum(x == y for x, y in zip(a, b)) / len(a)
