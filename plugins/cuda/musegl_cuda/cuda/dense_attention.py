"""Long prefill chunks' global layers through torch's fused attention (cuDNN / FlashAttention).

The paged Triton kernel (:func:`musegl_cuda.cuda.kernels.gated_attention`) serves every step;
for a big causal prefill it reaches about 207 TFLOP/s on an H200 (30B shape, a 4,096-token
prompt), where torch's ``scaled_dot_product_attention`` reaches 445 TFLOP/s through cuDNN on the
same prompt, and 336 TFLOP/s through FlashAttention for the last 8,192-token chunk of a 32k prompt
(against our 228; ``benchmarks/gpu_prefill_attention.py --sdpa``). So a step that is one
sequence's prefill chunk of at least :data:`MIN_ROWS` rows runs its global (unwindowed) layers
here: the chunk's keys are gathered from the paged cache into one contiguous tensor (its slots
in table order, a few microseconds), attended with the causal mask aligned to the bottom right
(the chunk's rows are the last positions of the keys), and the output gate is applied after.
The sliding layers keep the paged kernel: torch's SDPA takes no window, and FlashAttention's
own local attention (``window_size_left``) ran a sliding layer of the last 8,192-row chunk of a
32k prompt in 1.27 ms against the paged kernel's 1.53 ms, but with the gate as two more kernels
(0.16 ms) the chunk gained under 0.5 % (H200, 30B shape, `benchmarks/gpu_prefill_attention.py
--sdpa`; benchmarks/results/h200_run_2026-12-04_session15).

The backend is cuDNN for a chunk that starts the sequence (queries = keys) and FlashAttention
for one that follows cached keys (the measured best of each). Only bf16 and fp16 on CUDA, and
only where :func:`available` found both backends working on this device at start-up: a backend
that cannot take a call would otherwise fall back to the unfused math path (32 GB of scores at
8k x 32k).

cuDNN builds an execution plan for every new sequence length it sees, which costs far more
than the attention itself; so a chunk that starts the sequence is padded to a multiple of
:data:`BUCKET_ROWS` rows (zero queries and keys after the real ones, which the causal mask
hides from every real row), and the executor plans the buckets up to its prefill chunk at
start-up (:func:`warm`). A longer chunk plans its bucket once, at first use.
"""

from __future__ import annotations

import logging

import attrs
import torch
import torch.nn.functional as F

log = logging.getLogger("musegl.cuda")

#: Rows of a single-sequence prefill chunk from which its global layers run here.
MIN_ROWS = 1024
#: A chunk that starts its sequence runs cuDNN at its length rounded up to a multiple of this.
BUCKET_ROWS = 1024


def bucket(rows: int) -> int:
    """The length cuDNN sees for a chunk of ``rows`` rows that starts its sequence."""
    return -(-rows // BUCKET_ROWS) * BUCKET_ROWS


@attrs.frozen
class DenseKeys:
    """The keys of a single-sequence chunk: its cache ``slots`` for positions ``0 .. keys-1``
    (device, int64), of which the chunk's ``queries`` rows are the last."""

    slots: torch.Tensor
    queries: int
    keys: int

    @classmethod
    def of_table(cls, table: torch.Tensor, block_size: int, queries: int, keys: int) -> "DenseKeys":
        """From one sequence's block table row (``(cols,)`` int32 on the device)."""
        blocks = -(-keys // block_size)
        offsets = torch.arange(block_size, device=table.device, dtype=torch.long)
        slots = (table[:blocks].long()[:, None] * block_size + offsets).reshape(-1)[:keys]
        return cls(slots, queries, keys)


def _backends(starts_sequence: bool):
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION] if starts_sequence else [SDPBackend.FLASH_ATTENTION]


def dense_gated_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dense: DenseKeys,
                          scale: float, qkvg: torch.Tensor, gate_offset: int,
                          backends=None, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal gated attention of ``q (rows, heads, hd)`` (the chunk's rows, in order) over the
    keys ``dense.slots`` of ``k_cache``/``v_cache`` (``(slots, kv_heads, hd)``): the result is
    :func:`~musegl_cuda.cuda.kernels.gated_attention`'s for a global layer, ``(rows, heads·hd)``.
    ``backends``: the SDPA backends allowed (default: cuDNN or FlashAttention, see the module).
    ``scales``: an FP8 cache's ``(2, kv_heads)`` K and V scales: the gathered keys are
    dequantized to ``q``'s dtype first (:func:`musegl_cuda.kv_fp8.dequantize_rows`)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    rows, heads, hd = q.shape
    if rows != dense.queries:
        raise ValueError(f"{rows} query rows for a chunk of {dense.queries}")
    if scales is None:
        kk = k_cache.index_select(0, dense.slots)  # (keys, kv_heads, hd)
        vv = v_cache.index_select(0, dense.slots)
    else:
        from musegl_cuda.kv_fp8 import dequantize_rows

        kk = dequantize_rows(k_cache, dense.slots, scales[0], q.dtype)
        vv = dequantize_rows(v_cache, dense.slots, scales[1], q.dtype)
    qq, keys = q, dense.keys
    starts = dense.queries == dense.keys
    if starts and bucket(rows) != rows:  # zero rows after the last: causally invisible to the real ones
        pad = (0, 0, 0, 0, 0, bucket(rows) - rows)
        qq, kk, vv, keys = F.pad(q, pad), F.pad(kk, pad), F.pad(vv, pad), bucket(rows)
    with sdpa_kernel(_backends(starts) if backends is None else backends):
        o = F.scaled_dot_product_attention(qq.transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                           vv.transpose(0, 1)[None],
                                           attn_mask=causal_lower_right(qq.shape[0], keys),
                                           scale=scale, enable_gqa=True)
    gate = qkvg[:, gate_offset:gate_offset + heads * hd].view(rows, heads, hd)
    return (o[0, :, :rows].transpose(0, 1) * torch.sigmoid(gate)).reshape(rows, heads * hd)


def warm(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, up_to: int) -> int:
    """Plan cuDNN's attention for every bucket of a sequence-starting chunk from
    :data:`MIN_ROWS` to ``up_to`` rows (once, at start-up, where :func:`available` said yes);
    the number of lengths planned."""
    lengths = range(bucket(MIN_ROWS), bucket(up_to) + 1, BUCKET_ROWS)
    for n in lengths:
        q = torch.zeros(n, heads, head_dim, device=device, dtype=dtype)
        k = torch.zeros(n, kv_heads, head_dim, device=device, dtype=dtype)
        dense_gated_attention(q, k, k, DenseKeys(torch.arange(n, device=device), n, n), head_dim ** -0.5,
                              torch.zeros(n, heads * head_dim, device=device, dtype=dtype), 0)
    return len(lengths)


def available(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether both backends run a small chunk of this shape on ``device`` (called once at
    start-up); False (with the reason logged) on the CPU, in float32, or where one fails."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        n, keys = 64, 128
        k = torch.randn(keys, kv_heads, head_dim, device=device, dtype=dtype)
        q = torch.randn(n, heads, head_dim, device=device, dtype=dtype)
        g = torch.zeros(n, heads * head_dim, device=device, dtype=dtype)
        slots = torch.arange(keys, device=device)
        for chunk in (DenseKeys(slots[:n], n, n), DenseKeys(slots, n, keys)):
            dense_gated_attention(q, k, k, chunk, head_dim ** -0.5, g, 0)
        torch.cuda.synchronize(device)
    except RuntimeError as exc:
        log.info("long prefill chunks keep the paged attention kernel in every layer: %s",
                 str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    return True
