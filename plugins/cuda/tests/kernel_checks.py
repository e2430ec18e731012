"""Every Triton kernel of ``musegl_cuda.cuda.kernels`` against plain torch, on any device.

Shared by the GPU test (``test_gpu.py``, the compiled kernels) and the CPU
test (``test_kernels_interpreted.py``, the same kernels run by Triton's
interpreter, ``TRITON_INTERPRET=1``), so the kernels' logic is checked on
machines without a GPU too.
"""

from __future__ import annotations

import torch


def check_kernels(device: str, dtypes: tuple[torch.dtype, ...], heads: int, kv_heads: int, head_dim: int,
                  small: bool = False) -> None:
    """Raise AssertionError where a kernel disagrees with its reference. ``small``:
    fewer and shorter chunks and fewer split settings (for the interpreter)."""
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.cuda import kernels
    from musegl_cuda.model import CenteredRMSNorm, RotaryEmbedding, apply_rope, plain_rms_norm
    from musegl_cuda.cuda.plan import plan_step, reference_attention, rows_per_tile

    dev = torch.device(device)
    torch.manual_seed(0)
    hd, kvh, bs, nb = head_dim, kv_heads, 16, 64
    group = heads // kvh
    gate_offset = heads * hd + 2 * kvh * hd
    first, last = (12, 20) if small else (40, 150)
    step = Step([SeqChunk(1, [3] * first, list(range(70, 70 + first)), list(range(0, 8))),
                 SeqChunk(2, [4], [200], list(range(8, 21))),
                 SeqChunk(3, [1] * last, list(range(last)), list(range(30, 40)))])
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
    for dtype in dtypes:
        tol = tolerance[dtype]
        kc = torch.randn(nb + 1, bs, kvh, hd, dtype=dtype, device=dev)
        vc = torch.randn_like(kc)
        kf, vf = kc.view(-1, kvh, hd), vc.view(-1, kvh, hd)
        decode_m = max(16, group)
        settings = ((decode_m, 1, None), (decode_m, 3, 40)) if small else (
            (decode_m, 1, None), (decode_m, 4, 200), (decode_m, 16, None), (64, 2, None), (128, 1, None))
        for block_m, splits, width in settings:
            plan = plan_step(step, bs, nb, 100, rows_per_tile(block_m, group), width=width, scratch_block=nb)
            q = torch.randn(plan.width, heads, hd, dtype=dtype, device=dev)
            tables, tiles = torch.from_numpy(plan.tables).to(dev), torch.from_numpy(plan.tiles).to(dev)
            for sliding in (False, True):
                where = (dtype, block_m, splits, sliding)
                ref = reference_attention(q.cpu().float(), kf.cpu().float(), vf.cpu().float(), plan, bs, sliding,
                                          64, hd ** -0.5)
                partial = kernels.paged_attention(q, kf, vf, bs, tables, tiles, len(plan.tiles), splits, block_m,
                                                  64, sliding, hd ** -0.5)
                gate = torch.full((plan.width, 2 * heads * hd + 2 * kvh * hd), 40.0, dtype=dtype, device=dev)
                y = kernels.combine_gate(*partial, gate, gate_offset, dtype).view(-1, heads, hd)
                assert (y.float().cpu() - ref).abs().max().item() <= tol, where
                # the path the model takes (one launch with one split) gives the same values bit for bit
                gate = torch.randn_like(gate)
                y1 = kernels.combine_gate(*partial, gate, gate_offset, dtype)
                y2 = kernels.gated_attention(q, kf, vf, bs, tables, tiles, len(plan.tiles), splits, block_m, 64,
                                             sliding, hd ** -0.5, gate, gate_offset)
                assert torch.equal(y1, y2), where

        rows = 7
        qkvg = torch.randn(rows, 2 * heads * hd + 2 * kvh * hd, dtype=dtype, device=dev)
        cos, sin = RotaryEmbedding(hd, 10000.0, dev)(torch.arange(rows, device=dev) + 5, dtype)
        slots = torch.tensor([0, 5, 9, 17, 33, 40, 99], device=dev)
        k2, v2 = torch.zeros_like(kf), torch.zeros_like(vf)
        q = kernels.qk_norm_rope_store(qkvg, cos, sin, slots, k2, v2, heads, kvh, hd, 1e-6, 3.87, True)
        q_ref = apply_rope(plain_rms_norm(qkvg[:, :heads * hd].view(rows, heads, hd), 1e-6) * 3.87, cos, sin)
        k_ref = apply_rope(plain_rms_norm(qkvg[:, heads * hd:(heads + kvh) * hd].view(rows, kvh, hd), 1e-6), cos, sin)
        # bf16: one rounding step of the largest values (the reduction order differs)
        assert torch.allclose(q.float(), q_ref.float(), rtol=tol, atol=tol)
        assert torch.allclose(k2[slots].float(), k_ref.float(), rtol=tol, atol=tol)
        assert torch.equal(v2[slots], qkvg[:, (heads + kvh) * hd:(heads + 2 * kvh) * hd].view(rows, kvh, hd))
        untouched = torch.ones(len(kf), dtype=torch.bool, device=dev)
        untouched[slots] = False
        assert not k2[untouched].any() and not v2[untouched].any()

        n = 1000
        o, h = torch.randn(rows, n, dtype=dtype, device=dev), torch.randn(rows, n, dtype=dtype, device=dev)
        post, pre = CenteredRMSNorm(n, 1e-8, dev), CenteredRMSNorm(n, 1e-6, dev)
        post.load(torch.randn(n) * 0.3)
        pre.load(torch.randn(n) * 0.3)
        h2, x = kernels.add_norm(o, h, post.scale, 1e-8, pre.scale, 1e-6)
        h_ref = h + post(o)
        assert torch.allclose(h2.float(), h_ref.float(), rtol=tol, atol=tol)
        assert torch.allclose(x.float(), pre(h_ref).float(), rtol=tol, atol=tol)
        same, x = kernels.add_norm(None, h, None, 0.0, pre.scale, 1e-6)  # the first layer's input norm
        assert same is h and torch.allclose(x.float(), pre(h).float(), rtol=tol, atol=tol)
        h3, none = kernels.add_norm(o, h, post.scale, 1e-8, None, 0.0)
        assert none is None and torch.equal(h3, h2)
        w = torch.randn(n, device=dev)  # the last layer's: the final norm, a plain weight
        h4, x4 = kernels.add_norm(o, h, post.scale, 1e-8, w, 1e-6)
        assert torch.equal(h4, h2)
        assert torch.allclose(x4.float(), plain_rms_norm(h_ref, 1e-6, w).float(), rtol=tol, atol=tol)

        gu = torch.randn(rows, 2 * n, dtype=dtype, device=dev)
        silu = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
        assert torch.allclose(kernels.silu_mul(gu).float(), silu.float(), rtol=tol, atol=tol)

        z = torch.randn(rows, 3000, dtype=dtype, device=dev) * 20
        for cap in (30.0, None):
            eager = z * 0.75
            if cap is not None:
                eager = torch.tanh(eager / cap) * cap
            assert torch.allclose(kernels.softcap_logits(z, 0.75, cap), eager.float(), rtol=tol, atol=tol)


def check_long_decode_attention(device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                                keys: int, splits: tuple[int, ...]) -> None:
    """Decode rows at long contexts (``keys`` positions, scattered blocks) split over
    many programs, as the global layers of a few-row step are
    (``kernels.layer_splits``): every split count gives the reference attention, splits
    past a row's keys (the shorter sequence) included, and the one-launch and
    combined paths agree."""
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.cuda import kernels
    from musegl_cuda.cuda.plan import plan_step, reference_attention, rows_per_tile

    dev = torch.device(device)
    torch.manual_seed(1)
    hd, kvh, bs = head_dim, kv_heads, 16
    group = heads // kvh
    per_seq = -(-keys // bs)
    nb = 2 * per_seq
    order = torch.randperm(nb).tolist()
    step = Step([SeqChunk(1, [3], [keys - 1], order[:per_seq]), SeqChunk(2, [4], [keys // 3], order[per_seq:]),
                 SeqChunk(3, [5], [40], order[per_seq:per_seq + 3])])
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    kc = torch.randn(nb + 1, bs, kvh, hd, dtype=dtype, device=dev)
    vc = torch.randn_like(kc)
    kf, vf = kc.view(-1, kvh, hd), vc.view(-1, kvh, hd)
    block_m = max(16, group)
    plan = plan_step(step, bs, nb, 100, rows_per_tile(block_m, group), width=4, scratch_block=nb, num_tiles=4)
    q = torch.randn(plan.width, heads, hd, dtype=dtype, device=dev)
    tables, tiles = torch.from_numpy(plan.tables).to(dev), torch.from_numpy(plan.tiles).to(dev)
    ref = reference_attention(q.cpu().float(), kf.cpu().float(), vf.cpu().float(), plan, bs, False, 64, hd ** -0.5)
    gate = torch.full((plan.width, 2 * heads * hd + 2 * kvh * hd), 40.0, dtype=dtype, device=dev)
    gate_offset = heads * hd + 2 * kvh * hd
    for n in splits:
        partial = kernels.paged_attention(q, kf, vf, bs, tables, tiles, len(plan.tiles), n, block_m, 64, False,
                                          hd ** -0.5)
        y = kernels.combine_gate(*partial, gate, gate_offset, dtype).view(-1, heads, hd)
        assert (y[:3].float().cpu() - ref[:3]).abs().max().item() <= tol, (dtype, n)
        y2 = kernels.gated_attention(q, kf, vf, bs, tables, tiles, len(plan.tiles), n, block_m, 64, False,
                                     hd ** -0.5, gate, gate_offset)
        assert torch.equal(y.view(len(y), -1), y2), (dtype, n)
