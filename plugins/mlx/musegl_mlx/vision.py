"""The Muse Glimmer vision tower, pixel shuffle, adapter and projection in MLX.

:class:`VisionEncoder` turns one preprocessed image (patch rows of one frame,
``(gh·gw, 588)`` float32, raster order; :mod:`musegl_core.vision.preprocess`)
into ``gh·gw/4`` decoder input rows, already perception-normed. The weights
come from :mod:`musegl_core.checkpoint.vision` (a Hugging Face directory or
an mmproj GGUF, same names); the math is the torch executor's
(``musegl_cuda/vision.py``) and transformers':

* patch embedding (the temporal-summed kernel) plus the learned position
  table resampled bilinearly to the grid (``grid_sample``, zero padding);
* pre-LayerNorm ViT layers: axial 2-D RoPE (``[w·inv | h·inv | w·inv |
  h·inv]`` over 1-indexed rows and columns, cos/sin cast to the activation
  dtype, the rotation in float32), non-causal softmax attention (float32)
  within ``pos_side × pos_side`` windows or over the whole image (full
  layers), exact-erf GELU MLP;
* a final LayerNorm, the 2×2 pixel shuffle, the GELU adapter, the
  projection, and the weight-less perception norm (``pow`` form, float32).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from musegl_core.checkpoint.vision import VisionConfig, vision_shape, vision_weight_names


def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU."""
    return x * (1.0 + mx.erf(x / math.sqrt(2.0))) * 0.5


def layer_norm(x: mx.array, weight: mx.array, bias: mx.array, eps: float) -> mx.array:
    xf = x.astype(mx.float32)
    mean = mx.mean(xf, axis=-1, keepdims=True)
    var = mx.mean(mx.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * mx.rsqrt(var + eps) * weight.astype(mx.float32) + bias.astype(mx.float32)).astype(x.dtype)


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def window_groups(gh: int, gw: int, side: int) -> list[np.ndarray]:
    """Raster patch indices of each ``side × side`` window (from the top-left, edge
    windows smaller), grouped by window shape: one ``(windows, length)`` array per shape."""
    grid = np.arange(gh * gw).reshape(gh, gw)
    shapes: dict[tuple[int, int], list[np.ndarray]] = {}
    for r in range(0, gh, side):
        for c in range(0, gw, side):
            block = grid[r:r + side, c:c + side]
            shapes.setdefault(block.shape, []).append(block.reshape(-1))
    return [np.stack(blocks) for blocks in shapes.values()]


def position_taps(n: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps and weights (float32) resampling ``side`` table rows to ``n``
    outputs like ``grid_sample(align_corners=False, padding_mode="zeros")``."""
    src = (np.arange(n, dtype=np.float32) + 0.5) * side / n - 0.5
    floor = np.floor(src)
    raw = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0, None).astype(np.float32)
    weights = weights * ((raw >= 0) & (raw <= side - 1))
    return np.clip(raw, 0, side - 1), weights


class VisionEncoder:
    """Vision tower + pixel shuffle + adapter + projection + perception norm."""

    def __init__(self, config: VisionConfig, text_eps: float, dtype: mx.Dtype) -> None:
        self.config = config
        self.text_eps = text_eps
        self.dtype = dtype
        self.w: dict[str, mx.array] = {}
        spatial = config.head_dim // 2
        self.inv_freq = 1.0 / mx.power(mx.array(config.rope_theta, mx.float32),
                                       mx.arange(0, spatial, 2, dtype=mx.float32) / spatial)
        # Evaluated now: MLX streams belong to a thread, and the engine thread that
        # encodes images is not the one that loads (an unevaluated array would name
        # this thread's stream).
        mx.eval(self.inv_freq)

    def load(self, weights) -> None:
        """Fill from opened vision weights (``iter_weights()`` of float32 arrays)."""
        c = self.config
        for name, array in weights.iter_weights():
            if tuple(array.shape) != tuple(vision_shape(c, name)):
                raise ValueError(f"vision weight {name}: shape {tuple(array.shape)}, "
                                 f"the config says {vision_shape(c, name)}")
            self.w[name] = mx.array(np.asarray(array, dtype=np.float32)).astype(self.dtype)
            mx.eval(self.w[name])
        missing = set(vision_weight_names(c)) - set(self.w)
        if missing:
            raise ValueError(f"the vision weights lack {sorted(missing)[:5]}")

    def linear(self, x: mx.array, name: str, bias: bool = True) -> mx.array:
        y = x @ self.w[f"{name}.weight"].T
        return y + self.w[f"{name}.bias"] if bias else y

    def positions(self, gh: int, gw: int) -> mx.array:
        """The learned position rows resampled to the ``gh × gw`` grid, raster order."""
        side = self.config.pos_side
        h_taps, h_w = position_taps(gh, side)
        w_taps, w_w = position_taps(gw, side)
        index = (h_taps[:, None, :, None] * side + w_taps[None, :, None, :]).reshape(gh * gw, 4)
        weight = (h_w[:, None, :, None] * w_w[None, :, None, :]).reshape(gh * gw, 4)
        table = self.w["position_embedding.weight"]
        return (table[mx.array(index.astype(np.int32))] * mx.array(weight)[:, :, None].astype(table.dtype)).sum(1)

    def rope(self, gh: int, gw: int) -> tuple[mx.array, mx.array]:
        """cos/sin ``(gh·gw, head_dim)`` in the activation dtype."""
        rows = mx.array(np.repeat(np.arange(gh), gw) + 1)
        cols = mx.array(np.tile(np.arange(gw), gh) + 1)
        fw = cols[:, None].astype(mx.float32) * self.inv_freq
        fh = rows[:, None].astype(mx.float32) * self.inv_freq
        angles = mx.concatenate([fw, fh, fw, fh], axis=-1)
        return mx.cos(angles).astype(self.dtype), mx.sin(angles).astype(self.dtype)

    def attention(self, x: mx.array, prefix: str, rope: tuple[mx.array, mx.array],
                  groups: list[np.ndarray]) -> mx.array:
        c = self.config
        n = x.shape[0]
        heads, hd = c.num_heads, c.head_dim
        q, k, v = (self.linear(x, f"{prefix}.attn.{p}_proj").reshape(n, heads, hd) for p in "qkv")
        cos, sin = (t.astype(mx.float32)[:, None, :] for t in rope)
        q = (q.astype(mx.float32) * cos + rotate_half(q.astype(mx.float32)) * sin).astype(x.dtype)
        k = (k.astype(mx.float32) * cos + rotate_half(k.astype(mx.float32)) * sin).astype(x.dtype)
        out = mx.zeros_like(q)
        for index in groups:  # windows of one shape, run as one batch
            idx = mx.array(index.astype(np.int32))
            qw, kw, vw = (t[idx].transpose(0, 2, 1, 3) for t in (q, k, v))  # (windows, heads, length, hd)
            scores = (qw @ kw.swapaxes(-1, -2)).astype(mx.float32) * (hd ** -0.5)
            probs = mx.softmax(scores, axis=-1).astype(x.dtype)
            out[idx.reshape(-1)] = (probs @ vw).transpose(0, 2, 1, 3).reshape(-1, heads, hd)
        return self.linear(out.reshape(n, -1), f"{prefix}.attn.proj")

    def __call__(self, pixels, grid: tuple[int, int]) -> mx.array:
        """``pixels (gh·gw, 588)`` → ``(gh·gw/4, text_hidden)`` normed rows."""
        gh, gw = grid
        c = self.config
        pixels = mx.array(np.asarray(pixels, dtype=np.float32))
        if gh % c.merge_size or gw % c.merge_size or tuple(pixels.shape) != (gh * gw, 3 * c.patch_size ** 2):
            raise ValueError(f"image pixels {tuple(pixels.shape)} do not fit the patch grid {gh}x{gw}")
        w = self.w
        x = pixels.astype(self.dtype) @ w["patch_embedding.weight"].T
        x = x + self.positions(gh, gw).astype(x.dtype)
        x = layer_norm(x, w["ln_pre.weight"], w["ln_pre.bias"], c.layer_norm_eps)
        rope = self.rope(gh, gw)
        windows = window_groups(gh, gw, c.pos_side)
        whole = [np.arange(gh * gw)[None]]
        for i in range(c.num_layers):
            p = f"layers.{i}"
            a = layer_norm(x, w[f"{p}.norm1.weight"], w[f"{p}.norm1.bias"], 1e-5)  # fixed in transformers
            x = x + self.attention(a, p, rope, whole if c.full[i] else windows)
            m = layer_norm(x, w[f"{p}.norm2.weight"], w[f"{p}.norm2.bias"], 1e-5)
            x = x + self.linear(gelu(self.linear(m, f"{p}.mlp.fc1")), f"{p}.mlp.fc2")
        x = layer_norm(x, w["ln_post.weight"], w["ln_post.bias"], c.layer_norm_eps)
        # pixel shuffle: 2x2 groups row-major over the merged grid, out[d·4 + k] = x_k[d]
        s = c.merge_size
        x = x.reshape(gh // s, s, gw // s, s, -1).transpose(0, 2, 4, 1, 3).reshape(gh * gw // (s * s), -1)
        y = gelu(self.linear(gelu(self.linear(x, "adapter.fc1", bias=False)), "adapter.fc2", bias=False))
        z = self.linear(y, "projection", bias=False)
        zf = z.astype(mx.float32)
        return (zf * mx.power(mx.mean(zf * zf, axis=-1, keepdims=True) + self.text_eps, -0.5)).astype(z.dtype)


def load_vision_encoder(weights, text_config, dtype: mx.Dtype) -> VisionEncoder:
    """A :class:`VisionEncoder` filled from opened vision weights; the perception norm
    takes the text model's ``rms_norm_eps``."""
    config = weights.config
    if config.text_hidden_size != text_config.hidden_size:
        raise ValueError(f"the vision projection writes {config.text_hidden_size}-wide rows; the text model's "
                         f"hidden size is {text_config.hidden_size}")
    encoder = VisionEncoder(config, text_config.rms_norm_eps, dtype)
    encoder.load(weights)
    return encoder
