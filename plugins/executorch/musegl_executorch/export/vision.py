"""The vision tower as an exportable graph (``vision_encoder``) and the host-side
inputs that describe an image's patch grid.

The eager tower (:class:`musegl_cuda.vision.VisionEncoder`) builds its window
groups, position taps and RoPE angles from the grid in Python. The exported
method cannot loop over a grid it does not know, so the host computes those
grid-only tensors (:func:`grid_inputs`) and the graph takes them as inputs;
window layers attend over the whole image with a bias that hides keys outside
the query's window (``-inf``: softmax gives them exactly zero weight, so this
is the same attention as per-window SDPA up to float rounding order).

``vision_encoder`` inputs (``N`` patches, ``M = N / 4`` merged rows):

==================  =================  ==============================================
``pixels``          ``(N, 588)`` f32   the preprocessing's patch rows, raster order
``pos_index``       ``(N, 4)`` int64   position-table rows of each patch's 4 taps
``pos_weight``      ``(N, 4)`` f32     their bilinear weights (0 outside the table)
``cos``, ``sin``    ``(N, hd)`` f32    the axial 2-D RoPE of every patch
``window_bias``     ``(N, N)`` f32     0 inside the query's window, -inf outside
``shuffle``         ``(M, 4)`` int64   the 4 patches (2x2, row-major) of each merged row
==================  =================  ==============================================

Output: ``(M, text_hidden)`` decoder input rows, perception-normed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from musegl_core.checkpoint.vision import VisionConfig

VISION_INPUTS = ("pixels", "pos_index", "pos_weight", "cos", "sin", "window_bias", "shuffle")


class ExportVisionEncoder(nn.Module):
    """The weights of a loaded :class:`musegl_cuda.vision.VisionEncoder` behind the
    grid-as-inputs forward above (the same arithmetic, per patch)."""

    def __init__(self, eager) -> None:
        super().__init__()
        self.config: VisionConfig = eager.config
        self.text_eps = eager.text_eps
        self.vision = eager  # its parameters, under vision.* names in the data file
        self.requires_grad_(False)

    def forward(self, pixels, pos_index, pos_weight, cos, sin, window_bias, shuffle):
        v, c = self.vision, self.config
        x = v.patch_embedding(pixels.to(v.dtype))
        pos = (F.embedding(pos_index, v.position_embedding) * pos_weight[:, :, None]).sum(1)
        x = v.ln_pre(x + pos.to(x.dtype))
        n, heads, hd = x.shape[0], c.num_heads, c.head_dim
        cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]
        for layer in v.layers:
            a = layer.norm1(x)
            att = layer.attn
            q = att.q_proj(a).reshape(n, heads, hd).float()
            k = att.k_proj(a).reshape(n, heads, hd).float()
            val = att.v_proj(a).reshape(n, heads, hd)
            q = (q * cos + _rotate_half(q) * sin).to(x.dtype).permute(1, 0, 2)  # (heads, N, hd)
            k = (k * cos + _rotate_half(k) * sin).to(x.dtype).permute(1, 0, 2)
            scores = torch.matmul(q, k.transpose(1, 2)) * (hd ** -0.5)
            if not layer.full:
                scores = scores + window_bias[None].to(scores.dtype)
            probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
            y = torch.matmul(probs, val.permute(1, 0, 2)).permute(1, 0, 2).reshape(n, heads * hd)
            x = x + att.proj(y)
            x = x + layer.fc2(F.gelu(layer.fc1(layer.norm2(x))))
        x = v.ln_post(x)
        merged = shuffle.shape[0]
        x = torch.index_select(x, 0, shuffle.reshape(-1)).reshape(merged, 4, -1).transpose(1, 2)
        x = x.reshape(merged, -1)
        y = F.gelu(v.adapter_fc2(F.gelu(v.adapter_fc1(x))))
        z = v.projection(y)
        zf = z.float()
        return (zf * torch.pow(zf.pow(2).mean(-1, keepdim=True) + self.text_eps, -0.5)).to(z.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def grid_inputs(config: VisionConfig, grid: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """(pos_index, pos_weight, cos, sin, window_bias, shuffle) of a ``gh x gw`` patch grid:
    the eager tower's own grid computations (:mod:`musegl_cuda.vision`), as tensors."""
    from musegl_cuda.vision import position_taps, window_groups

    gh, gw = grid
    m, side = config.merge_size, config.pos_side
    cpu = torch.device("cpu")
    h_taps, h_w = position_taps(gh, side, cpu)
    w_taps, w_w = position_taps(gw, side, cpu)
    pos_index = (h_taps[:, None, :, None] * side + w_taps[None, :, None, :]).reshape(gh * gw, 4)
    pos_weight = (h_w[:, None, :, None] * w_w[None, :, None, :]).reshape(gh * gw, 4)
    spatial = config.head_dim // 2
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
    rows = torch.arange(gh).repeat_interleave(gw) + 1
    cols = torch.arange(gw).repeat(gh) + 1
    fw, fh = cols[:, None].float() * inv, rows[:, None].float() * inv
    angles = torch.cat((fw, fh, fw, fh), dim=-1)
    n = gh * gw
    window = torch.empty(n, dtype=torch.long)
    for number, index in enumerate(block for group in window_groups(gh, gw, side, cpu) for block in group):
        window[index] = number
    bias = torch.where(window[:, None] == window[None, :], 0.0, float("-inf")).to(torch.float32)
    grid_ids = torch.arange(n).view(gh // m, m, gw // m, m).permute(0, 2, 1, 3).reshape(n // (m * m), m * m)
    return pos_index, pos_weight.float(), angles.cos(), angles.sin(), bias, grid_ids


def example_vision_inputs(config: VisionConfig, grid: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    n = grid[0] * grid[1]
    return (torch.zeros(n, 3 * config.patch_size ** 2),) + grid_inputs(config, grid)
