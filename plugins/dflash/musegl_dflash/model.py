"""The DFlash draft model in PyTorch, over a paged context store.

The draft has two entry points, both batched over sequences:

* :meth:`DFlashDraft.write_context` turns committed target rows (their
  concatenated tapped hidden states) into each draft layer's context K/V —
  ``g = RMS_enc(fc(c))``, ``k = k_norm(Wk g)`` rotated at the target
  position, ``v = Wv g`` — and stores them in cache slots
  (``block·block_size + offset``), as the target stores its own K/V;
* :meth:`DFlashDraft.draft` denoises one block ``[anchor, MASK × n]`` per
  sequence in one forward: queries, keys and values of the block rows come
  from the block itself, the context keys from the store; attention is
  non-causal within the block and transformers' bidirectional sliding window
  (``|p − j| ≤ window``) applies on sliding layers. The final-normed mask rows
  go through the target's raw lm_head (no softcap) and the argmax is the draft.

Numerics follow transformers' ``MuseGlimmerAssistantModel``: Llama-style RMS
norms (float32 normalisation, cast back, then the weight), cos/sin built in
float32 and cast to the activation dtype, softmax in float32.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from musegl_dflash.checkpoint import DraftConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w · cast(x_f32 · rsqrt(mean(x_f32²) + ε))``: the weight multiplies after the cast back."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W^T``; on the CPU with few rows ``(W @ x^T)^T`` picks a much faster BLAS kernel."""
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= 32:
        return (weight @ x.t()).t()
    return F.linear(x, weight)


@attrs.define
class DraftBatch:
    """One draft forward: ``B`` sequences, ``R = n + 1`` block rows each.

    ``anchors``/``starts``: each sequence's last committed token and its
    position ``P`` (the block sits at ``P .. P+n``). ``context_slots``
    ``(B, S)`` are the cache slots of the context keys the block may see,
    ``context_positions`` their positions and ``context_valid`` which of the
    ``S`` entries are real (sequences have different context lengths).
    """

    anchors: torch.Tensor
    starts: torch.Tensor
    context_slots: torch.Tensor
    context_positions: torch.Tensor
    context_valid: torch.Tensor


class DFlashDraft(nn.Module):
    """The assistant model's weights and its two batched forwards."""

    def __init__(self, config: DraftConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.weights: dict[str, torch.Tensor] = {}
        hd = config.head_dim
        exponent = torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd
        self.inv_freq = 1.0 / (config.rope_theta ** exponent)
        self._context_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # (see context_weights)

    # -- loading ------------------------------------------------------------------------
    def load_weight(self, name: str, value: torch.Tensor) -> None:
        self.weights[name] = value.to(self.device, self.dtype).contiguous()
        self._context_weights = None

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def layer(self, i: int, suffix: str) -> torch.Tensor:
        return self.weights[f"layers.{i}.{suffix}.weight"]

    # -- pieces ---------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``positions.shape + (head_dim,)`` in the model dtype."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """``g = RMS_enc(c · Wfc^T)`` for context features ``(rows, taps·H)``."""
        c = self.config
        g = linear(features.to(self.dtype), self.w("encoder.fc.weight"))
        return rms_norm(g, self.w("encoder.output_norm_enc.weight"), c.rms_norm_eps)

    def context_kv(self, i: int, g: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K (normed, rotated) and V of projected context rows ``g``."""
        c = self.config
        k = linear(g, self.layer(i, "self_attn.k_proj")).view(-1, c.num_kv_heads, c.head_dim)
        v = linear(g, self.layer(i, "self_attn.v_proj")).view(-1, c.num_kv_heads, c.head_dim)
        k = rms_norm(k, self.layer(i, "self_attn.k_norm"), c.rms_norm_eps)
        k = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
        return k, v

    # -- the context store -------------------------------------------------------------
    def context_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's K and V projections as one matrix ``(layers·2·kv_heads·head_dim, H)``
        and their K norms ``(layers, head_dim)``, made once from the loaded weights: the
        context rows of a step go through all layers in one product."""
        if self._context_weights is None:
            layers = range(self.config.num_layers)
            w = torch.cat([torch.cat((self.layer(i, "self_attn.k_proj"), self.layer(i, "self_attn.v_proj")))
                           for i in layers])
            self._context_weights = (w, torch.stack([self.layer(i, "self_attn.k_norm") for i in layers]))
        return self._context_weights

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      kv: torch.Tensor) -> None:
        """Store the context K/V of committed rows: ``features (rows, taps·H)`` at
        ``positions`` into ``slots`` of ``kv (layers, 2, slots_total, kv_heads, head_dim)``.
        Every layer at once (a dozen kernels a step, where a loop over the layers launched
        ~15 per layer: at batch 1 on an H200 the loop took ~3 ms of host time a verify block):
        the same values as :meth:`context_kv` layer by layer."""
        c = self.config
        g = self.project_context(features)
        cos, sin = self.rope(positions)
        w, k_norms = self.context_weights()
        both = linear(g, w).view(g.shape[0], c.num_layers, 2, c.num_kv_heads, c.head_dim)
        k = rms_norm(both[:, :, 0], k_norms[:, None, :], c.rms_norm_eps)  # (rows, layers, kv_heads, hd)
        k = k * cos[:, None, None, :] + rotate_half(k) * sin[:, None, None, :]
        new = torch.stack((k, both[:, :, 1]), dim=2)  # (rows, layers, 2, kv_heads, hd)
        kv.index_copy_(2, slots, new.permute(1, 2, 0, 3, 4).to(kv.dtype))

    # -- drafting ----------------------------------------------------------------------------
    def masks(self, batch: DraftBatch, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(full, sliding)`` visibility masks ``(B, R, S + R)`` of the block queries."""
        q_pos = batch.starts[:, None] + torch.arange(rows, device=self.device)  # (B, R)
        k_pos = torch.cat([batch.context_positions, q_pos], dim=1)  # (B, S+R)
        valid = torch.cat([batch.context_valid, torch.ones_like(q_pos, dtype=torch.bool)], dim=1)
        full = valid[:, None, :].expand(-1, rows, -1)
        window = self.config.sliding_window
        if window is None:
            return full, full
        near = (q_pos[:, :, None] - k_pos[:, None, :]).abs() <= window
        return full, full & near

    def hidden(self, embeddings: torch.Tensor, batch: DraftBatch, kv: torch.Tensor,
               context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Final-normed block rows ``(B, R, H)`` for the raw target embeddings of the
        block ids ``(B, R, H)``. The context K/V come from ``kv`` at the batch's slots,
        or, when ``context`` (per layer ``(B, S, kv_heads, hd)`` K and V stacked as
        ``(layers, 2, ...)``) is given, from it directly."""
        c = self.config
        b, r, _ = embeddings.shape
        h = embeddings.to(self.dtype)
        q_pos = batch.starts[:, None] + torch.arange(r, device=self.device)
        cos, sin = self.rope(q_pos)  # (B, R, hd)
        full, sliding = self.masks(batch, r)
        group = c.num_heads // c.num_kv_heads
        for i in range(c.num_layers):
            a = rms_norm(h, self.layer(i, "input_layernorm"), c.rms_norm_eps)
            flat = a.reshape(b * r, -1)
            q = linear(flat, self.layer(i, "self_attn.q_proj")).view(b, r, c.num_heads, c.head_dim)
            k = linear(flat, self.layer(i, "self_attn.k_proj")).view(b, r, c.num_kv_heads, c.head_dim)
            v = linear(flat, self.layer(i, "self_attn.v_proj")).view(b, r, c.num_kv_heads, c.head_dim)
            q = rms_norm(q, self.layer(i, "self_attn.q_norm"), c.rms_norm_eps)
            k = rms_norm(k, self.layer(i, "self_attn.k_norm"), c.rms_norm_eps)
            q = q * cos[:, :, None, :] + rotate_half(q) * sin[:, :, None, :]
            k = k * cos[:, :, None, :] + rotate_half(k) * sin[:, :, None, :]
            if context is not None:
                ctx_k, ctx_v = context[i, 0], context[i, 1]
            else:
                ctx_k, ctx_v = kv[i, 0][batch.context_slots], kv[i, 1][batch.context_slots]
            keys = torch.cat([ctx_k.to(self.dtype), k], dim=1).repeat_interleave(group, dim=2)
            values = torch.cat([ctx_v.to(self.dtype), v], dim=1).repeat_interleave(group, dim=2)
            mask = sliding if c.sliding[i] else full
            scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) * (c.head_dim ** -0.5)
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            attn = torch.einsum("bhqk,bkhd->bqhd", probs, values).reshape(b * r, -1)
            h = h + linear(attn, self.layer(i, "self_attn.o_proj")).view(b, r, -1)
            f = rms_norm(h, self.layer(i, "post_attention_layernorm"), c.rms_norm_eps).reshape(b * r, -1)
            m = linear(F.silu(linear(f, self.layer(i, "mlp.gate_proj"))) * linear(f, self.layer(i, "mlp.up_proj")),
                       self.layer(i, "mlp.down_proj"))
            h = h + m.view(b, r, -1)
        return rms_norm(h, self.w("norm.weight"), c.rms_norm_eps)


def context_reach(config: DraftConfig) -> int | None:
    """How many positions before a block its keys reach back (None: all of them)."""
    window = config.sliding_window
    return None if window is None or not all(config.sliding) else window


def context_width(config: DraftConfig, starts: Sequence[int]) -> int:
    """``S`` of :func:`gather_context`: the most context keys one of the blocks sees."""
    reach = context_reach(config)
    return max((p if reach is None else min(p, reach) for p in starts), default=0)


def gather_context(config: DraftConfig, block_size: int, starts: Sequence[int], tables: Sequence[Sequence[int]],
                   device: torch.device, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cache slots, positions and validity ``(B, S)`` of the context keys each block can
    see: positions ``max(0, P − window) .. P−1`` (all of ``0 .. P−1`` when a layer has
    no window), padded to the longest (or to ``width`` columns, at least that)."""
    reach = context_reach(config)
    ranges = [range(0 if reach is None else max(0, p - reach), p) for p in starts]
    longest = max((len(r) for r in ranges), default=0)
    if width is not None and width < longest:
        raise ValueError(f"{longest} context keys do not fit {width} columns")
    width = longest if width is None else width
    slots = torch.zeros(len(starts), width, dtype=torch.long)
    positions = torch.zeros(len(starts), width, dtype=torch.long)
    valid = torch.zeros(len(starts), width, dtype=torch.bool)
    for b, (span, table) in enumerate(zip(ranges, tables)):
        if not len(span):
            continue
        pos = torch.arange(span.start, span.stop)
        blocks = torch.as_tensor(list(table[:(span.stop - 1) // block_size + 1]), dtype=torch.long)
        slots[b, :len(span)] = blocks[pos // block_size] * block_size + pos % block_size
        positions[b, :len(span)] = pos
        valid[b, :len(span)] = True
    return slots.to(device), positions.to(device), valid.to(device)
