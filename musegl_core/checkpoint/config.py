"""The Muse Glimmer text-decoder configuration."""

from __future__ import annotations

import attrs


@attrs.frozen
class TextConfig:
    """Hyper-parameters of the text decoder, as transformers' ``MuseGlimmerTextConfig``.

    ``sliding[i]`` is True for a sliding-window layer, ``rope[i]`` True where
    the layer applies RoPE (transformers: ``layer_rope_theta[i] != 0``). The
    released layout has them equal; a config.json may decouple them, and
    both are kept.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    sliding: tuple[bool, ...]
    rope: tuple[bool, ...]
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    post_norm_eps: float = 1e-8
    qk_scale_factor: float = 3.87
    output_multiplier: float = 0.19611613513818404
    final_logit_softcapping: float | None = 20.0
    max_position_embeddings: int = 131072
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        if len(self.sliding) != self.num_layers or len(self.rope) != self.num_layers:
            raise ValueError("sliding/rope must have one entry per layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @staticmethod
    def default_layout(num_layers: int) -> tuple[bool, ...]:
        """Sliding (True) except every 4th layer counted back from the last."""
        return tuple((num_layers - 1 - i) % 4 != 0 for i in range(num_layers))
