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
``windows``         ``(W, S)`` int64   each window's patches (``S = side²``; padding: 0)
``window_keys``     ``(W, S)`` f32     0 for a real patch, -inf for padding
``unwindow``        ``(N,)`` int64     each patch's row ``w·S + s`` in the window batch
``shuffle``         ``(M, 4)`` int64   the 4 patches (2x2, row-major) of each merged row
==================  =================  ==============================================

Output: ``(M, text_hidden)`` decoder input rows, perception-normed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from musegl_core.checkpoint.vision import VisionConfig

from musegl_executorch.artifact import VISION_INPUTS  # noqa: F401  (the names, in this order)


class ExportVisionEncoder(nn.Module):
    """The weights of a loaded :class:`musegl_cuda.vision.VisionEncoder` behind the
    grid-as-inputs forward above (the same arithmetic, per patch)."""

    def __init__(self, eager) -> None:
        super().__init__()
        self.config: VisionConfig = eager.config
        self.text_eps = eager.text_eps
        self.vision = eager  # its parameters, under vision.* names in the data file
        self.requires_grad_(False)

    def forward(self, pixels, pos_index, pos_weight, cos, sin, windows, window_keys, unwindow, shuffle):
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
            q = (q * cos + _rotate_half(q) * sin).to(x.dtype)
            k = (k * cos + _rotate_half(k) * sin).to(x.dtype)
            if layer.full:
                q, k, val = q.permute(1, 0, 2), k.permute(1, 0, 2), val.permute(1, 0, 2)  # (heads, N, hd)
                scores = torch.matmul(q, k.transpose(1, 2)) * (hd ** -0.5)
                probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
                y = torch.matmul(probs, val).permute(1, 0, 2).reshape(n, heads * hd)
            else:
                count, size = windows.shape[0], windows.shape[1]
                at = windows.reshape(-1)
                q, k, val = (torch.index_select(t, 0, at).reshape(count, size, heads, hd).permute(0, 2, 1, 3)
                             for t in (q, k, val))  # (W, heads, S, hd)
                scores = torch.matmul(q, k.transpose(2, 3)) * (hd ** -0.5)
                scores = scores.float() + window_keys[:, None, None, :]
                probs = torch.softmax(scores, dim=-1).to(x.dtype)
                y = torch.matmul(probs, val).permute(0, 2, 1, 3).reshape(count * size, heads * hd)
                y = torch.index_select(y, 0, unwindow)
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
    """(pos_index, pos_weight, cos, sin, windows, window_keys, unwindow, shuffle) of a
    ``gh x gw`` patch grid: the eager tower's own grid computations
    (:mod:`musegl_cuda.vision`), as tensors."""
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
    size = side * side
    blocks = [block for group in window_groups(gh, gw, side, cpu) for block in group]
    windows = torch.zeros(len(blocks), size, dtype=torch.long)
    keys = torch.full((len(blocks), size), float("-inf"), dtype=torch.float32)
    unwindow = torch.empty(n, dtype=torch.long)
    for number, index in enumerate(blocks):
        windows[number, :len(index)] = index
        keys[number, :len(index)] = 0.0
        unwindow[index] = number * size + torch.arange(len(index))
    grid_ids = torch.arange(n).view(gh // m, m, gw // m, m).permute(0, 2, 1, 3).reshape(n // (m * m), m * m)
    return pos_index, pos_weight.float(), angles.cos(), angles.sin(), windows, keys, unwindow, grid_ids


def most_windows(side: int, max_patches: int) -> int:
    """The most ``side x side`` windows (edge windows included) of any even ``gh x gw``
    grid of at most ``max_patches`` patches: the bound of the window axis."""
    best = 1
    for gh in range(2, max_patches // 2 + 1, 2):
        gw = (max_patches // gh) // 2 * 2
        if gw >= 2:
            best = max(best, -(-gh // side) * -(-gw // side))
    return best


def example_vision_inputs(config: VisionConfig, grid: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    n = grid[0] * grid[1]
    return (torch.zeros(n, 3 * config.patch_size ** 2),) + grid_inputs(config, grid)
