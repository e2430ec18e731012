"""The CUDA path's FP8 KV (``--kv-cache-dtype fp8``) against the CPU reference, on any device.

Shared by the interpreted test (``test_kv_fp8.py``, Triton's interpreter on the CPU) and
the GPU test (``test_kv_fp8_gpu.py``): the store kernel writes the bytes
:func:`musegl_cuda.kv_fp8.quantize` writes, and the paged attention over an e4m3 cache
equals the same kernel over the dequantized cache (the reference path's values).
"""

from __future__ import annotations

import torch


def check_fp8_store(device: str, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, head_dim: int = 16) -> None:
    """qk_norm_rope_store into an e4m3 cache: the bytes of torch's saturating, nearest-even
    cast of (the float cache's K and V) / scale, every code including subnormals and ±448."""
    from musegl_cuda import kv_fp8
    from musegl_cuda.cuda import kernels
    from musegl_cuda.model import RotaryEmbedding

    dev = torch.device(device)
    torch.manual_seed(1)
    hd, kvh, rows = head_dim, kv_heads, 9
    qkvg = torch.randn(rows, 2 * heads * hd + 2 * kvh * hd, dtype=dtype, device=dev)
    v0 = (heads + kvh) * hd
    # V spans the e4m3 range and past it: subnormals, ties, saturation
    qkvg[:, v0:v0 + kvh * hd] = (torch.randn(rows, kvh * hd, device=dev) * torch.logspace(-5, 3, rows * kvh * hd,
                                 device=dev).view(rows, -1)).to(dtype)
    qkvg[0, v0:v0 + 2] = torch.tensor([-0.0, 0.0], dtype=dtype)  # signed zeros keep their sign bit
    scales = torch.tensor([[kv_fp8.k_scale(hd)] * kvh, [1.0, 0.5][:kvh] + [1.0] * (kvh - 2)],
                          dtype=torch.float32, device=dev)
    cos, sin = RotaryEmbedding(hd, 10000.0, dev)(torch.arange(rows, device=dev) + 3, dtype)
    slots = torch.tensor([1, 4, 8, 15, 16, 30, 31, 40, 63], device=dev)
    kf = torch.zeros(64, kvh, hd, dtype=dtype, device=dev)
    vf = torch.zeros_like(kf)
    kernels.qk_norm_rope_store(qkvg, cos, sin, slots, kf, vf, heads, kvh, hd, 1e-6, 3.87, True)
    k8 = torch.zeros(64, kvh, hd, dtype=kv_fp8.FP8, device=dev)
    v8 = torch.zeros_like(k8)
    q8 = kernels.qk_norm_rope_store(qkvg, cos, sin, slots, k8, v8, heads, kvh, hd, 1e-6, 3.87, True, scales)
    q = kernels.qk_norm_rope_store(qkvg, cos, sin, slots, kf.clone(), vf.clone(), heads, kvh, hd, 1e-6, 3.87, True)
    assert torch.equal(q8, q)
    for cache, ref, scale in ((k8, kf, scales[0]), (v8, vf, scales[1])):
        want = kv_fp8.quantize(ref[slots], scale)
        got = cache[slots]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (got.float() - want.float()).abs().max()
    assert int(v8[slots].view(torch.uint8).eq(0x7E).sum()) > 0  # some V saturated at +448
    assert not k8.view(torch.uint8)[[0, 2, 50]].any()  # slots not written stay zero


def check_fp8_attention(device: str, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2,
                        head_dim: int = 16, splits: tuple[int, ...] = (1, 3)) -> None:
    """gated_attention over an e4m3 cache with its scales equals the same kernel over the
    cache dequantized to ``dtype`` (the reference path's keys), sliding and global, one
    split and several; and both are close to float attention over the unquantized keys."""
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda import kv_fp8
    from musegl_cuda.cuda import kernels
    from musegl_cuda.cuda.plan import plan_step, rows_per_tile

    dev = torch.device(device)
    torch.manual_seed(2)
    hd, kvh, bs, nb = head_dim, kv_heads, 16, 24
    group = heads // kvh
    gate_offset = heads * hd + 2 * kvh * hd
    step = Step([SeqChunk(1, [3] * 10, list(range(30, 40)), list(range(0, 3))),
                 SeqChunk(2, [4], [70], list(range(3, 8))),
                 SeqChunk(3, [1] * 12, list(range(12)), list(range(10, 11)))])
    k = torch.randn(nb + 1, bs, kvh, hd, device=dev)
    v = torch.randn_like(k) * 3
    scales = torch.stack([torch.full((kvh,), kv_fp8.k_scale(hd)), torch.linspace(0.02, 0.05, kvh)]).to(dev)
    k8 = kv_fp8.quantize(k.view(-1, kvh, hd), scales[0])
    v8 = kv_fp8.quantize(v.view(-1, kvh, hd), scales[1])
    all_slots = torch.arange(k8.shape[0], device=dev)
    kd = kv_fp8.dequantize_rows(k8, all_slots, scales[0], dtype)
    vd = kv_fp8.dequantize_rows(v8, all_slots, scales[1], dtype)
    # dequantized in float32, so that the reference sees exactly the stored values times the scale
    kd32 = kv_fp8.dequantize_rows(k8, all_slots, scales[0], torch.float32)
    # The FP8 kernel reads e4m3 exactly and scales in float32, the other reads K and V rounded to
    # ``dtype`` (2^-9 of a value in bf16): the two agree to float32 rounding before the output's
    # roundings to ``dtype``, after which they may sit one unit in the last place apart (on both
    # sides of a rounding boundary). Outputs reach ~9 (V ~ 3·N(0,1)), where a bf16 unit is 0.0625:
    # a bound of 0.03 cannot hold (an H100 failed it, benchmarks/results/gpu_quantized_2026-12-07_h100;
    # these roundings emulated in torch: one unit, 0.0081 of the largest output, over 20 seeds,
    # benchmarks/results/kv_fp8_cpu_parity_2026-12-07).
    # Two units at the largest output: 2^-6 of it in bf16 (8 significant bits), 2^-9 in float16.
    relative = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9}.get(dtype)
    for block_m in (max(16, group), 64):
        plan = plan_step(step, bs, nb, 100, rows_per_tile(block_m, group), scratch_block=nb)
        q = torch.randn(plan.width, heads, hd, device=dev).to(dtype)
        tables, tiles = torch.from_numpy(plan.tables).to(dev), torch.from_numpy(plan.tiles).to(dev)
        gate = torch.randn(plan.width, 2 * heads * hd + 2 * kvh * hd, device=dev).to(dtype)
        for sliding in (False, True):
            for n in splits:
                where = (dtype, block_m, sliding, n)
                y8 = kernels.gated_attention(q, k8, v8, bs, tables, tiles, len(plan.tiles), n, block_m, 8, sliding,
                                             hd ** -0.5, gate, gate_offset, scales)
                yd = kernels.gated_attention(q, kd, vd, bs, tables, tiles, len(plan.tiles), n, block_m, 8, sliding,
                                             hd ** -0.5, gate, gate_offset)
                assert torch.isfinite(y8.float()).all(), where
                tol = 2e-5 if relative is None else relative * yd.float().abs().max().item()
                assert (y8.float() - yd.float()).abs().max().item() <= tol, where
                if dtype == torch.float32:  # the K scale inside the dot's sum or outside it: float rounding only
                    y32 = kernels.gated_attention(q, kd32, vd, bs, tables, tiles, len(plan.tiles), n, block_m, 8,
                                                  sliding, hd ** -0.5, gate, gate_offset)
                    assert torch.allclose(y8, y32, rtol=1e-5, atol=1e-6), where
