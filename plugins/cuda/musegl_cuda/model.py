"""The Muse Glimmer text decoder in PyTorch, over packed rows.

Every module works on a flat ``(rows, ...)`` batch: the rows of many
sequences packed together. Projections and the MLP run over all rows at once;
only attention is per sequence, and it reads K/V from the executor's paged
cache through :class:`AttentionBatch` (built by the executor per step).

With ``stored=True`` (the CPU default, see :mod:`musegl_cuda.cpu`) the
matrices are not torch parameters: each is a :class:`StoredMatrix` holding the
checkpoint's bytes (float16, bfloat16, GGUF Q8_0/Q4_0/Q4_K, or float32), and
q/k/v/gate and gate/up are each one stacked matrix where their dtypes agree.
Activations stay float32. With ``device_weights=True`` (CUDA's ``--weights stored``) the
matrices are device matrices of :mod:`musegl_cuda.cuda.device_weights` instead (GGUF
blocks or FP8 on the GPU, multiplied by Triton kernels), grouped the same way, and the
activations keep the model dtype.

With a :class:`~musegl_cuda.parallel.shard.TensorShard` of several ranks the
decoder is one rank's part of the model (tensor parallelism): its layers have
the rank's heads and MLP columns (:attr:`MuseGlimmerDecoder.local`), the
loaders keep the rank's rows and columns of each weight, the row-parallel
outputs (o_proj, down_proj) and the embedding are all-reduced and the head's
logits gathered, so every rank ends with the same full logits.

Numerics follow transformers: norms in float32 (plain norms with
``pow(ms+ε, -0.5)``, centered norms with ``rsqrt`` and ``1+w``), the QK norm
cast to the activation dtype before ``×qk_scale_factor``, cos/sin built in
float32 and cast to the activation dtype, softmax in float32, the softcap
chain in the activation dtype.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.hf_reader import CENTERED_NORMS, text_weight_names
from musegl_core.checkpoint.stored import StoredTensor
from musegl_cuda.cpu.attention import RowKeys, attention_rows, dequantized_attention_rows
from musegl_cuda.cpu import row_norms
from musegl_cuda.cpu.greedy import capped_argmax
from musegl_cuda.cuda.dense_attention import DenseKeys, dense_gated_attention
from musegl_cuda.cpu.stored_matrix import DenseMatrix, HalfRows, StoredGroup, StoredMatrix, stored_matrix
from musegl_cuda.kv_fp8 import dequantize_rows, write_rows
from musegl_cuda.parallel.shard import TensorShard


#: On CUDA the head's multiplier and softcap run as one Triton pass (kernels.softcap_logits).
FUSED_SOFTCAP = True
#: On CUDA the final norm runs inside the last layer's residual add (kernels.add_norm).
FUSED_FINAL_NORM = True


def plain_rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x·(mean(x²)+ε)^-½ [·w]`` in float32 (weight-less embed/QK norm, final norm)."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight
    return out.type_as(x)


#: Stored mode: steps of up to this many rows run the norms and residual adds in C
#: (:mod:`musegl_cuda.cpu.row_norms`: one call where torch dispatches seven ops; one thread,
#: so wider steps keep torch's threaded ops).
C_NORM_ROWS = 64


class CenteredRMSNorm(nn.Module):
    """``x·rsqrt(mean(x²)+ε)·(1+w)`` in float32; ``scale`` holds ``1+w`` in float32."""

    def __init__(self, dim: int, eps: float, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("scale", torch.ones(dim, dtype=torch.float32, device=device))

    def load(self, w: torch.Tensor) -> None:
        self.scale.copy_(1.0 + w.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale).type_as(x)


#: On the CPU, ``x @ W^T`` with few rows is much slower through ``F.linear``
#: (BLAS picks a poor kernel for M < ~32) than the same product computed as
#: ``(W @ x^T)^T``: measured on the bench config's head (202048 x 1024, 2 cores),
#: 8 rows took 392 ms as ``F.linear`` and 133 ms transposed. Decode steps have
#: exactly such row counts, so this is what makes batched decoding pay on CPUs.
SMALL_BATCH_ROWS = 32


class Linear(nn.Module):
    """A bias-free linear layer whose weight is filled by the loader (no random init)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.stored: StoredMatrix | None = None  # set in stored mode; then ``weight`` is on "meta"
        self.matrix = None  # CUDA weights as stored (musegl_cuda.cuda.device_weights); ``weight`` on "meta"

    @classmethod
    def rows_of(cls, fused: nn.Parameter, start: int, stop: int) -> "Linear":
        """A linear layer whose weight is rows ``start:stop`` of ``fused`` (shared storage:
        loading either fills both)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.weight = nn.Parameter(fused.data[start:stop], requires_grad=False)
        layer.stored = None
        layer.matrix = None
        return layer

    def forward(self, x: torch.Tensor, half: HalfRows | None = None) -> torch.Tensor:
        if self.stored is not None:
            return self.stored.matmul(x, half)
        if self.matrix is not None:
            return self.matrix.matmul(x)
        if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS:
            return (self.weight @ x.t()).t()
        return F.linear(x, self.weight)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """transformers' default RoPE (rotate_half layout, one global θ)."""

    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta ** exponent))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``(rows, head_dim)`` in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(rows, heads, head_dim)``."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


@attrs.define
class SequenceAttention:
    """One sequence's slice of a packed step, as attention needs it.

    ``rows`` are the sequence's rows in the packed batch. ``key_slots`` /
    ``mask`` exist twice: for full layers (keys ``0 .. last``) and for sliding
    layers (only the keys a window can reach). A slot is ``block·block_size +
    offset`` in the flattened cache.
    """

    rows: slice
    full_slots: torch.Tensor
    full_mask: torch.Tensor
    sliding_slots: torch.Tensor
    sliding_mask: torch.Tensor


@attrs.define
class DecodeAttention:
    """A decode-only step (one row per sequence) as padded tensors, so attention runs
    for every sequence at once: ``*_slots (seqs, keys)`` (padding reads slot 0),
    ``*_mask (seqs, keys)`` True on the keys a row sees. Built for decode steps in
    stored mode (see :meth:`MuseGlimmerDecoder.__init__`)."""

    full_slots: torch.Tensor
    full_mask: torch.Tensor
    sliding_slots: torch.Tensor
    sliding_mask: torch.Tensor

    @classmethod
    def of(cls, tables: list[list[int]], last: list[int], block_size: int, window: int) -> "DecodeAttention":
        """From each sequence's block table and the position of its one row (keys
        ``0 .. last``; sliding layers only the last ``window`` of them)."""
        n = len(tables)
        table = torch.zeros(n, max(len(t) for t in tables), dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        pos = torch.tensor(last, dtype=torch.long)[:, None]
        k_pos = torch.arange(int(max(last)) + 1)
        mask = k_pos[None, :] <= pos
        slots = (table.gather(1, (k_pos // block_size).expand(n, -1)) * block_size + k_pos % block_size)
        slots = slots.masked_fill(~mask, 0)
        lo = max(0, min(last) - window + 1)  # no sliding row sees a key before this
        in_window = mask & (pos - k_pos[None, :] < window)
        return cls(slots, mask, slots[:, lo:], in_window[:, lo:])


@attrs.define
class AttentionBatch:
    """Attention metadata of one packed step: where to write and what to read."""

    write_slots: torch.Tensor  # (rows,) cache slot of each packed row
    sequences: list[SequenceAttention] = attrs.field(factory=list)
    decode: DecodeAttention | None = None
    half: HalfRows | None = None  # stored mode: rows whose products may run in float16 arithmetic
    #: stored mode, a decode step: each row's keys (:meth:`~musegl_cuda.cpu.attention.RowKeys.of_decode`),
    #: in place of ``sequences``
    keys: RowKeys | None = None


@attrs.define
class PagedMeta:
    """Attention metadata of one step on the CUDA path (device tensors of a
    :class:`musegl_cuda.cuda.plan.StepPlan`): the kernels read the paged cache
    through it, for every sequence of the step at once."""

    slots: torch.Tensor  # (rows,) int64 cache slot each row writes
    tables: torch.Tensor  # (seqs, cols) int32 block tables
    tiles: torch.Tensor  # (>= num_tiles, 4) int32
    num_tiles: int
    splits: int  # key splits of the attention kernel (sliding layers; every layer without global_splits)
    block_m: int  # query vectors per attention program
    block_size: int
    global_splits: int = 0  # key splits of the global layers (0: splits)
    #: one long prefill chunk's keys: its global layers run through torch's fused attention
    #: (:mod:`musegl_cuda.cuda.dense_attention`); None: every layer through the paged kernel
    dense: DenseKeys | None = None

    def splits_of(self, sliding: bool) -> int:
        """The key splits of a sliding or a global layer."""
        return self.splits if sliding or not self.global_splits else self.global_splits


class Attention(nn.Module):
    """Gated GQA attention with the scale-less QK norm; RoPE and the window per layer."""

    def __init__(self, config: TextConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 weight_device: torch.device | None = None) -> None:
        super().__init__()
        wdev = weight_device or device
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.group = config.num_heads // config.num_kv_heads
        self.use_rope = config.rope[layer]
        self.sliding = config.sliding[layer]
        self.eps = config.rms_norm_eps
        self.qk_scale = config.qk_scale_factor
        self.scaling = hd ** -0.5
        self.window = config.sliding_window if self.sliding else 0
        # q, k, v and the output gate are one matrix (one product on the CUDA path);
        # the four projections are row views of it.
        nq, nkv = config.num_heads * hd, config.num_kv_heads * hd
        self.qkvg = nn.Parameter(torch.empty(2 * nq + 2 * nkv, h, dtype=dtype, device=wdev), requires_grad=False)
        self.qkvg_stored: StoredGroup | None = None
        self.qkvg_matrix = None  # CUDA weights as stored: a device_weights.MatrixGroup
        self.q_proj = Linear.rows_of(self.qkvg, 0, nq)
        self.k_proj = Linear.rows_of(self.qkvg, nq, nq + nkv)
        self.v_proj = Linear.rows_of(self.qkvg, nq + nkv, nq + 2 * nkv)
        self.gate_proj = Linear.rows_of(self.qkvg, nq + 2 * nkv, 2 * nq + 2 * nkv)
        self.gate_offset = nq + 2 * nkv
        self.o_proj = Linear(config.num_heads * hd, h, dtype, wdev)
        self.q_rows, self.kv_rows = nq, nkv
        #: ``--kv-cache-dtype fp8``: this layer's ``(2, kv_heads)`` float32 K and V scales (the
        #: executor's, set with its cache; :mod:`musegl_cuda.kv_fp8`); None: K/V kept as computed
        self.kv_scales: torch.Tensor | None = None
        #: stored mode: the C norms for rows of ``head_dim`` (:mod:`musegl_cuda.cpu.row_norms`); None: torch's
        self.head_norms: row_norms.RowNorms | None = None

    def forward(self, a: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.qkvg_stored is not None:
            return self._forward_stored(a, rope, batch, k_cache, v_cache)
        rows = a.shape[0]
        if self.qkvg_matrix is not None:
            nq, nkv = self.q_rows, self.kv_rows
            qkvg = self.qkvg_matrix.matmul(a)
            q = qkvg[:, :nq].reshape(rows, self.num_heads, self.head_dim)
            k = qkvg[:, nq:nq + nkv].reshape(rows, self.num_kv_heads, self.head_dim)
            v = qkvg[:, nq + nkv:nq + 2 * nkv].reshape(rows, self.num_kv_heads, self.head_dim)
            gate = qkvg[:, nq + 2 * nkv:]
        else:
            q = self.q_proj(a).view(rows, self.num_heads, self.head_dim)
            k = self.k_proj(a).view(rows, self.num_kv_heads, self.head_dim)
            v = self.v_proj(a).view(rows, self.num_kv_heads, self.head_dim)
            gate = None
        q = plain_rms_norm(q, self.eps) * self.qk_scale
        k = plain_rms_norm(k, self.eps)
        if self.use_rope:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)

        # The cache is (blocks, block_size, kv_heads, head_dim); write this step's rows first,
        # so a chunk reads its own keys and everything earlier steps wrote.
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        ks, vs = (None, None) if self.kv_scales is None else (self.kv_scales[0], self.kv_scales[1])
        write_rows(k_flat, batch.write_slots, k, ks)  # FP8: quantized with the layer's scales
        write_rows(v_flat, batch.write_slots, v, vs)

        if batch.decode is not None:
            y = self._decode_attention(q, k_flat, v_flat, batch.decode)
            y = y.reshape(rows, -1) * torch.sigmoid(self.gate_proj(a) if gate is None else gate)
            return self.o_proj(y)
        y = torch.empty_like(q)
        for seq in batch.sequences:
            slots, mask = ((seq.sliding_slots, seq.sliding_mask) if self.sliding
                           else (seq.full_slots, seq.full_mask))
            keys = dequantize_rows(k_flat, slots, ks, q.dtype).repeat_interleave(self.group, dim=1)  # (S, heads, hd)
            values = dequantize_rows(v_flat, slots, vs, q.dtype).repeat_interleave(self.group, dim=1)
            y[seq.rows] = sdpa_rows(q[seq.rows], keys, values, mask, self.scaling)
        y = y.reshape(rows, -1) * torch.sigmoid(self.gate_proj(a) if gate is None else gate)
        return self.o_proj(y, batch.half)


    def _forward_stored(self, a: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
                        k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` in stored mode (the CPU): one product for q/k/v/gate, q and k normed
        and rotated together (:meth:`_qk_norm_rope`), each row's attention from its own keys
        (:mod:`musegl_cuda.cpu.attention`)."""
        rows, hd, kvh = a.shape[0], self.head_dim, self.num_kv_heads
        nq, nkv = self.q_rows, self.kv_rows
        qkvg = self.qkvg_stored.matmul(a, batch.half)
        v = qkvg[:, nq + nkv:nq + 2 * nkv]
        # The cache is (blocks, block_size, kv_heads, head_dim); write this step's rows first,
        # so a chunk reads its own keys and everything earlier steps wrote.
        k_flat, v_flat = k_cache.view(-1, kvh, hd), v_cache.view(-1, kvh, hd)
        stored = None
        if (self.kv_scales is None and self.head_norms is not None and rows <= C_NORM_ROWS
                and k_flat.dtype == v_flat.dtype == torch.float32):  # normed, rotated and stored in one C call
            stored = self.head_norms.qk_norm_rope(qkvg[:, :nq + nkv].reshape(rows, self.num_heads + kvh, hd),
                                                  self.num_heads, self.eps, self.qk_scale,
                                                  rope if self.use_rope else None,
                                                  (k_flat, v_flat, batch.write_slots, v))
        if stored is not None:
            q = stored[:, :self.num_heads]
            y = attention_rows(q, k_flat, v_flat, batch, self.window, self.scaling, self.qkvg_stored.kernels)
        elif self.kv_scales is None:
            q, k = self._qk_norm_rope(qkvg[:, :nq + nkv], rope)
            write_rows(k_flat, batch.write_slots, k, None)
            write_rows(v_flat, batch.write_slots, v.reshape(rows, kvh, hd), None)
            y = attention_rows(q, k_flat, v_flat, batch, self.window, self.scaling, self.qkvg_stored.kernels)
        else:  # FP8: quantized with the layer's scales
            q, k = self._qk_norm_rope(qkvg[:, :nq + nkv], rope)
            ks, vs = self.kv_scales[0], self.kv_scales[1]
            write_rows(k_flat, batch.write_slots, k, ks)
            write_rows(v_flat, batch.write_slots, v.reshape(rows, kvh, hd), vs)
            y = dequantized_attention_rows(q, k_flat, v_flat, ks, vs, batch, self.window, self.scaling,
                                           self.qkvg_stored.kernels)
        y = y.reshape(rows, -1).mul_(torch.sigmoid(qkvg[:, nq + 2 * nkv:]))  # (a fresh tensor: in place)
        return self.o_proj.stored.matmul(y, batch.half)

    def _qk_norm_rope(self, qk: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k from ``qk (rows, (heads + kv_heads) * head_dim)``, the q then k columns of the
        q/k/v/gate product: the QK norm (each head over its own values), ``×qk_scale_factor``
        on q, RoPE, as :meth:`forward` does them on q and k apart (the same values: the norm is
        per head and the rest elementwise), in one pass of each op over both."""
        heads = self.num_heads
        x = qk.reshape(qk.shape[0], heads + self.num_kv_heads, self.head_dim)
        if self.head_norms is not None and qk.shape[0] <= C_NORM_ROWS:  # in one C call (cpu.row_norms)
            x = self.head_norms.qk_norm_rope(x, heads, self.eps, self.qk_scale, rope if self.use_rope else None)
            return x[:, :heads], x[:, heads:]
        x = plain_rms_norm(x, self.eps)
        x[:, :heads].mul_(self.qk_scale)
        if self.use_rope:
            x = apply_rope(x, *rope)
        return x[:, :heads], x[:, heads:]

    def _decode_attention(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                          decode: DecodeAttention) -> torch.Tensor:
        """One query row per sequence against its keys, every sequence in one batched
        product per KV head; the query heads of a group read their KV head in place
        (strided, no repeated or re-laid-out K/V)."""
        slots, mask = ((decode.sliding_slots, decode.sliding_mask) if self.sliding
                       else (decode.full_slots, decode.full_mask))
        seqs, width = slots.shape
        kvh, hd, group = self.num_kv_heads, self.head_dim, self.group
        flat = slots.reshape(-1)
        scales = (None, None) if self.kv_scales is None else (self.kv_scales[0], self.kv_scales[1])
        keys = dequantize_rows(k_flat, flat, scales[0], q.dtype).view(seqs, width, kvh, hd)
        values = dequantize_rows(v_flat, flat, scales[1], q.dtype).view(seqs, width, kvh, hd)
        queries = q.view(seqs, kvh, group, hd)
        hidden = ~mask[:, None, :]
        out = torch.empty(seqs, kvh, group, hd, dtype=q.dtype)
        for h in range(kvh):
            scores = torch.bmm(queries[:, h], keys[:, :, h].transpose(1, 2)) * self.scaling  # (seqs, group, keys)
            scores = scores.masked_fill(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[:, h] = torch.bmm(probs, values[:, :, h])
        return out.view(seqs, self.num_heads, hd)


def sdpa_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              scaling: float) -> torch.Tensor:
    """Softmax attention of ``q (L, heads, hd)`` over ``k, v (S, heads, hd)``; ``mask (L, S)``
    is True where a key is visible. Softmax in float32, as transformers' eager path."""
    scores = torch.einsum("lhd,shd->hls", q, k) * scaling
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hls,shd->lhd", probs, v)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))``."""

    def __init__(self, config: TextConfig, dtype: torch.dtype, device: torch.device,
                 weight_device: torch.device | None = None) -> None:
        super().__init__()
        wdev = weight_device or device
        h, f = config.hidden_size, config.intermediate_size
        self.gate_up = nn.Parameter(torch.empty(2 * f, h, dtype=dtype, device=wdev), requires_grad=False)
        self.gate_up_stored: StoredGroup | None = None
        self.gate_up_matrix = None  # CUDA weights as stored: a device_weights.MatrixGroup
        self.gate_proj = Linear.rows_of(self.gate_up, 0, f)
        self.up_proj = Linear.rows_of(self.gate_up, f, 2 * f)
        self.down_proj = Linear(f, h, dtype, wdev)
        self.ffn = f

    def forward(self, x: torch.Tensor, half: HalfRows | None = None) -> torch.Tensor:
        if self.gate_up_stored is not None:
            gu = self.gate_up_stored.matmul(x, half)
            return self.down_proj.stored.matmul(F.silu(gu[:, :self.ffn]).mul_(gu[:, self.ffn:]), half)
        if self.gate_up_matrix is not None:
            gu = self.gate_up_matrix.matmul(x)
            return self.down_proj(F.silu(gu[:, :self.ffn]) * gu[:, self.ffn:])
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Gemma-2 sandwich: pre- and post-norms around attention and the MLP."""

    def __init__(self, config: TextConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 weight_device: torch.device | None = None, shard: TensorShard | None = None) -> None:
        super().__init__()
        self.shard = shard or TensorShard.single(config)  # sums the row-parallel outputs over the ranks
        self.self_attn = Attention(config, layer, dtype, device, weight_device)
        self.mlp = MLP(config, dtype, device, weight_device)
        h = config.hidden_size
        self.input_layernorm = CenteredRMSNorm(h, config.rms_norm_eps, device)
        self.post_attention_layernorm = CenteredRMSNorm(h, config.post_norm_eps, device)
        self.pre_feedforward_layernorm = CenteredRMSNorm(h, config.rms_norm_eps, device)
        self.post_feedforward_layernorm = CenteredRMSNorm(h, config.post_norm_eps, device)
        #: stored mode without tensor parallelism: the norms and residual adds of steps of up to
        #: :data:`C_NORM_ROWS` rows in C (:mod:`musegl_cuda.cpu.row_norms`, torch's bits); None: torch's ops
        self.norms: row_norms.RowNorms | None = None

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        norms = self.norms
        if norms is not None and h.shape[0] <= C_NORM_ROWS:
            first = self.input_layernorm
            o = self.self_attn(norms.norm(h, first.scale, first.eps), rope, batch, k_cache, v_cache)
            post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
            h, x = norms.add_norm(o, h, post.scale, post.eps, pre.scale, pre.eps)
            post = self.post_feedforward_layernorm
            return norms.add_norm(self.mlp(x, batch.half), h, post.scale, post.eps, None, 0.0)[0]
        o = self.shard.reduce(self.self_attn(self.input_layernorm(h), rope, batch, k_cache, v_cache))
        h = h + self.post_attention_layernorm(o)
        m = self.shard.reduce(self.mlp(self.pre_feedforward_layernorm(h), batch.half))
        return h + self.post_feedforward_layernorm(m)


class MuseGlimmerDecoder(nn.Module):
    """Embedding (+ weight-less norm), decoder layers, final norm and softcapped head."""

    def __init__(self, config: TextConfig, dtype: torch.dtype, device: torch.device, stored: bool = False,
                 shard: TensorShard | None = None, device_weights: bool = False) -> None:
        """``stored``: matrices come from :meth:`load_stored` as :class:`StoredMatrix`
        (CPU, float32 activations only); the torch parameters stay unallocated on "meta".
        ``device_weights``: matrices come from :meth:`load_device` in their stored form on the
        GPU (:mod:`musegl_cuda.cuda.device_weights`; the forward is :meth:`forward_paged`).
        ``shard``: this rank's part of a tensor-parallel model (None: the whole model)."""
        super().__init__()
        if stored and (device.type != "cpu" or dtype != torch.float32):
            raise ValueError("stored weights run on the CPU with float32 activations only")
        if device_weights and shard is not None and shard.plan.size > 1:
            raise ValueError("weights as stored on CUDA run without tensor parallelism")
        self.config = config
        self.dtype = dtype
        self.stored = stored
        self.device_weights = device_weights
        self.shard = shard = shard or TensorShard.single(config)
        #: the config as this rank's layers see it (its heads, KV heads, MLP width)
        self.local = local = shard.plan.local_config(config)
        vocab = shard.plan.vocab.size  # this rank's rows of the embedding and the head
        wdev = torch.device("meta") if stored or device_weights else device
        h = config.hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(vocab, h, dtype=dtype, device=wdev), requires_grad=False)
        self.embed_stored: StoredMatrix | DenseMatrix | None = None
        self.embed_matrix = None  # CUDA weights as stored
        self.layers = nn.ModuleList(DecoderLayer(local, i, dtype, device, wdev, shard)
                                    for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(h, dtype=torch.float32, device=device), requires_grad=False)
        self.lm_head = Linear(h, vocab, dtype, wdev)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, device)
        self._pending: dict[str, StoredMatrix | DenseMatrix] = {}
        self.norms: row_norms.RowNorms | None = None  # stored mode: the C norms (see DecoderLayer.norms)

    # -- loading --------------------------------------------------------------

    def load_weight(self, name: str, value: torch.Tensor) -> None:
        """Copy one checkpoint weight (transformers name, any dtype/device) into place.

        Norm weights are rounded to the model dtype first and then kept in
        float32, as transformers does when it loads a checkpoint in that dtype
        and upcasts inside the norm. A shard keeps its part of the weight.
        """
        value = self.shard.plan.dense(name, value)
        if value.ndim == 1:
            value = value.to(self.norm.device, self.dtype).float()
        target = self._target(name)
        if isinstance(target, CenteredRMSNorm):
            target.load(value)
        else:
            target.copy_(value)

    def _target(self, name: str) -> torch.Tensor | CenteredRMSNorm:
        """The tensor (or centered norm) a checkpoint weight name fills."""
        if name == "embed_tokens.weight":
            return self.embed_tokens
        if name == "norm.weight":
            return self.norm
        if name == "lm_head.weight":
            return self.lm_head.weight
        if name.startswith("layers."):
            _, index, suffix = name.split(".", 2)
            layer = self.layers[int(index)]
            if suffix in CENTERED_NORMS:
                return getattr(layer, suffix.removesuffix(".weight"))
            module = layer
            for part in suffix.removesuffix(".weight").split("."):
                module = getattr(module, part)
            return module.weight
        raise KeyError(f"unknown weight {name!r}")

    def checkpoint_weight(self, name: str) -> torch.Tensor:
        """One loaded weight as the checkpoint names and holds it, the inverse of
        :meth:`load_weight`: a centered norm's ``w`` (not the ``1+w`` it keeps), every
        other weight the tensor itself (a shard's part of it). Dense weights only: in
        stored mode the matrices are :class:`StoredMatrix` bytes, not tensors."""
        if self.stored and not name.endswith("norm.weight"):
            raise ValueError(f"{name!r} is kept as stored bytes (stored mode), not as a tensor")
        target = self._target(name)
        return target.scale - 1.0 if isinstance(target, CenteredRMSNorm) else target

    def load_stored(self, stored: StoredTensor) -> None:
        """Take one checkpoint weight in its stored form (stored mode): 1-D weights
        go through :meth:`load_weight`, matrices are kept as they are stored
        (:func:`stored_matrix`), a shard's part of them. Call :meth:`finish_stored` after the last one."""
        stored = self.shard.plan.stored(stored)
        if len(stored.shape) == 1:
            self.load_weight(stored.name, torch.from_numpy(stored.to_float32()))
            return
        self._target(stored.name)  # a known name
        self._pending[stored.name] = stored_matrix(stored)

    def finish_stored(self) -> dict[str, int]:
        """Put the matrices of :meth:`load_stored` in place (q/k/v/gate and gate/up
        stacked where their dtypes agree); returns the weight bytes per stored dtype."""
        self.embed_stored, self.lm_head.stored, layers = self._take_pending()
        single = self.shard.plan.size == 1  # (the C norms leave out the ranks' sums)
        self.norms = row_norms.for_width(self.config.hidden_size) if single else None
        head_norms = row_norms.for_width(self.local.head_dim)
        for layer, (qkvg, o, gate_up, down) in zip(self.layers, layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkvg_stored, attn.o_proj.stored = StoredGroup(qkvg), o
            mlp.gate_up_stored, mlp.down_proj.stored = StoredGroup(gate_up), down
            layer.norms, attn.head_norms = self.norms, head_norms
        return self.stored_bytes()

    def _take_pending(self):
        """The matrices :meth:`load_stored` / :meth:`load_device` collected, taken out in
        place order: (embedding, head, and per layer (q/k/v/gate list, o_proj, gate/up list,
        down_proj)); a checkpoint that left one out is refused."""
        pending = self._pending
        missing = [n for n in self.weight_names(self.config) if n not in pending and "norm" not in n]
        if missing:
            raise ValueError(f"checkpoint did not provide {missing[:5]}")
        layers = []
        for i in range(len(self.layers)):
            p = f"layers.{i}."
            qkvg = [pending.pop(p + f"self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "gate_proj")]
            layers.append((qkvg, pending.pop(p + "self_attn.o_proj.weight"),
                           [pending.pop(p + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj")],
                           pending.pop(p + "mlp.down_proj.weight")))
        return pending.pop("embed_tokens.weight"), pending.pop("lm_head.weight"), layers

    def load_device(self, stored: StoredTensor, quantization: str | None = None,
                    w8a8_rows: int | None = None) -> None:
        """Take one checkpoint weight in its stored form onto the GPU (``device_weights``):
        1-D weights go through :meth:`load_weight`, matrices become device matrices
        (:func:`~musegl_cuda.cuda.device_weights.device_matrix`; ``quantization="fp8"``
        quantizes half-precision ones). Call :meth:`finish_device` after the last one."""
        from musegl_cuda.cuda.device_weights import W8A8_ROWS, device_matrix

        if len(stored.shape) == 1:
            self.load_weight(stored.name, torch.from_numpy(stored.to_float32()))
            return
        self._target(stored.name)  # a known name
        self._pending[stored.name] = device_matrix(stored, self.norm.device, self.dtype, quantization,
                                                   W8A8_ROWS if w8a8_rows is None else w8a8_rows)

    def finish_device(self) -> dict[str, int]:
        """Put the matrices of :meth:`load_device` in place (q/k/v/gate and gate/up grouped,
        stacked where their types agree); returns the weight bytes per stored dtype."""
        from musegl_cuda.cuda.device_weights import MatrixGroup

        total: dict[str, int] = {}

        def count(*matrices) -> None:
            for m in matrices:
                total[m.dtype] = total.get(m.dtype, 0) + m.nbytes

        self.embed_matrix, self.lm_head.matrix, layers = self._take_pending()
        count(self.embed_matrix, self.lm_head.matrix)
        for layer, (qkvg, o, gate_up, down) in zip(self.layers, layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkvg_matrix, attn.o_proj.matrix = MatrixGroup(qkvg), o
            mlp.gate_up_matrix, mlp.down_proj.matrix = MatrixGroup(gate_up), down
            count(*attn.qkvg_matrix.parts, attn.o_proj.matrix, *mlp.gate_up_matrix.parts, mlp.down_proj.matrix)
        return total

    def device_matrices(self) -> list:
        """Every matrix of :meth:`load_device` (``device_weights``): the groups' parts,
        the outputs, the MLP's down and the head (not the embedding, :attr:`embed_matrix`)."""
        found = [self.lm_head.matrix]
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            found += [*attn.qkvg_matrix.parts, attn.o_proj.matrix, *mlp.gate_up_matrix.parts, mlp.down_proj.matrix]
        return found

    def stored_bytes(self) -> dict[str, int]:
        """Bytes of the stored matrices per dtype tag (stored mode)."""
        total: dict[str, int] = {}
        matrices = [self.embed_stored, self.lm_head.stored]
        for layer in self.layers:
            matrices += [*layer.self_attn.qkvg_stored.parts, layer.self_attn.o_proj.stored,
                         *layer.mlp.gate_up_stored.parts, layer.mlp.down_proj.stored]
        for m in matrices:
            total[m.dtype] = total.get(m.dtype, 0) + m.nbytes
        return total

    def randomize(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights made on the model's device (``--load-format dummy``), seeded:
        matrices ~ N(0, std²), the embedding ~ N(0, 1), norms at their identity
        (centered weights 0, the final norm's weight 1)."""
        generator = torch.Generator(self.norm.device).manual_seed(seed)
        for name in self.weight_names(self.config):
            target = self._target(name)
            if isinstance(target, CenteredRMSNorm):
                target.scale.fill_(1.0)
            elif name == "norm.weight":
                target.fill_(1.0)
            else:
                target.normal_(0.0, 1.0 if name == "embed_tokens.weight" else std, generator=generator)

    def randomize_device(self, seed: int, kind: str, w8a8_rows: int | None = None, std: float = 0.02
                         ) -> dict[str, int]:
        """:meth:`randomize` for ``device_weights``: random matrices as stored, ``kind``
        ``fp8`` or a GGUF type (``q4_k_m``: Q4_K_M's types per matrix;
        :func:`~musegl_cuda.cuda.device_weights.random_matrix`), made one at a time on the
        device; norms at their identity. Returns the weight bytes per stored dtype."""
        from musegl_cuda.cuda.device_weights import W8A8_ROWS, random_matrix

        from musegl_core.checkpoint.hf_reader import expected_shape

        generator = torch.Generator(self.norm.device).manual_seed(seed)
        for name in self.weight_names(self.config):
            target = self._target(name)
            if isinstance(target, CenteredRMSNorm):
                target.scale.fill_(1.0)
            elif name == "norm.weight":
                target.fill_(1.0)
            else:
                rows, cols = expected_shape(self.config, name)
                self._pending[name] = random_matrix(name, rows, cols, kind, self.config.num_layers,
                                                    self.norm.device, self.dtype, generator,
                                                    1.0 if name == "embed_tokens.weight" else std,
                                                    W8A8_ROWS if w8a8_rows is None else w8a8_rows)
        return self.finish_device()

    @staticmethod
    def weight_names(config: TextConfig) -> tuple[str, ...]:
        return text_weight_names(config)

    # -- forward --------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return plain_rms_norm(self.embedding_rows(tokens), self.config.rms_norm_eps)

    def embedding_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The raw embedding rows of ``tokens`` (any shape; no norm), float32 from stored
        matrices (a shard's rows summed over the ranks)."""
        flat = tokens.reshape(-1)
        if self.embed_stored is not None:
            rows = self.shard.embedding(self.embed_stored.dequantize, flat)
        elif self.embed_matrix is not None:
            rows = self.shard.embedding(self.embed_matrix.rows, flat)
        else:
            rows = self.shard.embedding(lambda ids: F.embedding(ids, self.embed_tokens), flat)
        return rows.view(*tokens.shape, -1)

    def head_product(self, normed: torch.Tensor) -> torch.Tensor:
        """The head's raw product of ``(rows, hidden)``: ``(rows, vocab)`` (a shard's
        columns gathered from the ranks)."""
        return self.shard.gather_vocab(self.lm_head(normed))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch | list[AttentionBatch],
                kv: list[tuple[torch.Tensor, torch.Tensor]],
                taps: tuple[int, ...] = (),
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run every packed row through the decoder.

        ``batch``: the step's attention metadata, or one per layer (sliding pages: each
        layer reads its group's pages). ``embeds`` (packed row indices, rows) replaces the input of those rows
        (image features: already normed, so they skip the embedding norm).

        Returns the final-normed hidden states ``(rows, H)`` and, when ``taps``
        is non-empty, the input residual of each tapped layer stacked as
        ``(len(taps), rows, H)`` (tap ``num_layers`` is the last layer's output).
        """
        norms = self.norms if tokens.shape[0] <= C_NORM_ROWS else None
        h = self.embed(tokens) if norms is None else norms.norm(self.embedding_rows(tokens),
                                                                None, self.config.rms_norm_eps)
        if embeds is not None:
            h = h.index_copy(0, embeds[0], embeds[1].to(h.dtype))
        rope = self.rotary(positions, h.dtype)
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in taps:
                tapped[i] = h
            h = layer(h, rope, batch[i] if isinstance(batch, list) else batch, *kv[i])
        if len(self.layers) in taps:
            tapped[len(self.layers)] = h
        hidden = torch.stack([tapped[t] for t in taps]) if taps else None
        if norms is not None:
            return norms.norm(h, self.norm, self.config.rms_norm_eps), hidden
        return plain_rms_norm(h, self.config.rms_norm_eps, self.norm), hidden

    def forward_paged(self, tokens: torch.Tensor, positions: torch.Tensor, meta: PagedMeta | list[PagedMeta],
                      kv: list[tuple[torch.Tensor, torch.Tensor]], taps: tuple[int, ...] = (),
                      embeds: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` on a GPU, through the Triton kernels of
        :mod:`musegl_cuda.cuda.kernels`: one product for q/k/v/gate and one for
        gate/up, QK norm + RoPE + cache write in one launch, paged attention
        over every sequence at once, and the sandwich norms fused with the
        residual adds. Same inputs and results (up to float rounding order).
        ``meta``: one for every layer, or one per layer (sliding pages: each layer its
        group's block tables and slots)."""
        from musegl_cuda.cuda import kernels

        c = self.local
        heads, kv_heads, hd = c.num_heads, c.num_kv_heads, c.head_dim
        reduce = self.shard.reduce
        h = self.embed(tokens)
        if embeds is not None:
            h = h.index_copy(0, embeds[0], embeds[1].to(h.dtype))
        cos, sin = self.rotary(positions, h.dtype)
        layers = self.layers
        first = layers[0].input_layernorm
        _, x = kernels.add_norm(None, h, None, 0.0, first.scale, first.eps)
        tapped: dict[int, torch.Tensor] = {}
        metas = meta if isinstance(meta, list) else [meta] * len(layers)
        for i, layer in enumerate(layers):
            if i in taps:
                tapped[i] = h
            meta = metas[i]
            attn = layer.self_attn
            k_flat = kv[i][0].view(-1, kv_heads, hd)
            v_flat = kv[i][1].view(-1, kv_heads, hd)
            qkvg = F.linear(x, attn.qkvg) if attn.qkvg_matrix is None else attn.qkvg_matrix.matmul(x)
            q = kernels.qk_norm_rope_store(qkvg, cos, sin, meta.slots, k_flat, v_flat, heads, kv_heads, hd,
                                           attn.eps, attn.qk_scale, attn.use_rope, attn.kv_scales)
            if meta.dense is not None and not attn.sliding:
                y = dense_gated_attention(q, k_flat, v_flat, meta.dense, attn.scaling, qkvg, attn.gate_offset,
                                          scales=attn.kv_scales)
            else:
                y = kernels.gated_attention(q, k_flat, v_flat, meta.block_size, meta.tables, meta.tiles,
                                            meta.num_tiles, meta.splits_of(attn.sliding), meta.block_m,
                                            c.sliding_window, attn.sliding, attn.scaling, qkvg, attn.gate_offset,
                                            attn.kv_scales)
            o = reduce(attn.o_proj(y))
            post, pre = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
            h, x = kernels.add_norm(o, h, post.scale, post.eps, pre.scale, pre.eps)
            mlp = layer.mlp
            gate_up = F.linear(x, mlp.gate_up) if mlp.gate_up_matrix is None else mlp.gate_up_matrix.matmul(x)
            down = reduce(mlp.down_proj(kernels.silu_mul(gate_up)))
            post = layer.post_feedforward_layernorm
            if i + 1 < len(layers):
                nxt = layers[i + 1].input_layernorm
                h, x = kernels.add_norm(down, h, post.scale, post.eps, nxt.scale, nxt.eps)
            elif FUSED_FINAL_NORM:  # the last residual add also computes the final norm (weight w, not 1+w)
                h, x = kernels.add_norm(down, h, post.scale, post.eps, self.norm, c.rms_norm_eps)
            else:
                h, _ = kernels.add_norm(down, h, post.scale, post.eps, None, 0.0)
                x = plain_rms_norm(h, c.rms_norm_eps, self.norm)
        if len(layers) in taps:
            tapped[len(layers)] = h
        hidden = torch.stack([tapped[t] for t in taps]) if taps else None
        return x, hidden

    def greedy_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """``torch.argmax(self.logits(normed), dim=-1)`` (int64 ``(rows,)``), the same ids; on
        the CPU the softcap runs only where it can decide the id (:func:`capped_argmax`)."""
        cap = self.config.final_logit_softcapping
        if normed.is_cuda or cap is None:
            return torch.argmax(self.logits(normed), dim=-1)
        z = self.head_product(normed)
        multiplier = self.config.output_multiplier
        ids = capped_argmax(z, multiplier, cap)
        return torch.argmax(z.mul_(multiplier).div_(cap).tanh_().mul_(cap), dim=-1) if ids is None else ids  # as logits()

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Softcapped logits (float32) of final-normed rows: ``×mult, ÷cap, tanh, ×cap``."""
        cap = self.config.final_logit_softcapping
        if normed.is_cuda and FUSED_SOFTCAP:
            from musegl_cuda.cuda import kernels

            return kernels.softcap_logits(self.head_product(normed), self.config.output_multiplier, cap)
        # in place: the head's output is a fresh tensor, and a chain of new 800 KB-per-row
        # results costs more in page faults than the arithmetic (4 ms vs 0.7 ms at 4 rows)
        z = self.head_product(normed).mul_(self.config.output_multiplier)
        if cap is not None:
            z.div_(cap).tanh_().mul_(cap)
        return z.float()
