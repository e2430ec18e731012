"""FP8 KV (``--kv-cache-dtype fp8``): float8 e4m3 K/V with a fixed scale per layer and KV head.

A cached element is ``x / scale`` rounded to e4m3 (saturated at ±448) and read back as
``stored · scale``. The scales are set once at load from the weights, before any
request, and never change:

* **K** is the output of the scale-less QK norm (``k · (mean(k²)+ε)^-½``, so
  ``‖k‖₂ ≤ √head_dim``) rotated by RoPE (a rotation of pairs: the norm stays), so
  every element satisfies ``|k_i| ≤ √head_dim``: ``k_scale = √head_dim / 448`` in every
  layer and head.
* **V** is ``W_v · x`` with ``x`` the layer's centered input norm,
  ``x = h · rsqrt(mean(h²)+ε) · (1+w)``, so ``‖x‖₂ ≤ √hidden · max|1+w|`` and each
  element of V row ``j`` satisfies ``|v_j| ≤ ‖W_v[j]‖₂ · ‖x‖₂`` (Cauchy-Schwarz):
  ``v_scale[head] = max_{j in head} ‖W_v[j]‖₂ · max|1+w| · √hidden / 448``.

Both are bounds, not estimates: no value the model can produce saturates. e4m3 is a
floating-point format (3 mantissa bits, normal from 2^-6 to 448), so a loose bound costs
no relative precision until a value falls more than 2^15 below it into the subnormals;
and fixed scales need no calibration data, are the same after a restart (K/V written by
one process read right in another), cost nothing per block, and sit in CUDA graphs as
plain device tensors. Per-block scales would follow each block's range more closely but
would change under a graph's writes and travel with every block copy.

CPU reference: the attention paths gather the keys a step reads and dequantize them
(:func:`dequantize_rows`), then attend in the activation dtype as ``auto`` does. CUDA:
the Triton kernels read e4m3 directly (:mod:`musegl_cuda.cuda.kernels`).
"""

from __future__ import annotations

import torch

from musegl_core.engine.kv_dtype import E4M3_MAX, fp8_k_scale, fp8_v_scale

FP8 = torch.float8_e4m3fn


def storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV tensor's dtype for ``--kv-cache-dtype`` (``auto``: the activation dtype)."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype == "fp8":
        return FP8
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")


#: The oldest CUDA compute capability whose Triton reads float8 e4m3 (Ada, Hopper and later).
MIN_CAPABILITY = (8, 9)


def check_device(device: torch.device) -> None:
    """Raise ValueError (one line) where the attention kernels cannot read e4m3: a GPU older than
    compute capability 8.9. The CPU reference path runs anywhere."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        raise ValueError(f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")


def k_scale(head_dim: int) -> float:
    """The K scale of every layer and head: ``√head_dim / 448`` (see the module)."""
    return fp8_k_scale(head_dim)


def v_scales(v_weight: torch.Tensor, norm_scale: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The V scale of each of ``kv_heads`` heads of one layer, float32 ``(kv_heads,)``, from
    its ``v_proj`` weight ``(kv_heads·head_dim, hidden)`` and its input norm's ``1+w``."""
    w = v_weight.float()
    rows = w.norm(dim=1).view(kv_heads, -1).amax(dim=1).tolist()
    top = float(norm_scale.float().abs().max())
    return torch.tensor([fp8_v_scale(r, top, w.shape[1]) for r in rows], dtype=torch.float32)


def layer_scales(model) -> torch.Tensor:
    """``(layers, 2, kv_heads)`` float32 scales of a :class:`~musegl_cuda.model.MuseGlimmerDecoder`
    (its rank's KV heads under tensor parallelism), on the model's device."""
    c = model.local
    device = model.norm.device
    scales = torch.empty(c.num_layers, 2, c.num_kv_heads, dtype=torch.float32, device=device)
    scales[:, 0] = k_scale(c.head_dim)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        v_rows = (attn.q_rows + attn.kv_rows, attn.q_rows + 2 * attn.kv_rows)
        if attn.qkvg_stored is not None:  # stored mode: V's rows of the q/k/v/gate group, decoded
            weight = group_rows(attn.qkvg_stored, *v_rows)
        elif attn.qkvg_matrix is not None:  # CUDA's weights as stored (v_proj's weight is on "meta")
            weight = device_group_rows(attn.qkvg_matrix, *v_rows)
        else:
            weight = attn.v_proj.weight
        scales[i, 1] = v_scales(weight.to(device), layer.input_layernorm.scale, c.num_kv_heads)
    return scales


def group_rows(group, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a :class:`~musegl_cuda.cpu.stored_matrix.StoredGroup` (its parts
    stacked), decoded to float32."""
    out, offset = [], 0
    for part in group.parts:
        lo, hi = max(start, offset), min(stop, offset + part.rows)
        if lo < hi:
            out.append(part.dequantize(torch.arange(lo - offset, hi - offset)))
        offset += part.rows
    return torch.cat(out)


def device_group_rows(group, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a :class:`~musegl_cuda.cuda.device_weights.MatrixGroup` (its parts
    stacked), decoded to float32 on the group's device (the values :func:`group_rows` decodes
    from the same file on the CPU)."""
    from musegl_cuda.cuda.device_weights import matrix_device  # Triton: only where device matrices are

    out, offset = [], 0
    for part in group.parts:
        lo, hi = max(start, offset), min(stop, offset + part.rows_count)
        if lo < hi:
            ids = torch.arange(lo - offset, hi - offset, device=matrix_device(part))
            out.append(part.rows(ids, torch.float32))
        offset += part.rows_count
    return torch.cat(out)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x (rows, kv_heads, hd) / scale (kv_heads,)`` as e4m3, saturated at ±448."""
    return (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def write_rows(flat: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Store ``x (rows, kv_heads, hd)`` at ``slots`` of the flat cache ``(slots, kv_heads, hd)``:
    cast (``auto``) or quantized with ``scale`` (FP8; through bytes, which every device copies)."""
    if scale is None:
        flat.index_copy_(0, slots, x.to(flat.dtype))
        return
    flat.view(torch.uint8).index_copy_(0, slots, quantize(x, scale).view(torch.uint8))


def dequantize_rows(flat: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
    """The cache rows at ``slots`` (any shape of indices) in ``dtype``: read as they are
    (``auto``) or ``stored · scale`` (FP8, the product in float32, then rounded to ``dtype``)."""
    rows = flat.index_select(0, slots.reshape(-1))
    if scale is None:
        return rows.view(*slots.shape, *flat.shape[1:])
    out = (rows.float() * scale[:, None]).to(dtype)
    return out.view(*slots.shape, *flat.shape[1:])
