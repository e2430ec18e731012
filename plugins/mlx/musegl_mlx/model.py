"""The Muse Glimmer text decoder in MLX, over packed rows and a paged KV cache.

One readable file, the model math of ``docs/executor.md`` and the spec:
an embedding with a weight-less RMS norm, decoder layers in the Gemma-2
sandwich (centered ``1+w`` norms before and after attention and the MLP),
gated GQA attention with a scale-less QK norm (``×qk_scale_factor``), RoPE
on sliding-window layers and none on full layers (per layer, as the config
says), a plain scaled final norm and a softcapped head.

Numerics follow transformers (and the torch executor): every norm runs in
float32 (plain norms as ``pow(ms+ε, -0.5)``, centered ones with ``rsqrt``
and ``1+w`` kept in float32), the QK norm is cast to the activation dtype
before ``×qk_scale_factor``, cos/sin are built in float32 and cast, softmax
runs in float32, and the softcap chain runs in the activation dtype.

Rows of many sequences are packed into one ``(rows, hidden)`` batch: the
projections and the MLP run over all of them at once. Attention reads the
keys and values of every sequence of the step through :class:`StepLayout`
(gather indices into the flat per-layer cache, built by the executor from
the block tables) in one batched product per layer: queries are padded to
``(sequences, longest chunk)``, keys to ``(sequences, longest context)``,
and the mask hides padding, the future and (on sliding layers) what lies
outside the window.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import mlx.core as mx

from musegl_core.checkpoint.config import TextConfig
from musegl_mlx import kv_fp8


def plain_rms_norm(x: mx.array, eps: float, weight: mx.array | None = None) -> mx.array:
    """``x·(mean(x²)+ε)^-½ [·w]`` in float32 (embedding and QK norm, final norm)."""
    xf = x.astype(mx.float32)
    out = xf * mx.power(mx.mean(xf * xf, axis=-1, keepdims=True) + eps, -0.5)
    if weight is not None:
        out = out * weight
    return out.astype(x.dtype)


def centered_rms_norm(x: mx.array, scale: mx.array, eps: float) -> mx.array:
    """``x·rsqrt(mean(x²)+ε)·(1+w)`` in float32; ``scale`` holds ``1+w`` in float32."""
    xf = x.astype(mx.float32)
    return (xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale).astype(x.dtype)


@attrs.frozen
class GroupProducts:
    """The per-group scales or biases of a quantized matrix kept as a product, computed
    when the matrix is used: ``factor[r, g // per] · multiplier[r, g] · times`` in
    float32 (``per`` groups share a factor; no multiplier: one factor per group).

    GGUF k-quants store a float16 factor per 256-value super-block and a 6-bit
    integer per 32-value group: their products are exact in float32 but not in
    float16, and a float32 array per group costs 2 bits per weight more than the
    file (a Q4_K matrix would take 1.33x its stored bytes). Kept as the file's
    factors they take its bytes; the product costs a small elementwise kernel per
    use. ``dtype``: the dtype the values are used in (float32, or the activation
    dtype, as a plain array of scales would be cast)."""

    factor: mx.array
    multiplier: mx.array | None = None
    times: float = 1.0
    dtype: mx.Dtype = mx.float32

    @property
    def form(self) -> tuple:
        """What must agree for two matrices' products to be stacked into one."""
        per = 1 if self.multiplier is None else self.multiplier.shape[-1] // self.factor.shape[-1]
        return ("products", per, self.times, self.dtype, self.factor.dtype,
                None if self.multiplier is None else self.multiplier.dtype)

    def value(self) -> mx.array:
        out = self.factor.astype(mx.float32)
        if self.multiplier is not None:
            rows, groups = self.multiplier.shape[:-1], self.multiplier.shape[-1]
            per = groups // self.factor.shape[-1]
            out = (out[..., None] * self.multiplier.astype(mx.float32).reshape(*rows, -1, per)).reshape(*rows, groups)
        if self.times != 1.0:
            out = out * self.times
        return out if self.dtype == mx.float32 else out.astype(self.dtype)

    def __getitem__(self, index) -> "GroupProducts":
        """The rows ``index`` (a slice or token ids) picks."""
        return GroupProducts(self.factor[index], None if self.multiplier is None else self.multiplier[index],
                             self.times, self.dtype)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.factor, self.multiplier) if a is not None]

    @staticmethod
    def concatenate(parts: Sequence["GroupProducts"]) -> "GroupProducts":
        first = parts[0]
        return GroupProducts(mx.concatenate([p.factor for p in parts]),
                             None if first.multiplier is None else mx.concatenate([p.multiplier for p in parts]),
                             first.times, first.dtype)


def group_values(values: "mx.array | GroupProducts | None") -> mx.array | None:
    """Scales or biases as an array (:class:`GroupProducts` computed)."""
    return values.value() if isinstance(values, GroupProducts) else values


def dequantized_rows(linear: "Linear", index) -> mx.array:
    """Rows ``index`` (a slice or token ids) of a quantized :class:`Linear`, decoded in
    float32 (scales kept in float16 or bfloat16 would otherwise round the values)."""
    biases = None if linear.biases is None else group_values(linear.biases[index]).astype(mx.float32)
    return mx.dequantize(linear.weight[index], group_values(linear.scales[index]).astype(mx.float32), biases,
                         group_size=linear.group_size, bits=linear.bits)


def values_form(values: "mx.array | GroupProducts | None") -> tuple | None:
    if values is None:
        return None
    return values.form if isinstance(values, GroupProducts) else ("array", values.dtype)


@attrs.define
class Linear:
    """``x @ W^T`` without bias: a dense weight ``(out, in)``, or an MLX-quantized one
    (``weight`` packed, ``scales``/``biases`` per group of ``group_size``: arrays, or
    :class:`GroupProducts` computed at each use)."""

    weight: mx.array
    scales: "mx.array | GroupProducts | None" = None
    biases: "mx.array | GroupProducts | None" = None
    group_size: int = 32
    bits: int = 8

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def layout(self) -> tuple | None:
        """None when dense; else what two quantized matrices must share to be stacked."""
        if self.scales is None:
            return None
        return self.group_size, self.bits, values_form(self.scales), values_form(self.biases)

    def rows(self, start: int, stop: int) -> mx.array:
        """Rows ``start:stop`` of the matrix (dequantized in float32 where MLX-quantized)."""
        return self.weight[start:stop] if self.scales is None else dequantized_rows(self, slice(start, stop))

    def __call__(self, x: mx.array) -> mx.array:
        if self.scales is None:
            return x @ self.weight.T
        return mx.quantized_matmul(x, self.weight, group_values(self.scales), group_values(self.biases),
                                   transpose=True, group_size=self.group_size, bits=self.bits)

    def arrays(self) -> list[mx.array]:
        out = [self.weight]
        for values in (self.scales, self.biases):
            for a in values.arrays() if isinstance(values, GroupProducts) else [values] if values is not None else []:
                if not any(a is b for b in out):  # one array may serve the scales and the biases
                    out.append(a)
        return out


@attrs.define
class LinearGroup:
    """Matrices sharing one input whose stored layouts differ (a Q4_K_M file's Q4_K q/k
    beside its Q6_K v): each part multiplied as it is kept, the outputs side by side."""

    parts: list[Linear]

    @property
    def quantized(self) -> bool:
        return any(p.quantized for p in self.parts)

    def rows(self, start: int, stop: int) -> mx.array:
        """Output rows ``start:stop`` across the parts (each part's rows follow the previous part's)."""
        out, first = [], 0
        for part in self.parts:
            count = part.weight.shape[0]
            lo, hi = max(start, first), min(stop, first + count)
            if lo < hi:
                out.append(part.rows(lo - first, hi - first).astype(mx.float32))
            first += count
        return mx.concatenate(out, axis=0)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([p(x) for p in self.parts], axis=-1)

    def arrays(self) -> list[mx.array]:
        return [a for p in self.parts for a in p.arrays()]


@attrs.define
class Embedding:
    """The token embedding: rows of a dense table, or of a quantized one
    (the looked-up rows are dequantized)."""

    table: Linear

    def __call__(self, tokens: mx.array, dtype: mx.Dtype) -> mx.array:
        t = self.table
        if not t.quantized:
            return t.weight[tokens]
        return dequantized_rows(t, tokens).astype(dtype)


@attrs.define
class StepLayout:
    """Where one packed step's rows write and what they read (built by the executor).

    ``write_slots[r]`` is the flat cache slot (``block·block_size + offset``)
    row ``r`` writes. Attention runs over ``seqs × queries`` padded query
    rows: ``pad_index`` picks, for each of them, a packed row (None when
    every sequence has exactly one row: decode), ``unpad_index`` maps every
    packed row back. ``full_slots``/``full_mask`` are the keys of full
    layers (``(seqs, keys)`` slots, ``(seqs, 1, queries, keys)`` bool
    visibility); ``sliding_*`` the same for sliding layers, starting at the
    oldest key a window can reach.
    """

    write_slots: mx.array
    seqs: int
    queries: int
    pad_index: mx.array | None
    unpad_index: mx.array | None
    full_slots: mx.array
    full_mask: mx.array
    sliding_slots: mx.array
    sliding_mask: mx.array


class Layer:
    """One decoder layer: weights and the sandwich order."""

    def __init__(self, config: TextConfig, index: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.use_rope = config.rope[index]
        self.sliding = config.sliding[index]
        self.eps = config.rms_norm_eps
        self.post_eps = config.post_norm_eps
        self.qk_scale = config.qk_scale_factor
        self.scaling = config.head_dim ** -0.5
        # Filled by the loader: q/k/v/gate as one product (rows q | k | v | gate), gate/up as one.
        self.qkvg: Linear | LinearGroup | None = None
        self.o_proj: Linear | None = None
        self.gate_up: Linear | LinearGroup | None = None
        self.down_proj: Linear | None = None
        self.norms: dict[str, mx.array] = {}  # centered-norm name -> 1+w (float32)
        #: ``--kv-cache-dtype fp8``: ``(2, kv_heads)`` float32 K and V scales (set by the executor,
        #: :mod:`musegl_mlx.kv_fp8`); the caches then hold e4m3 bytes. None: K/V as computed.
        self.kv_scales: mx.array | None = None

    def attention(self, a: mx.array, rope: tuple[mx.array, mx.array], layout: StepLayout,
                  k_cache: mx.array, v_cache: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Gated attention of the normed rows ``a``; returns ``(o, k_cache, v_cache)``
        with this step's K/V written into the caches."""
        rows = a.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkvg = self.qkvg(a)
        nq, nk = nh * hd, nkv * hd
        q = qkvg[:, :nq].reshape(rows, nh, hd)
        k = qkvg[:, nq:nq + nk].reshape(rows, nkv, hd)
        v = qkvg[:, nq + nk:nq + 2 * nk].reshape(rows, nkv, hd)
        gate = qkvg[:, nq + 2 * nk:]
        q = plain_rms_norm(q, self.eps) * self.qk_scale
        k = plain_rms_norm(k, self.eps)
        if self.use_rope:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # Write first, so a chunk reads its own keys as well as every earlier step's.
        scales = self.kv_scales
        if scales is None:
            k_cache[layout.write_slots] = k.astype(k_cache.dtype)
            v_cache[layout.write_slots] = v.astype(v_cache.dtype)
        else:
            k_cache[layout.write_slots] = kv_fp8.quantize(k, scales[0])
            v_cache[layout.write_slots] = kv_fp8.quantize(v, scales[1])

        slots, mask = ((layout.sliding_slots, layout.sliding_mask) if self.sliding
                       else (layout.full_slots, layout.full_mask))
        b, lq = layout.seqs, layout.queries
        qp = q if layout.pad_index is None else q[layout.pad_index]
        qp = qp.reshape(b, lq, nh, hd).transpose(0, 2, 1, 3)  # (seqs, heads, queries, hd)
        keys, values = k_cache[slots], v_cache[slots]  # (seqs, keys, kv_heads, hd)
        if scales is not None:
            keys, values = kv_fp8.dequantize(keys, scales[0], q.dtype), kv_fp8.dequantize(values, scales[1], q.dtype)
        keys = keys.transpose(0, 2, 1, 3)  # (seqs, kv_heads, keys, hd)
        values = values.transpose(0, 2, 1, 3)
        y = attend(qp, keys, values, mask, self.scaling)  # (seqs, heads, queries, hd)
        y = y.transpose(0, 2, 1, 3).reshape(b * lq, nh * hd)
        if layout.unpad_index is not None:
            y = y[layout.unpad_index]
        y = y * mx.sigmoid(gate)
        return self.o_proj(y), k_cache, v_cache

    def mlp(self, x: mx.array) -> mx.array:
        gate_up = self.gate_up(x)
        f = gate_up.shape[-1] // 2
        g, u = gate_up[:, :f], gate_up[:, f:]
        return self.down_proj(g * mx.sigmoid(g) * u)

    def __call__(self, h: mx.array, rope: tuple[mx.array, mx.array], layout: StepLayout,
                 k_cache: mx.array, v_cache: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        n = self.norms
        o, k_cache, v_cache = self.attention(centered_rms_norm(h, n["input_layernorm"], self.eps), rope, layout,
                                             k_cache, v_cache)
        h = h + centered_rms_norm(o, n["post_attention_layernorm"], self.post_eps)
        m = self.mlp(centered_rms_norm(h, n["pre_feedforward_layernorm"], self.eps))
        return h + centered_rms_norm(m, n["post_feedforward_layernorm"], self.post_eps), k_cache, v_cache


def attend(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scaling: float) -> mx.array:
    """Softmax attention with GQA, without repeating K/V: ``q (B, heads, L, hd)``,
    ``k, v (B, kv_heads, S, hd)``, ``mask (B, 1, L, S)`` True where visible.
    Scores and softmax in float32, as transformers' eager path."""
    b, nh, lq, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    qg = q.reshape(b, nkv, g * lq, hd)  # head h = kv·g + j: each KV head's group is contiguous
    scores = (qg @ k.swapaxes(-1, -2)).astype(mx.float32).reshape(b, nkv, g, lq, -1) * scaling
    scores = mx.where(mask[:, :, None], scores, -mx.inf)
    probs = mx.softmax(scores, axis=-1).astype(q.dtype).reshape(b, nkv, g * lq, -1)
    return (probs @ v).reshape(b, nh, lq, hd)


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate ``x (rows, heads, hd)`` (transformers' rotate_half layout)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class MuseGlimmerDecoder:
    """Embedding (+ weight-less norm), decoder layers, final norm and softcapped head.

    The weights are filled by :mod:`musegl_mlx.loader`; ``dtype`` is the
    activation (and dense weight) dtype.
    """

    def __init__(self, config: TextConfig, dtype: mx.Dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.layers = [Layer(config, i) for i in range(config.num_layers)]
        self.embed_tokens: Embedding | None = None
        self.norm: mx.array | None = None  # final norm weight, float32
        self.lm_head: Linear | None = None
        hd = config.head_dim
        self.inv_freq = 1.0 / mx.power(mx.array(config.rope_theta, mx.float32),
                                       mx.arange(0, hd, 2, dtype=mx.float32) / hd)

    def rope(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """``(cos, sin)`` of shape ``(rows, head_dim)``, computed in float32, cast to the dtype."""
        freqs = positions.astype(mx.float32)[:, None] * self.inv_freq[None, :]
        emb = mx.concatenate([freqs, freqs], axis=-1)
        return mx.cos(emb).astype(self.dtype), mx.sin(emb).astype(self.dtype)

    def embed(self, tokens: mx.array) -> mx.array:
        return plain_rms_norm(self.embed_tokens(tokens, self.dtype), self.config.rms_norm_eps)

    def __call__(self, tokens: mx.array, positions: mx.array, layout: StepLayout | list[StepLayout],
                 kv: list[list[mx.array]], taps: Sequence[int] = (),
                 embeds: tuple[mx.array, mx.array] | None = None,
                 places: Sequence[int] | None = None) -> tuple[mx.array, mx.array | None]:
        """Run every packed row through the decoder, writing K/V into ``kv``
        (``kv[0][i]``/``kv[1][i]``: layer ``i``'s flat caches, replaced in the lists).

        ``embeds`` (packed row indices, rows) replaces the input of those rows
        (image features, already normed). Returns the final-normed rows
        ``(rows, H)`` and, when ``taps`` is non-empty, the input residual of
        each tapped layer stacked ``(len(taps), rows, H)`` (tap ``num_layers``:
        the last layer's output). Sliding pages: ``layout`` is one per layer and
        ``places[i]`` the cache layer ``i`` uses (``kv[0][places[i]]``).
        """
        h = self.embed(tokens)
        if embeds is not None:
            h[embeds[0]] = embeds[1].astype(h.dtype)
        rope = self.rope(positions)
        tapped: dict[int, mx.array] = {}
        for i, layer in enumerate(self.layers):
            if i in taps:
                tapped[i] = h
            j = i if places is None else places[i]
            h, kv[0][j], kv[1][j] = layer(h, rope, layout[i] if isinstance(layout, list) else layout,
                                          kv[0][j], kv[1][j])
        if len(self.layers) in taps:
            tapped[len(self.layers)] = h
        hidden = mx.stack([tapped[t] for t in taps]) if taps else None
        return plain_rms_norm(h, self.config.rms_norm_eps, self.norm), hidden

    def logits(self, normed: mx.array) -> mx.array:
        """Softcapped logits (float32) of final-normed rows: ``×mult, ÷cap, tanh, ×cap``."""
        cap = self.config.final_logit_softcapping
        z = self.lm_head(normed) * self.config.output_multiplier
        if cap is not None:
            z = mx.tanh(z / cap) * cap
        return z.astype(mx.float32)
