"""The DFlash draft as two exportable methods over an off-graph context store.

The eager draft (:mod:`musegl_dflash.model`) keeps its context K/V in the
engine's block ids; the program does the same with the pool outside the graph,
as the target does (``docs/executorch.md``, "The off-graph ABI"):

* ``draft_context``: committed target rows to each draft layer's context K/V.
  ``features (N, taps·hidden)`` (the tapped target rows, concatenated per row)
  and ``positions (N,)`` give ``k``, ``v (draft_layers, N, kv_heads, head_dim)``,
  which the host writes at the rows' cells of its draft pool;
* ``draft_block``: ``owners`` blocks ``[anchor, MASK × n]`` drafted in one call.
  ``ids (B, R)`` and ``positions (B, R)`` (the block at ``P .. P+n``), the draft
  pool ``dk_pool``/``dv_pool (draft_layers, C, kv_heads, head_dim)``,
  ``context_slots (B, S)`` (cells of the context keys each block may see) and two
  biases ``full_bias``/``window_bias (B, R, S)`` (0 visible, -inf hidden: padding,
  and on sliding layers the keys beyond ``|p − j| <= window``) and ``mask_rows
  (M,)`` (the rows ``b·R + r`` to draft from, ``r >= 1``) give ``drafts (M,)``
  int64, the argmax of the target's raw head over those final-normed rows
  (the rows are an input because an axis ``R − 1`` cannot be exported for
  ``R = 2``). The block rows see each other (non-causal; the window
  between them is derived from ``positions`` in the graph). ``B`` is 1 .. the
  exported ``max_owners`` and ``R`` is 2 .. the draft's block size, so
  ``--dflash-n-draft`` is chosen at serve time without a re-export.

The draft has no embedding table and no head: ``draft_block`` holds the target
decoder's ``embed_tokens`` and ``lm_head`` modules under their own names, so
the data file stores them once for every method. Numerics follow the eager
draft: Llama-style RMS norms (float32 normalisation, cast back, then the
weight), RoPE tables built in float32 and cast to the activation dtype,
softmax in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from musegl_executorch.export.graph import OffGraphDecoder, rotate_half

CONTEXT_INPUTS = ("features", "positions")
CONTEXT_OUTPUTS = ("k", "v")
BLOCK_INPUTS = ("ids", "positions", "dk_pool", "dv_pool", "context_slots", "full_bias", "window_bias", "mask_rows")
BLOCK_OUTPUTS = ("drafts",)


def llama_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w · cast(x_f32 · rsqrt(mean(x_f32²) + ε))`` (the weight multiplies after the cast)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class DraftLayer(nn.Module):
    """One draft layer's weights as ``nn.Linear`` modules (the XNNPACK partitioner takes them)."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        h, hd, f = config.hidden_size, config.head_dim, config.intermediate_size
        q, kv = config.num_heads * hd, config.num_kv_heads * hd
        self.q_proj = nn.Linear(h, q, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(h, kv, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(h, kv, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(q, h, bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(h, f, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, f, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(f, h, bias=False, dtype=dtype)
        for name, size in (("input_layernorm", h), ("q_norm", hd), ("k_norm", hd), ("post_attention_layernorm", h)):
            self.register_buffer(name, torch.ones(size, dtype=dtype))


class DraftWeights(nn.Module):
    """The draft's own weights (``encoder.fc``, the encoder norm, the layers, the final norm)."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False,
                            dtype=dtype)
        self.register_buffer("encoder_norm", torch.ones(config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DraftLayer(config, dtype) for _ in range(config.num_layers))
        self.register_buffer("norm", torch.ones(config.hidden_size, dtype=dtype))
        hd = config.head_dim
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)))
        self.requires_grad_(False)

    @classmethod
    def from_draft(cls, draft, dtype: torch.dtype) -> "DraftWeights":
        """The weights of a loaded :class:`musegl_dflash.model.DFlashDraft`."""
        module = cls(draft.config, dtype)
        with torch.no_grad():
            module.fc.weight.copy_(draft.w("encoder.fc.weight"))
            module.encoder_norm.copy_(draft.w("encoder.output_norm_enc.weight"))
            module.norm.copy_(draft.w("norm.weight"))
            for i, layer in enumerate(module.layers):
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    getattr(layer, name).weight.copy_(draft.layer(i, f"self_attn.{name}"))
                for name in ("gate_proj", "up_proj", "down_proj"):
                    getattr(layer, name).weight.copy_(draft.layer(i, f"mlp.{name}"))
                layer.q_norm.copy_(draft.layer(i, "self_attn.q_norm"))
                layer.k_norm.copy_(draft.layer(i, "self_attn.k_norm"))
                layer.input_layernorm.copy_(draft.layer(i, "input_layernorm"))
                layer.post_attention_layernorm.copy_(draft.layer(i, "post_attention_layernorm"))
        return module.eval()

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)


class DraftContext(nn.Module):
    """``draft_context``: see the module docstring."""

    def __init__(self, weights: DraftWeights) -> None:
        super().__init__()
        self.draft = weights

    def forward(self, features, positions):
        d, c = self.draft, self.draft.config
        g = llama_norm(d.fc(features.to(d.dtype)), d.encoder_norm, c.rms_norm_eps)
        cos, sin = d.rope(positions)
        ks, vs = [], []
        for layer in d.layers:
            k = layer.k_proj(g).reshape(-1, c.num_kv_heads, c.head_dim)
            v = layer.v_proj(g).reshape(-1, c.num_kv_heads, c.head_dim)
            k = llama_norm(k, layer.k_norm, c.rms_norm_eps)
            ks.append(k * cos[:, None, :] + rotate_half(k) * sin[:, None, :])
            vs.append(v)
        return torch.stack(ks), torch.stack(vs)


class DraftBlock(nn.Module):
    """``draft_block``: see the module docstring. Holds the target's ``embed_tokens``
    and ``lm_head`` under the decoder's names (stored once in the data file)."""

    def __init__(self, weights: DraftWeights, target: OffGraphDecoder) -> None:
        super().__init__()
        self.draft = weights
        self.embed_tokens = target.embed_tokens
        self.lm_head = target.lm_head

    def forward(self, ids, positions, dk_pool, dv_pool, context_slots, full_bias, window_bias, mask_rows):
        d, c = self.draft, self.draft.config
        blocks, rows = ids.shape[0], ids.shape[1]
        cached = context_slots.shape[1]
        h = self.embed_tokens(ids.reshape(-1)).to(d.dtype)  # raw rows (no embedding norm)
        cos, sin = d.rope(positions.reshape(-1))
        window = c.sliding_window if c.sliding_window is not None else 0
        distance = (positions[:, :, None] - positions[:, None, :]).abs()  # (B, R, R)
        blocked = torch.full_like(distance, 0, dtype=torch.float32) - float("inf")
        open_ = torch.zeros_like(blocked)
        own_window = torch.where(distance <= window, open_, blocked)
        sliding_bias = torch.cat([window_bias, own_window], dim=-1)
        full = torch.cat([full_bias, open_], dim=-1)
        group = c.num_heads // c.num_kv_heads
        cells = dk_pool.shape[1]
        k_flat = dk_pool.reshape(-1, c.num_kv_heads, c.head_dim)
        v_flat = dv_pool.reshape(-1, c.num_kv_heads, c.head_dim)
        flat_slots = context_slots.reshape(-1)
        for i, layer in enumerate(d.layers):
            a = llama_norm(h, layer.input_layernorm, c.rms_norm_eps)
            q = layer.q_proj(a).reshape(-1, c.num_heads, c.head_dim)
            k = layer.k_proj(a).reshape(-1, c.num_kv_heads, c.head_dim)
            v = layer.v_proj(a).reshape(-1, c.num_kv_heads, c.head_dim)
            q = llama_norm(q, layer.q_norm, c.rms_norm_eps)
            k = llama_norm(k, layer.k_norm, c.rms_norm_eps)
            q = q * cos[:, None, :] + rotate_half(q) * sin[:, None, :]
            k = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
            at = flat_slots + i * cells
            ctx_k = torch.index_select(k_flat, 0, at).reshape(blocks, cached, c.num_kv_heads, c.head_dim)
            ctx_v = torch.index_select(v_flat, 0, at).reshape(blocks, cached, c.num_kv_heads, c.head_dim)
            keys = torch.cat([ctx_k.to(d.dtype), k.reshape(blocks, rows, c.num_kv_heads, c.head_dim)], dim=1)
            values = torch.cat([ctx_v.to(d.dtype), v.reshape(blocks, rows, c.num_kv_heads, c.head_dim)], dim=1)
            # (B, kvh, group·R, hd) @ (B, kvh, hd, S+R): GQA without repeating K/V
            qm = q.reshape(blocks, rows, c.num_kv_heads, group, c.head_dim).permute(0, 2, 3, 1, 4)
            qm = qm.reshape(blocks, c.num_kv_heads, group * rows, c.head_dim)
            scores = torch.matmul(qm, keys.permute(0, 2, 3, 1)) * (c.head_dim ** -0.5)
            bias = sliding_bias if c.sliding[i] else full
            scores = scores.reshape(blocks, c.num_kv_heads, group, rows, -1).float() + bias[:, None, None]
            probs = torch.softmax(scores, dim=-1).to(d.dtype).reshape(blocks, c.num_kv_heads, group * rows, -1)
            out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # (B, kvh, group·R, hd)
            out = out.reshape(blocks, c.num_kv_heads, group, rows, c.head_dim).permute(0, 3, 1, 2, 4)
            h = h + layer.o_proj(out.reshape(blocks * rows, -1))
            f = llama_norm(h, layer.post_attention_layernorm, c.rms_norm_eps)
            h = h + layer.down_proj(F.silu(layer.gate_proj(f)) * layer.up_proj(f))
        normed = llama_norm(torch.index_select(h, 0, mask_rows), d.norm, c.rms_norm_eps)
        logits = self.lm_head(normed)  # the raw head: no multiplier, no softcap
        return torch.argmax(logits.float(), dim=-1)
