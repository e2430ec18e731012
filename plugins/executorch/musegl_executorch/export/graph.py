"""The export-friendly Muse Glimmer decoder: one packed forward with the K/V
pool passed in and the step's new K/V rows passed out (the off-graph ABI).

The engine's paged pool stays the owner of the cache: the executor hands the
whole pool to the program as two read-only inputs, the program gathers the
keys each chunk reads through index tensors, and it returns the K/V rows of
this step's positions, which the executor writes into the pool by slot.
Nothing in the graph depends on how many sequences a step holds: a step is
described by index tensors (see docs/executorch.md, "The off-graph ABI").

A call runs ``G`` groups of ``T`` rows; a group is one sequence's chunk and
row ``g·T + t`` is its ``t``-th row. The static methods ``forward_{N}`` run
``N`` single-row groups (decode: ``G = N``, ``T = 1``); ``forward_others``
runs one group of any width (a prefill chunk or a block of drafts: ``G = 1``,
``T`` dynamic). Inputs, in this order (``C`` pool cells, ``Kf``/``Kw`` cached
keys a group reads on full/sliding layers, ``R`` rows whose logits are wanted):

================  =======================  ==========================================
``tokens``        ``(G, T)`` int64         token ids
``positions``     ``(G, T)`` int64         absolute positions (RoPE, in-chunk causality)
``k_pool``        ``(L, C, kvh, hd)``      every layer's keys (activation dtype)
``v_pool``        ``(L, C, kvh, hd)``      every layer's values
``full_slots``    ``(G, Kf)`` int64        pool cells of the keys before the chunk
``full_bias``     ``(G, T, Kf)`` float32   0 where such a key is visible, -inf elsewhere
``window_slots``  ``(G, Kw)`` int64        the same for sliding layers (the window only)
``window_bias``   ``(G, T, Kw)`` float32
``head_rows``     ``(R,)`` int64           rows (``g·T + t``) to run the head on
================  =======================  ==========================================

A group also sees its own new keys (causally, and within the window on
sliding layers): the graph derives that part of the mask from ``positions``,
so nothing has to be written to the pool before the call. Outputs:
``logits (R, vocab)`` float32 (softcapped), ``new_k`` and ``new_v``
``(L, G·T, kvh, hd)`` in the activation dtype, which the caller writes into
the pool at the rows' cells. With ``taps`` (an export with a DFlash draft) a
fourth output ``hidden (taps, G·T, hidden)`` holds every row's input residual
of each tapped layer (tap ``num_layers``: the last layer's output).

Exported with sliding pages (``musegl export --sliding-pages``,
:meth:`OffGraphDecoder.use_page_groups`), the pools hold one row per place of a
layer group, ``(places, C, kvh, hd)``, and ``window_slots`` one set of cells per
group of sliding layers, ``(S, G, Kw)`` (docs/executorch.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from musegl_core.checkpoint.config import TextConfig

#: The names of the program's inputs, in order (the manifest records them).
INPUT_NAMES = ("tokens", "positions", "k_pool", "v_pool", "full_slots", "full_bias",
               "window_slots", "window_bias", "head_rows")
OUTPUT_NAMES = ("logits", "new_k", "new_v")
#: The fourth output of a program exported with a DFlash draft: the tapped rows.
HIDDEN_OUTPUT = "hidden"


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x·(mean(x²)+ε)^-½`` in float32, cast back (the weight-less norms)."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


def centered(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``x·rsqrt(mean(x²)+ε)·scale`` in float32 (``scale`` holds ``1+w``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ExportLayer(nn.Module):
    """One decoder layer with plain ``nn.Linear`` projections (so a weight-only
    quantizer finds them): fused q/k/v/gate, o, fused gate/up, down."""

    def __init__(self, config: TextConfig, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.hd = config.num_heads, config.num_kv_heads, hd
        self.group = config.num_heads // config.num_kv_heads
        self.nq, self.nkv = config.num_heads * hd, config.num_kv_heads * hd
        self.f = config.intermediate_size
        self.index = index
        self.place = index  # the pool row this layer reads and writes (its place in its group, sliding pages)
        self.use_rope = config.rope[index]
        self.sliding = config.sliding[index]
        self.eps, self.post_eps = config.rms_norm_eps, config.post_norm_eps
        self.qk_scale = config.qk_scale_factor
        self.scaling = hd ** -0.5
        self.qkvg = nn.Linear(h, 2 * self.nq + 2 * self.nkv, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(self.nq, h, bias=False, dtype=dtype)
        self.gate_up = nn.Linear(h, 2 * self.f, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(self.f, h, bias=False, dtype=dtype)
        for name in ("input_scale", "post_attention_scale", "pre_feedforward_scale", "post_feedforward_scale"):
            self.register_buffer(name, torch.ones(h, dtype=torch.float32))

    def forward(self, h, cos, sin, k_pool, v_pool, cells, slots, bias, own_bias):
        groups, chunk = bias.shape[0], bias.shape[1]
        rows = h.shape[0]
        a = centered(h, self.input_scale, self.eps)
        qkvg = self.qkvg(a)
        nq, nkv = self.nq, self.nkv
        q = qkvg[:, :nq].reshape(rows, self.heads, self.hd)
        k = qkvg[:, nq:nq + nkv].reshape(rows, self.kv_heads, self.hd)
        v = qkvg[:, nq + nkv:nq + 2 * nkv].reshape(rows, self.kv_heads, self.hd)
        gate = qkvg[:, nq + 2 * nkv:]
        q = rms(q, self.eps) * self.qk_scale
        k = rms(k, self.eps)
        if self.use_rope:
            q = q * cos[:, None, :] + rotate_half(q) * sin[:, None, :]
            k = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
        k = k.to(k_pool.dtype)
        v = v.to(v_pool.dtype)

        # k_pool/v_pool are the whole pool as (rows·cells, kvh, hd) views: this layer's
        # cells start at place·cells (k_pool[place] would copy the layer's whole pool per call)
        cached = slots.shape[1]
        flat = slots.reshape(-1) + self.place * cells
        past_k = torch.index_select(k_pool, 0, flat).reshape(groups, cached, self.kv_heads, self.hd)
        past_v = torch.index_select(v_pool, 0, flat).reshape(groups, cached, self.kv_heads, self.hd)
        keys = torch.cat([past_k, k.reshape(groups, chunk, self.kv_heads, self.hd)], dim=1).to(q.dtype)
        values = torch.cat([past_v, v.reshape(groups, chunk, self.kv_heads, self.hd)], dim=1).to(q.dtype)
        # (G, kvh, group·T, hd) @ (G, kvh, hd, S): GQA without repeating K/V
        qm = q.reshape(groups, chunk, self.kv_heads, self.group, self.hd).permute(0, 2, 3, 1, 4)
        qm = qm.reshape(groups, self.kv_heads, self.group * chunk, self.hd)
        scores = torch.matmul(qm, keys.permute(0, 2, 3, 1)) * self.scaling
        full = torch.cat([bias, own_bias], dim=-1)  # (G, T, S)
        scores = scores.reshape(groups, self.kv_heads, self.group, chunk, -1).float() + full[:, None, None]
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        probs = probs.reshape(groups, self.kv_heads, self.group * chunk, -1)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # (G, kvh, group·T, hd)
        out = out.reshape(groups, self.kv_heads, self.group, chunk, self.hd).permute(0, 3, 1, 2, 4)
        y = out.reshape(rows, self.nq)
        o = self.o_proj(y * torch.sigmoid(gate))
        h = h + centered(o, self.post_attention_scale, self.post_eps)
        x = centered(h, self.pre_feedforward_scale, self.eps)
        gu = self.gate_up(x)
        m = self.down_proj(F.silu(gu[:, :self.f]) * gu[:, self.f:])
        return h + centered(m, self.post_feedforward_scale, self.post_eps), k, v


class OffGraphDecoder(nn.Module):
    """The whole text decoder behind the off-graph ABI (see the module docstring)."""

    def __init__(self, config: TextConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h, dtype=dtype)
        self.layers = nn.ModuleList(ExportLayer(config, i, dtype) for i in range(config.num_layers))
        self.register_buffer("norm", torch.ones(h, dtype=torch.float32))
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False, dtype=dtype)
        exponent = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta ** exponent))
        #: layers whose input residual every call also returns (``num_layers``: the last
        #: layer's output), as a fourth output ``hidden (taps, G·T, hidden)``; () for none
        self.taps: tuple[int, ...] = ()
        #: sliding pages (:meth:`use_page_groups`): each layer's group (0: full), else None
        self.layer_groups: tuple[int, ...] | None = None
        self.page_groups = None  # ... and the PageGroups
        self.requires_grad_(False)

    def use_page_groups(self, groups) -> None:
        """Export for sliding pages (``musegl export --sliding-pages``; a
        :class:`~musegl_core.engine.sliding_pages.PageGroups`): the pools hold one row per
        *place* (``(places, C, kvh, hd)``), a layer reads its place's row, and ``window_slots``
        carries one set of cells per sliding group (``(S, G, Kw)``; every group's window covers the
        same positions, so ``window_bias`` stays one): a sliding layer of group ``g`` reads set
        ``g - 1``."""
        self.page_groups = groups
        self.layer_groups = tuple(group for group, _ in groups.layers)
        for layer, (_, place) in zip(self.layers, groups.layers):
            layer.place = place

    @classmethod
    def from_decoder(cls, decoder, dtype: torch.dtype) -> "OffGraphDecoder":
        """The same weights as a loaded :class:`musegl_cuda.model.MuseGlimmerDecoder`."""
        module = cls(decoder.config, dtype)
        with torch.no_grad():
            module.embed_tokens.weight.copy_(decoder.embed_tokens)
            module.norm.copy_(decoder.norm)
            module.lm_head.weight.copy_(decoder.lm_head.weight)
            for mine, theirs in zip(module.layers, decoder.layers):
                mine.qkvg.weight.copy_(theirs.self_attn.qkvg)
                mine.o_proj.weight.copy_(theirs.self_attn.o_proj.weight)
                mine.gate_up.weight.copy_(theirs.mlp.gate_up)
                mine.down_proj.weight.copy_(theirs.mlp.down_proj.weight)
                mine.input_scale.copy_(theirs.input_layernorm.scale)
                mine.post_attention_scale.copy_(theirs.post_attention_layernorm.scale)
                mine.pre_feedforward_scale.copy_(theirs.pre_feedforward_layernorm.scale)
                mine.post_feedforward_scale.copy_(theirs.post_feedforward_layernorm.scale)
        return module.eval()

    def forward(self, tokens, positions, k_pool, v_pool, full_slots, full_bias, window_slots, window_bias,
                head_rows):
        h = rms(self.embed_tokens(tokens.reshape(-1)), self.config.rms_norm_eps)
        return self.decode(h, positions, k_pool, v_pool, full_slots, full_bias, window_slots, window_bias,
                           head_rows)

    def decode(self, h, positions, k_pool, v_pool, full_slots, full_bias, window_slots, window_bias, head_rows):
        """The decoder from its input rows ``h`` (``(G·T, hidden)``, already normed)."""
        c = self.config
        freqs = positions.reshape(-1).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        # a group's own keys: causal, and within the window on sliding layers
        distance = positions[:, :, None] - positions[:, None, :]  # (G, T, T): query minus key position
        blocked = torch.full_like(distance, 0, dtype=torch.float32) - float("inf")
        open_ = torch.zeros_like(blocked)
        own_full = torch.where(distance >= 0, open_, blocked)
        own_window = torch.where((distance >= 0) & (distance < c.sliding_window), open_, blocked)
        new_k, new_v = [], []
        cells = k_pool.shape[1]
        k_flat = k_pool.reshape(-1, c.num_kv_heads, c.head_dim)  # views (no copy in the program)
        v_flat = v_pool.reshape(-1, c.num_kv_heads, c.head_dim)
        tapped = {}
        groups = self.layer_groups
        for i, layer in enumerate(self.layers):
            if i in self.taps:
                tapped[i] = h
            if layer.sliding and groups is not None:  # sliding pages: its group's set of window keys
                h, k, v = layer(h, cos, sin, k_flat, v_flat, cells, window_slots[groups[i] - 1],
                                window_bias, own_window)
            elif layer.sliding:
                h, k, v = layer(h, cos, sin, k_flat, v_flat, cells, window_slots, window_bias, own_window)
            else:
                h, k, v = layer(h, cos, sin, k_flat, v_flat, cells, full_slots, full_bias, own_full)
            new_k.append(k)
            new_v.append(v)
        tapped[len(self.layers)] = h
        hf = torch.index_select(h, 0, head_rows).float()
        normed = (hf * torch.pow(hf.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps, -0.5) * self.norm).type_as(h)
        z = self.lm_head(normed) * c.output_multiplier
        if c.final_logit_softcapping is not None:
            z = torch.tanh(z / c.final_logit_softcapping) * c.final_logit_softcapping
        if self.taps:
            return z.float(), torch.stack(new_k), torch.stack(new_v), torch.stack([tapped[t] for t in self.taps])
        return z.float(), torch.stack(new_k), torch.stack(new_v)


class FromEmbeddings(nn.Module):
    """``forward_from_embeddings``: the decoder over input rows given by the caller
    (``embeds (G, T, hidden)``: normed text rows from ``embed_text`` with image rows in
    place), otherwise the inputs and outputs of the token forwards. It holds the
    decoder's own modules under the same names, so the data file stores them once."""

    def __init__(self, decoder: OffGraphDecoder) -> None:
        super().__init__()
        self.config, self.dtype = decoder.config, decoder.dtype
        self.layers, self.lm_head = decoder.layers, decoder.lm_head
        self.taps = decoder.taps
        self.layer_groups = decoder.layer_groups
        self.register_buffer("norm", decoder.norm)
        self.register_buffer("inv_freq", decoder.inv_freq)

    def forward(self, embeds, positions, k_pool, v_pool, full_slots, full_bias, window_slots, window_bias,
                head_rows):
        h = embeds.reshape(-1, self.config.hidden_size).to(self.dtype)
        return OffGraphDecoder.decode(self, h, positions, k_pool, v_pool, full_slots, full_bias, window_slots,
                                      window_bias, head_rows)


class EmbedText(nn.Module):
    """``embed_text``: token ids ``(T,)`` to their normed input rows ``(T, hidden)``."""

    def __init__(self, decoder: OffGraphDecoder) -> None:
        super().__init__()
        self.eps = decoder.config.rms_norm_eps
        self.embed_tokens = decoder.embed_tokens

    def forward(self, tokens):
        return rms(self.embed_tokens(tokens), self.eps)
