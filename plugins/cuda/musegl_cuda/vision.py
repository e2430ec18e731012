"""The Muse Glimmer vision tower, pixel shuffle, adapter and projection in PyTorch.

:class:`VisionEncoder` turns one preprocessed image (patch rows of one frame,
``(gh·gw, 588)``, raster order; :mod:`musegl_core.vision.preprocess`) into
``gh·gw/4`` decoder input rows, already perception-normed. Weights come from
:mod:`musegl_core.checkpoint.vision` (Hugging Face or mmproj GGUF, same names).

Numerics follow transformers: LayerNorms through ``F.layer_norm``, the axial
2-D RoPE with cos/sin cast to the activation dtype and the rotation in
float32, softmax attention through SDPA (non-causal), exact-erf GELU, the
perception norm in float32 with the ``pow`` form. Window layers attend
within ``pos_side x pos_side``-patch windows (grouped by window size and run
batched), full layers over the whole image; the patch order stays raster
throughout, which is mathematically the same as transformers' window
reordering.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from musegl_core.checkpoint.vision import VisionConfig, vision_weight_names


class _Linear(nn.Module):
    """A linear layer filled by the loader (no random init)."""

    def __init__(self, inp: int, out: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, inp, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, c: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads, self.head_dim = c.num_heads, c.head_dim
        self.q_proj = _Linear(h, h, True, dtype, device)
        self.k_proj = _Linear(h, h, True, dtype, device)
        self.v_proj = _Linear(h, h, True, dtype, device)
        self.proj = _Linear(h, h, True, dtype, device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                groups: list[torch.Tensor]) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.heads, self.head_dim)
        v = self.v_proj(x).view(n, self.heads, self.head_dim)
        cos, sin = (t.float()[:, None, :] for t in rope)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = torch.empty_like(q)
        for index in groups:  # (windows, length): windows of one size, run as one batch
            qw, kw, vw = (t[index].transpose(1, 2) for t in (q, k, v))  # (windows, heads, length, hd)
            y = F.scaled_dot_product_attention(qw, kw, vw)
            out[index] = y.transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class _Layer(nn.Module):
    def __init__(self, c: VisionConfig, layer: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.full = c.full[layer]
        self.norm1 = _LayerNorm(c.hidden_size, 1e-5, dtype, device)  # fixed in transformers
        self.norm2 = _LayerNorm(c.hidden_size, 1e-5, dtype, device)
        self.attn = _Attention(c, dtype, device)
        self.fc1 = _Linear(c.hidden_size, c.intermediate_size, True, dtype, device)
        self.fc2 = _Linear(c.intermediate_size, c.hidden_size, True, dtype, device)

    def forward(self, x: torch.Tensor, rope, windows, whole) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, whole if self.full else windows)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def window_groups(gh: int, gw: int, side: int, device: torch.device) -> list[torch.Tensor]:
    """Raster patch indices of each ``side x side`` window (from the top-left, edge
    windows smaller), grouped by window shape: one ``(windows, length)`` tensor per shape."""
    grid = torch.arange(gh * gw, device=device).view(gh, gw)
    shapes: dict[tuple[int, int], list[torch.Tensor]] = {}
    for r in range(0, gh, side):
        for c in range(0, gw, side):
            block = grid[r:r + side, c:c + side]
            shapes.setdefault(tuple(block.shape), []).append(block.reshape(-1))
    return [torch.stack(blocks) for blocks in shapes.values()]


def position_taps(n: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps and weights (float32) resampling ``side`` table rows to ``n``
    outputs like ``grid_sample(align_corners=False, padding_mode="zeros")``:
    out-of-range taps get weight 0 (no clamping, no renormalization)."""
    index = torch.arange(n, device=device, dtype=torch.float32)
    src = (index + 0.5) * side / n - 0.5
    floor = torch.floor(src)
    raw = floor.long()[:, None] + torch.arange(2, device=device)
    weights = (1 - (src[:, None] - floor[:, None] - torch.arange(2, device=device)).abs()).clamp(min=0)
    weights = weights * ((raw >= 0) & (raw <= side - 1))
    return raw.clamp(0, side - 1), weights


class VisionEncoder(nn.Module):
    """Vision tower + pixel shuffle + adapter + projection + perception norm."""

    def __init__(self, config: VisionConfig, text_eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = self.config = config
        self.text_eps = text_eps
        self.dtype = dtype
        h = c.hidden_size
        self.patch_embedding = _Linear(3 * c.patch_size ** 2, h, False, dtype, device)
        self.position_embedding = nn.Parameter(torch.empty(c.pos_side ** 2, h, dtype=dtype, device=device),
                                               requires_grad=False)
        self.ln_pre = _LayerNorm(h, c.layer_norm_eps, dtype, device)
        self.layers = nn.ModuleList(_Layer(c, i, dtype, device) for i in range(c.num_layers))
        self.ln_post = _LayerNorm(h, c.layer_norm_eps, dtype, device)
        self.adapter_fc1 = _Linear(c.out_hidden_size, c.projector_hidden_size, False, dtype, device)
        self.adapter_fc2 = _Linear(c.projector_hidden_size, c.projector_hidden_size, False, dtype, device)
        self.projection = _Linear(c.projector_hidden_size, c.text_hidden_size, False, dtype, device)
        quarter = c.head_dim // 4
        spatial = c.head_dim // 2
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device) / spatial))
        assert inv.numel() == quarter
        self.register_buffer("inv_freq", inv, persistent=False)

    # -- loading --------------------------------------------------------------------------------
    _TOP = {"patch_embedding.weight": "patch_embedding.weight", "ln_pre.weight": "ln_pre.weight",
            "ln_pre.bias": "ln_pre.bias", "ln_post.weight": "ln_post.weight", "ln_post.bias": "ln_post.bias",
            "adapter.fc1.weight": "adapter_fc1.weight", "adapter.fc2.weight": "adapter_fc2.weight",
            "projection.weight": "projection.weight", "position_embedding.weight": "position_embedding"}

    def load_weight(self, name: str, value: torch.Tensor) -> None:
        if name.startswith("layers."):
            _, index, suffix = name.split(".", 2)
            target = suffix.replace("mlp.", "")
            module: nn.Module = self.layers[int(index)]
        else:
            target, module = self._TOP[name], self
        *path, leaf = target.split(".")
        for part in path:
            module = getattr(module, part)
        getattr(module, leaf).copy_(value)

    @staticmethod
    def weight_names(config: VisionConfig) -> tuple[str, ...]:
        return vision_weight_names(config)

    # -- forward --------------------------------------------------------------------------------
    def positions(self, gh: int, gw: int) -> torch.Tensor:
        """The learned position rows resampled to the ``gh x gw`` grid, raster order."""
        side, device = self.config.pos_side, self.position_embedding.device
        h_taps, h_w = position_taps(gh, side, device)
        w_taps, w_w = position_taps(gw, side, device)
        index = (h_taps[:, None, :, None] * side + w_taps[None, :, None, :]).reshape(gh * gw, 4)
        weight = (h_w[:, None, :, None] * w_w[None, :, None, :]).reshape(gh * gw, 4)
        return (self.position_embedding[index] * weight[:, :, None]).sum(1)

    def rope(self, gh: int, gw: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``(gh·gw, head_dim)``: ``[w·inv | h·inv | w·inv | h·inv]``, 1-indexed positions."""
        device = self.inv_freq.device
        rows = torch.arange(gh, device=device).repeat_interleave(gw) + 1
        cols = torch.arange(gw, device=device).repeat(gh) + 1
        fw = cols[:, None].float() * self.inv_freq
        fh = rows[:, None].float() * self.inv_freq
        angles = torch.cat((fw, fh, fw, fh), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """``pixels (gh·gw, 588)`` float32 → ``(gh·gw/4, text_hidden)`` normed rows."""
        gh, gw = grid
        c = self.config
        if gh % c.merge_size or gw % c.merge_size or pixels.shape != (gh * gw, 3 * c.patch_size ** 2):
            raise ValueError(f"image pixels {tuple(pixels.shape)} do not fit the patch grid {gh}x{gw}")
        x = self.patch_embedding(pixels.to(self.dtype))
        x = x + self.positions(gh, gw).to(x.dtype)
        x = self.ln_pre(x)
        rope = self.rope(gh, gw, x.dtype)
        windows = window_groups(gh, gw, c.pos_side, x.device)
        whole = [torch.arange(gh * gw, device=x.device)[None]]
        for layer in self.layers:
            x = layer(x, rope, windows, whole)
        x = self.ln_post(x)
        # pixel shuffle: 2x2 groups row-major over the merged grid, out[d·4 + k] = x_k[d]
        m = c.merge_size
        x = x.view(gh // m, m, gw // m, m, -1).permute(0, 2, 4, 1, 3).reshape(gh * gw // (m * m), -1)
        y = F.gelu(self.adapter_fc2(F.gelu(self.adapter_fc1(x))))
        z = self.projection(y)
        zf = z.float()
        return (zf * torch.pow(zf.pow(2).mean(-1, keepdim=True) + self.text_eps, -0.5)).to(z.dtype)


def load_vision_encoder(weights, text_config, dtype: torch.dtype, device: torch.device) -> VisionEncoder:
    """A :class:`VisionEncoder` filled from opened vision weights
    (:mod:`musegl_core.checkpoint.vision`); the perception norm takes the text
    model's ``rms_norm_eps``."""
    config = weights.config
    if config.text_hidden_size != text_config.hidden_size:
        raise ValueError(f"the vision projection writes {config.text_hidden_size}-wide rows; the text model's "
                         f"hidden size is {text_config.hidden_size}")
    with torch.inference_mode():
        encoder = VisionEncoder(config, text_config.rms_norm_eps, dtype, device)
        for name, array in weights.iter_weights():
            encoder.load_weight(name, torch.from_numpy(array))
    return encoder.eval()
