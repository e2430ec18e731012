"""Prefill attention alone at the 30B shape: how the launch settings of the paged attention kernel change it.

A ``--tokens``-token prompt of one sequence (default 4096) attends over its own
keys in the paged cache, as a prefill step's layers do: 32 query heads over 2
KV heads, head dimension 128, bf16, causal, the sliding layers with the
2048-key window and the global ones without. For the executor's setting (rows
per program ``block_m`` = 128, i.e. 8 positions of the 16 heads of a KV head;
64 keys a block; 8 warps; 2 stages) and every setting of a small sweep, one
JSON line: microseconds per sliding and per global layer (median of CUDA-graph
replays of 8 launches), the 52-layer sum (39 sliding + 13 global layers), and
the largest difference from the executor's setting's output.

``--sdpa`` adds a comparison for the global (unwindowed, causal) layers with
torch's ``scaled_dot_product_attention`` backends (flash, cuDNN, efficient):
the keys gathered from the paged cache into one contiguous tensor, the
causal mask aligned to the bottom right (a chunk of ``--chunk`` queries that
ends at position ``--context``: the last 8k chunk of a 32k prompt by
default, and the ``--tokens`` prompt alone), the output gate applied after;
microseconds per layer with the gather and the gate, against our kernel at
the same shape, and the largest difference from our kernel's output; and for the sliding layers
(``--window``) our kernel against FlashAttention's local attention (``window_size_left``; only
the keys the window reaches gathered, the gate applied after).

``--first-calls N,N,...`` times what a *new* length costs: for each length (queries = keys, a
chunk that starts its sequence) the first call of the executor's fused attention
(``dense_gated_attention``, wall time to the end of the kernels) and the median of five after
it, through cuDNN at the exact length (``BUCKET_ROWS`` 1), through cuDNN padded to its bucket
after :func:`~musegl_cuda.cuda.dense_attention.warm` planned the buckets up to 2,048 rows (the
start-up of the executor), and through FlashAttention; one JSON line per length and way.

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "plugins" / "cuda"), str(Path(__file__).resolve().parent)]

from gpu_kernel_probe import graph_us  # noqa: E402
from musegl_cuda.cuda import kernels  # noqa: E402


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


LAUNCHES = 8  # launches per graph replay


def per_launch_us(fn) -> float:
    """Median microseconds of one of :data:`LAUNCHES` launches of ``fn`` in one CUDA graph."""
    return graph_us(lambda: [fn() for _ in range(LAUNCHES)]) / LAUNCHES


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--sdpa", action="store_true", help="also compare torch's SDPA backends on the global layers")
    p.add_argument("--sdpa-only", action="store_true", help="only the --sdpa comparison (no sweep)")
    p.add_argument("--chunk", type=int, default=8192, help="queries of the --sdpa long shape")
    p.add_argument("--context", type=int, default=32768, help="keys of the --sdpa long shape")
    p.add_argument("--first-calls", default="", help="lengths whose first fused-attention call is timed")
    args = p.parse_args()
    if args.first_calls:
        first_calls([int(n) for n in args.first_calls.split(",")])
        return 0
    if args.sdpa or args.sdpa_only:
        for queries, keys in ((args.tokens, args.tokens), (args.chunk, args.context)):
            sdpa_part(queries, keys)
            windowed_part(queries, keys, args.window)
        if args.sdpa_only:
            return 0
    n, heads, kv_heads, hd, bs = args.tokens, 32, 2, 128, 16
    group = heads // kv_heads
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(n, heads, hd, device=dev, dtype=torch.bfloat16)
    blocks = -(-n // bs)
    k = torch.randn(blocks * bs, kv_heads, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qkvg = torch.randn(n, heads * hd, device=dev, dtype=torch.bfloat16)
    tables = torch.arange(blocks, device=dev, dtype=torch.int32)[None, :]
    scale = hd ** -0.5

    def tiles_of(block_m: int) -> tuple[torch.Tensor, int]:
        per = block_m // group
        rows = [(0, r, min(per, n - r), r) for r in range(0, n, per)]
        return torch.tensor(rows, device=dev, dtype=torch.int32), len(rows)

    tiling = {m: tiles_of(m) for m in (128, 256)}  # made before any graph capture

    def run(block_m: int, sliding: bool) -> torch.Tensor:
        tiles, count = tiling[block_m]
        return kernels.gated_attention(q, k, v, bs, tables, tiles, count, 1, block_m, args.window, sliding, scale,
                                       qkvg, 0)

    emit(part="setup", device=torch.cuda.get_device_name(), tokens=n, window=args.window)
    reference = {s: run(128, s).float() for s in (False, True)}
    default = dict(block_m=128, block_n=None, warps=None, stages=None)
    sweep = [default] + [dict(block_m=m, block_n=bn, warps=w, stages=st) for m, bn, w, st in
                         itertools.product((128, 256), (64, 128), (4, 8), (2, 3))]
    for s in sweep:
        kernels.ATTENTION_BLOCK_N, kernels.ATTENTION_WARPS, kernels.ATTENTION_STAGES = (
            s["block_n"], s["warps"], s["stages"])
        try:
            diff = max((run(s["block_m"], sl).float() - reference[sl]).abs().max().item() for sl in (False, True))
            us = {sl: per_launch_us(lambda sl=sl: run(s["block_m"], sl)) for sl in (False, True)}
        except Exception as exc:  # a setting that does not compile or fit
            emit(part="setting", **s, error=str(exc)[:160])
            continue
        emit(part="setting", **s, sliding_us=round(us[True], 1), global_us=round(us[False], 1),
             layers_ms=round((39 * us[True] + 13 * us[False]) / 1e3, 2), max_diff=round(diff, 4))
    return 0


def sdpa_part(queries: int, keys: int) -> None:
    """One global layer's causal attention of ``queries`` rows ending at position ``keys``: our
    paged kernel against torch's SDPA backends (gather + attention + gate), one line each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    heads, kv_heads, hd, bs = 32, 2, 128, 16
    group = heads // kv_heads
    dev = "cuda"
    torch.manual_seed(1)
    blocks = -(-keys // bs)
    k = torch.randn(blocks * bs, kv_heads, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(blocks, device=dev).to(torch.int32)  # pages out of order, as a pool hands them out
    tables = table[None, :]
    q = torch.randn(queries, heads, hd, device=dev, dtype=torch.bfloat16)
    qkvg = torch.randn(queries, heads * hd, device=dev, dtype=torch.bfloat16)
    first = keys - queries
    per = 128 // group
    tiles = torch.tensor([(0, r, min(per, queries - r), first + r) for r in range(0, queries, per)],
                         device=dev, dtype=torch.int32)
    count = tiles.shape[0]
    scale = hd ** -0.5
    slots = (table.long()[:, None] * bs + torch.arange(bs, device=dev)).reshape(-1)[:keys]
    gate = qkvg.view(queries, heads, hd)

    def ours() -> torch.Tensor:
        return kernels.gated_attention(q, k, v, bs, tables, tiles, count, 1, 128, 0, False, scale, qkvg, 0)

    mask = causal_lower_right(queries, keys)

    def sdpa() -> torch.Tensor:
        kk = k.index_select(0, slots).transpose(0, 1)[None]  # (1, kv_heads, keys, hd)
        vv = v.index_select(0, slots).transpose(0, 1)[None]
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, attn_mask=mask,
                                                             scale=scale, enable_gqa=True)
        return (o[0].transpose(0, 1) * torch.sigmoid(gate)).reshape(queries, heads * hd)

    reference = ours().float()
    flops = 4 * heads * hd * (queries * keys - queries * (queries - 1) / 2)
    us = per_launch_us(ours)
    emit(part="sdpa", queries=queries, keys=keys, backend="ours", us=round(us, 1),
         tflops=round(flops / us / 1e6, 1))
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                diff = (sdpa().float() - reference).abs().max().item()
                us = per_launch_us(sdpa)
        except Exception as exc:  # a backend that does not take this shape or mask
            emit(part="sdpa", queries=queries, keys=keys, backend=backend.name, error=str(exc)[:200])
            continue
        emit(part="sdpa", queries=queries, keys=keys, backend=backend.name, us=round(us, 1),
             tflops=round(flops / us / 1e6, 1), max_diff=round(diff, 4))


def windowed_part(queries: int, keys: int, window: int) -> None:
    """One sliding layer of a chunk of ``queries`` rows ending at position ``keys``: our paged
    kernel against FlashAttention's local attention, one line each."""
    from musegl_cuda.cuda import dense_attention as da

    heads, kv_heads, hd, bs = 32, 2, 128, 16
    group = heads // kv_heads
    dev = "cuda"
    torch.manual_seed(3)
    blocks = -(-keys // bs)
    k = torch.randn(blocks * bs, kv_heads, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(blocks, device=dev).to(torch.int32)
    q = torch.randn(queries, heads, hd, device=dev, dtype=torch.bfloat16)
    qkvg = torch.randn(queries, heads * hd, device=dev, dtype=torch.bfloat16)
    first = keys - queries
    per = 128 // group
    tiles = torch.tensor([(0, r, min(per, queries - r), first + r) for r in range(0, queries, per)],
                         device=dev, dtype=torch.int32)
    slots = da.DenseKeys.of_table(table, bs, queries, keys).slots[max(0, first - window + 1):]
    scale = hd ** -0.5

    def ours() -> torch.Tensor:
        return kernels.gated_attention(q, k, v, bs, table[None, :], tiles, tiles.shape[0], 1, 128, window, True,
                                       scale, qkvg, 0)

    def flash() -> torch.Tensor:  # the keys the first row's window reaches; FlashAttention's (batch, seq, heads, hd)
        kk, vv = k.index_select(0, slots), v.index_select(0, slots)
        o = torch.ops.aten._flash_attention_forward(q[None], kk[None], vv[None], None, None, queries, len(slots), 0.0,
                                                    True, False, scale=scale, window_size_left=window - 1,
                                                    window_size_right=0)[0][0]
        return (o * torch.sigmoid(qkvg.view(queries, heads, hd))).reshape(queries, heads * hd)

    reference = ours().float()
    visible = sum(min(window, first + r + 1) for r in range(queries))
    flops = 4 * heads * hd * visible
    for name, fn in (("ours", ours), ("flash_windowed", flash)):
        try:
            diff = (fn().float() - reference).abs().max().item()
            us = per_launch_us(fn)
        except Exception as exc:  # a torch whose FlashAttention takes no window
            emit(part="windowed", queries=queries, keys=keys, window=window, backend=name, error=str(exc)[:200])
            continue
        emit(part="windowed", queries=queries, keys=keys, window=window, backend=name, us=round(us, 1),
             tflops=round(flops / us / 1e6, 1), max_diff=round(diff, 4))


def first_calls(lengths: list[int]) -> None:
    """--first-calls: the cost of a new length in the executor's fused attention (see the module)."""
    import time

    from torch.nn.attention import SDPBackend

    from musegl_cuda.cuda import dense_attention as da

    heads, kv_heads, hd = 32, 2, 128
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(2)

    def call(n: int, backends) -> float:
        q = torch.randn(n, heads, hd, device=dev, dtype=dtype)
        k = torch.randn(n, kv_heads, hd, device=dev, dtype=dtype)
        g = torch.randn(n, heads * hd, device=dev, dtype=dtype)
        torch.cuda.synchronize()
        t = time.perf_counter()
        da.dense_gated_attention(q, k, k, da.DenseKeys(torch.arange(n, device=dev), n, n), hd ** -0.5, g, 0,
                                 backends=backends)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    ways = [("cudnn_exact", 1, [SDPBackend.CUDNN_ATTENTION]), ("cudnn_bucketed", da.BUCKET_ROWS, None),
            ("flash", 1, [SDPBackend.FLASH_ATTENTION])]
    bucket_rows = da.BUCKET_ROWS
    da.BUCKET_ROWS = 1
    emit(part="first_calls", way="init", length=777,  # the libraries' one-time set-up, before any timed length
         cudnn_ms=round(call(777, [SDPBackend.CUDNN_ATTENTION]), 1), flash_ms=round(call(777, [SDPBackend.FLASH_ATTENTION]), 1))
    for way, rows, backends in ways:
        da.BUCKET_ROWS = rows
        if way == "cudnn_bucketed":
            t = time.perf_counter()
            planned = da.warm(dev, dtype, heads, kv_heads, hd, 2048)
            torch.cuda.synchronize()
            emit(part="first_calls", way=way, warm_lengths=planned, warm_ms=round((time.perf_counter() - t) * 1e3, 1))
        for i, n in enumerate(lengths):
            n += {"cudnn_exact": 0, "cudnn_bucketed": 1, "flash": 2}[way]  # each way its own new lengths
            try:
                first = call(n, backends)
                later = sorted(call(n, backends) for _ in range(5))[2]
            except Exception as exc:  # a backend that does not take this length
                emit(part="first_calls", way=way, length=n, error=str(exc)[:200])
                continue
            emit(part="first_calls", way=way, length=n, first_ms=round(first, 2), later_ms=round(later, 3))
    da.BUCKET_ROWS = bucket_rows


if __name__ == "__main__":
    sys.exit(main())
