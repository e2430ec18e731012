"""Checks of the quantized-weight kernels (:mod:`musegl_cuda.cuda.quantized`) against
independent references: gguf-py's dequantizers for the GGUF blocks, float32 ``q · scale``
for FP8. Run on the CPU under ``TRITON_INTERPRET=1`` (the slow tier) or on a GPU
(``test_gpu_quantized.py``); each check raises AssertionError with the numbers.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from musegl_cuda.cuda.quantized import GGUF_LAYOUTS


def random_blocks(dtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """``(n, row_bytes)`` random GGUF ``dtype`` blocks: every quant and scale byte random,
    the float16 ``d``/``dmin`` small and positive (values about ±0.3 at most)."""
    rng = np.random.default_rng(seed)
    _, vb, bb, _ = GGUF_LAYOUTS[dtype]
    raw = rng.integers(0, 256, size=(n, k // vb, bb), dtype=np.uint8)

    def halves(count: int, lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, size=(n, k // vb, count)).astype(np.float16).view(np.uint8)

    if dtype == "q8_0":
        raw[:, :, :2] = halves(1, 1e-3, 3e-3)
    elif dtype == "q4_0":
        raw[:, :, :2] = halves(1, 5e-3, 2e-2)
    elif dtype in ("q4_k", "q5_k"):
        raw[:, :, :4] = halves(2, 1e-4, 3e-4)
    else:  # q6_k: d last
        raw[:, :, 208:210] = halves(1, 1e-5, 3e-5)
    return raw.reshape(n, -1)


def dequantized(dtype: str, data: np.ndarray, n: int, k: int) -> torch.Tensor:
    """gguf-py's float32 decoding of ``data`` (the reference)."""
    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[dtype.upper()])
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(n, k))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / max(want.double().abs().max().item(), 1e-30))


def check_gguf(device: str, act_dtype: torch.dtype, rows=(1, 5, 70), n: int = 72, k: int = 512) -> list[dict]:
    """Every GGUF type: ``gguf_matmul`` at each of ``rows`` activation rows and ``gguf_rows``
    (the embedding), the scratch's decoding (``gguf_dequant``, bit for bit) and a product
    through a decoded scratch (``GGUFMatrix.scratch_rows``),
    against gguf-py's dequantization; float32 activations must agree to
    1e-5 of the largest output, bf16 to 2e-2 (the activations and decoded weights are
    rounded to bf16 before the tensor cores)."""
    from musegl_cuda.cuda import device_weights
    from musegl_cuda.cuda.device_weights import GGUFMatrix
    from musegl_cuda.cuda.gemv import gguf_dequant
    from musegl_cuda.cuda.quantized import gguf_matmul, gguf_rows

    tol = 1e-5 if act_dtype == torch.float32 else 2e-2
    results = []
    for dtype in GGUF_LAYOUTS:
        data = random_blocks(dtype, n, k, seed=len(results))
        ref = dequantized(dtype, data, n, k)
        w = torch.from_numpy(data).to(device)
        for m, splits in [(m, None) for m in rows] + [(rows[0], 3)]:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, act_dtype)
            got = gguf_matmul(x, w, dtype, n, k, splits=splits).float().cpu()
            err = _rel(got, x.float().cpu().double() @ ref.double().T)
            results.append(dict(kind=dtype, rows=m, splits=splits, rel_err=err))
            assert err < tol, f"{dtype} x {m} rows ({splits} splits): relative error {err}"
        scratch = GGUFMatrix(dtype, w, n, k, act_dtype, scratch_rows=rows[-1])  # decoded, then F.linear
        x = torch.randn(rows[-1], k, generator=torch.Generator().manual_seed(9)).to(device, act_dtype)
        err = _rel(scratch.matmul(x).float().cpu(), x.float().cpu().double() @ ref.double().T)
        results.append(dict(kind=f"{dtype} via scratch", rows=rows[-1], rel_err=err))
        assert err < tol, f"{dtype} x {rows[-1]} rows through a scratch: relative error {err}"
        saved = device_weights.SCRATCH_BYTES, device_weights.SLAB_ALIGN
        device_weights.SCRATCH_BYTES = 5 * k * x.element_size()  # slabs of 5 weight rows, the last shorter
        device_weights.SLAB_ALIGN = 1
        try:
            err = _rel(scratch.matmul(x).float().cpu(), x.float().cpu().double() @ ref.double().T)
        finally:
            device_weights.SCRATCH_BYTES, device_weights.SLAB_ALIGN = saved
        results.append(dict(kind=f"{dtype} via scratch slabs", rows=rows[-1], rel_err=err))
        assert err < tol, f"{dtype} x {rows[-1]} rows through scratch slabs: relative error {err}"
        ids = torch.tensor([3, 0, n - 1, 3, 17, 40], device=device)
        got = gguf_rows(ids, w, dtype, k, act_dtype).float().cpu()
        want = ref[ids.cpu()].to(act_dtype).float()
        assert torch.equal(got, want), f"{dtype} rows: max difference {(got - want).abs().max()}"
        got = gguf_dequant(w[5:], dtype, n - 5, k, act_dtype).float().cpu()  # a slab: rows 5..n-1
        want = ref[5:].to(act_dtype).float()
        assert torch.equal(got, want), f"{dtype} scratch decoding: max difference {(got - want).abs().max()}"
    return results


def check_fp8(device: str, act_dtype: torch.dtype, rows=(1, 5, 70), n: int = 200, k: int = 384) -> list[dict]:
    """``fp8_matmul`` (weight-only) for one scale, one per row, 128 x 128 blocks and blocks
    narrower than its depth tile (scaled per value), with the depth split or not, and
    :class:`~musegl_cuda.cuda.device_weights.FP8Matrix`'s W8A8 product (``torch._scaled_mm``)
    against the same product of its per-row quantized activations, in float64."""
    from musegl_cuda.cuda.device_weights import FP8Matrix
    from musegl_cuda.cuda.quantized import fp8_matmul
    from musegl_cuda.quantization import E4M3_MAX

    tol = 1e-5 if act_dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    bits[(bits & 0x7F) == 0x7F] = 0  # no NaN patterns
    q = bits.view(torch.float8_e4m3fn)
    results = []
    for block in ((n, k), (1, k), (128, 128), (64, 96)):
        scales = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 1e-3 + 1e-4
        full = scales.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        ref = q.float() * full
        for m, splits in [(m, None) for m in rows] + [(rows[0], 2)]:
            x = torch.randn(m, k, generator=gen).to(device, act_dtype)
            got = fp8_matmul(x, q.to(device), scales.to(device), block, splits=splits).float().cpu()
            err = _rel(got, x.float().cpu().double() @ ref.double().T)
            results.append(dict(kind=f"fp8 {block}", rows=m, splits=splits, rel_err=err))
            assert err < tol, f"fp8 blocks {block} x {m} rows ({splits} splits): relative error {err}"
    rows16 = n // 16 * 16  # torch._scaled_mm takes dimensions in multiples of 16
    row_scales = torch.rand(rows16, 1, generator=gen) * 1e-3 + 1e-4
    matrix = FP8Matrix(q[:rows16].to(device), row_scales.to(device), (1, k), act_dtype, w8a8_rows=1)
    assert matrix.w8a8_rows == 1
    assert FP8Matrix(q.to(device), torch.ones(n, 1, device=device), (1, k), act_dtype, 1).w8a8_rows is None
    ref = q[:rows16].float() * row_scales
    for m in rows:
        x = torch.randn(m, k, generator=gen).to(device, act_dtype)
        xf = x.float().cpu()
        x_scale = (xf.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        xq = (xf / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() * x_scale.double()
        got = matrix.matmul(x).float().cpu()
        err = _rel(got, xq @ ref.double().T)
        results.append(dict(kind="fp8 w8a8", rows=m, rel_err=err))
        assert err < tol, f"fp8 W8A8 x {m} rows: relative error {err}"
    return results


def check_gguf_model(path, device: str = "cpu", prompt_len: int = 6, decode: int = 1) -> dict:
    """A GGUF (e.g. :func:`q4km_support.write_q4_k_m`) loaded as stored on ``device`` with
    float32 activations (:meth:`MuseGlimmerDecoder.load_device`: the Triton kernels,
    the embedding and head included) against the same file dequantized by gguf-py and
    loaded as float32 tensors: the logits of a prompt and of decode steps after it must
    agree to 1e-4 of their largest value, the greedy tokens must be identical, the prompt
    through the paged forward (the one CUDA runs) must agree likewise, and the weights on
    the device must take the file's tensor bytes (at most 1.1 x)."""
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.executor import TorchExecutor
    from musegl_cuda.model import MuseGlimmerDecoder

    checkpoint = load_checkpoint(path)
    reference = TorchExecutor(checkpoint, device="cpu", dtype="float32", weights="upcast")
    quantized = TorchExecutor(checkpoint, device="cpu", dtype="float32", weights="upcast")
    model = MuseGlimmerDecoder(checkpoint.config, torch.float32, torch.device(device), device_weights=True)
    for stored in checkpoint.iter_stored():
        model.load_device(stored)
    weight_bytes = model.finish_device()
    quantized.model = model.eval()  # the same executor, its matrices as stored (device_weights)
    file_bytes = sum(t.data.nbytes for n, t in checkpoint.reader._tensors.items()
                     if len(t.shape) == 2 or not n.endswith("norm.weight"))
    matrix_bytes = sum(weight_bytes.values())
    assert matrix_bytes <= 1.1 * file_bytes, (matrix_bytes, file_bytes)
    tokens = list(np.random.default_rng(3).integers(4, checkpoint.config.vocab_size, size=prompt_len))
    worst, greedy = 0.0, []
    for executor in (reference, quantized):
        executor.allocate_kv(8)
    seqs = {}
    for name, executor in (("reference", reference), ("quantized", quantized)):
        ids, chunk = list(tokens), SeqChunk(0, tokens, list(range(prompt_len)), [0, 1, 2, 3], logit_rows=True)
        out = executor.step(Step([chunk]))
        rows = [out.logits[0][-1].float()]
        for i in range(decode):
            ids.append(int(rows[-1].argmax()))
            out = executor.step(Step([SeqChunk(0, [ids[-1]], [len(ids) - 1], [0, 1, 2, 3], logit_rows=True)]))
            rows.append(out.logits[0][-1].float())
        seqs[name] = (torch.stack([torch.as_tensor(r) for r in rows]), ids)
    ref, got = seqs["reference"][0], seqs["quantized"][0]
    worst = float((ref - got).abs().max() / ref.abs().max())
    assert worst < 1e-4, f"logits differ by {worst} of their largest value"
    assert seqs["reference"][1] == seqs["quantized"][1], (seqs["reference"][1], seqs["quantized"][1])
    greedy = seqs["quantized"][1][prompt_len:]
    paged = _paged_prompt_logits(quantized, tokens)
    paged_err = float((paged - ref[0]).abs().max() / ref[0].abs().max())
    assert paged_err < 1e-4, f"paged forward: logits differ by {paged_err} of their largest value"
    types = sorted({p.dtype for layer in model.layers for p in layer.self_attn.qkvg_matrix.parts}
                   | {model.lm_head.matrix.dtype, model.embed_matrix.dtype})
    return dict(rel_err=worst, paged_rel_err=paged_err, greedy=greedy, weight_bytes=weight_bytes,
                file_bytes=file_bytes, types=types)


def _paged_prompt_logits(executor, tokens: list[int]) -> torch.Tensor:
    """The last prompt row's logits through :meth:`MuseGlimmerDecoder.forward_paged` (the
    forward CUDA runs: the Triton attention, norm and product kernels), in a fresh cache
    with the paged path's scratch block (blocks 0-7, scratch 8)."""
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.cuda.plan import plan_step, rows_per_tile

    c = executor.config
    executor.allocate_kv(9)
    step = Step([SeqChunk(0, tokens, list(range(len(tokens))), [0, 1, 2, 3])])
    plan = plan_step(step, executor.block_size, 8, c.vocab_size,
                     rows_per_tile(executor.prefill_block_m, c.num_heads // c.num_kv_heads))
    with torch.inference_mode():
        normed, _ = executor._forward_plan(plan, executor.kv, executor.prefill_block_m)
        return executor.model.logits(normed[-1:])[0].float()


def compile_for_hopper(kinds=(("q4_k", 16, 32), ("q6_k", 64, 64), ("q8_0", 16, 32)), act: str = "bf16") -> list[str]:
    """Compile the product kernels of ``kinds`` (GGUF type, BLOCK_M, BLOCK_N), one embedding
    gather and both FP8 products for an sm_90 GPU, through PTX and ptxas, without a GPU
    (what the interpreter cannot check: layouts, the tensor-core shapes, the casts).
    Returns one line per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from musegl_cuda.cuda import quantized as q

    target = GPUTarget("cuda", 90, 32)
    precision = "ieee" if act == "fp32" else "tf32"
    done = []

    def build(fn, signature: dict, constants: dict, name: str) -> None:
        signature = {**signature, **{k: "constexpr" for k in constants}}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=target,
                                options={"num_warps": 4})
        assert kernel.asm.get("cubin"), name
        done.append(f"{name}: {len(kernel.asm['cubin'])} bytes of sm_90 code")

    for dtype, block_m, block_n in kinds:
        code, vb, bb, pb = q.GGUF_LAYOUTS[dtype]
        layout = dict(QTYPE=code, VB=vb, BB=bb, PB=pb, P=max(pb, q.POSITIONS))
        build(q._gguf_matmul_kernel,
              {"X": f"*{act}", "W": "*u8", "Y": f"*{act}", "M": "i32", "N": "i32", "nblocks": "i32",
               "per_split": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "stride_ys": "i32"},
              dict(layout, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision), f"{dtype} {block_m}x{block_n}")
    build(q._gguf_rows_kernel, {"Ids": "*i64", "W": "*u8", "Out": f"*{act}", "T": "i32", "nblocks": "i32",
                                "stride_wn": "i32", "stride_out": "i32"},
          dict(QTYPE=12, VB=256, BB=144, PB=128, P=128, BLOCK_T=16), "q4_k rows")
    for tile in (True, False):
        build(q._fp8_matmul_kernel,
              {"X": f"*{act}", "W": "*u8", "S": "*fp32", "Y": f"*{act}", "M": "i32", "N": "i32", "K": "i32",
               "per_split": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "stride_ys": "i32",
               "stride_sn": "i32"},
              dict(SBN=1 if tile else 128, SBK=6656 if tile else 64, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
                   TILE_SCALE=tile, PRECISION=precision), f"fp8 scaled per {'tile' if tile else 'value'}")
    return done


def check_gemv(device: str, act_dtype: torch.dtype, rows=(1, 5), n: int = 40, k: int = 512) -> list[dict]:
    """The skinny decode products (:mod:`musegl_cuda.cuda.gemv`) against the float32 dequantized
    references: every GGUF type (gguf-py's dequantizers) and FP8 with one scale per row, 128 x 128
    blocks and blocks narrower than a step, at each of ``rows`` activation rows, with the
    table's launch and with a config of 2-row programs and 3 depth splits (a row count that
    is not a multiple of the programs' and parts of unequal length); float32 activations agree
    to 1e-5 of the largest output, bf16 to 2e-2."""
    from musegl_cuda.cuda.gemv import GemvConfig, fp8_gemv, gguf_gemv

    tol = 1e-5 if act_dtype == torch.float32 else 2e-2
    odd = GemvConfig(block_n=2, blocks=4, split_k=3, num_warps=2)
    results = []
    for dtype in GGUF_LAYOUTS:
        data = random_blocks(dtype, n + 3, k, seed=7 + len(results))
        ref = dequantized(dtype, data, n + 3, k).double()
        w = torch.from_numpy(data).to(device)
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, act_dtype)
            want = x.float().cpu().double() @ ref.T
            for config in (None, odd):
                got = gguf_gemv(x, w, dtype, n + 3, k, config=config).float().cpu()
                err = _rel(got, want)
                results.append(dict(kind=f"gemv {dtype}", rows=m, config=str(config), rel_err=err))
                assert err < tol, f"gemv {dtype} x {m} rows ({config}): relative error {err}"
    gen = torch.Generator().manual_seed(2)
    bits = torch.randint(0, 256, (n + 3, k), dtype=torch.uint8, generator=gen)
    bits[(bits & 0x7F) == 0x7F] = 0  # no NaN patterns
    q = bits.view(torch.float8_e4m3fn)
    for block in ((1, k), (128, 128), (16, 48)):
        scales = torch.rand(-(-(n + 3) // block[0]), -(-k // block[1]), generator=gen) * 1e-3 + 1e-4
        full = scales.repeat_interleave(block[0], 0)[:n + 3].repeat_interleave(block[1], 1)[:, :k]
        ref = (q.float() * full).double()
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(device, act_dtype)
            want = x.float().cpu().double() @ ref.T
            for config in (None, odd):
                got = fp8_gemv(x, q.to(device), scales.to(device), block, config=config).float().cpu()
                err = _rel(got, want)
                results.append(dict(kind=f"gemv fp8 {block}", rows=m, config=str(config), rel_err=err))
                assert err < tol, f"gemv fp8 {block} x {m} rows ({config}): relative error {err}"
    return results


def check_quantize_rows(device: str, act_dtype: torch.dtype, m: int = 5, k: int = 300) -> None:
    """:func:`~musegl_cuda.cuda.quantized.quantize_rows_e4m3` (W8A8's activations, one launch)
    writes the bytes and scales of the torch expression it replaces, a zero row included."""
    from musegl_cuda.cuda.quantized import quantize_rows_e4m3
    from musegl_cuda.quantization import E4M3_MAX

    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(4)) * 3).to(act_dtype)
    x[1] = 0.0
    x[2, 7] = 1e-30 if act_dtype == torch.float32 else 0.0  # subnormal codes in the row
    xf = x.float()
    want_scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    want = (xf / want_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q, scale = quantize_rows_e4m3(x.to(device))
    assert torch.equal(scale.cpu(), want_scale), (scale.cpu() - want_scale).abs().max()
    same = q.cpu().view(torch.uint8) == want.view(torch.uint8)
    assert bool(same.all()), f"{int((~same).sum())} bytes differ"


def compile_gemv_for_hopper(act: str = "bf16", kinds=("q4_k", "q5_k", "q6_k", "q8_0", "q4_0"),
                            rows=(1, 8)) -> list[dict]:
    """Compile the decode GEMV kernels (:mod:`musegl_cuda.cuda.gemv`, the table's launches at
    ``rows`` activation rows), the scratch's decoder and W8A8's activation quantizer for an sm_90 GPU without a GPU.
    Returns per kernel its registers, spilled bytes and its global loads: 16-byte vectors
    (``ld.global...v4``), others, and asynchronous copies (``cp.async``: the loop's loads
    pipelined), the facts the interpreter cannot give."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from musegl_cuda.cuda import gemv
    from musegl_cuda.cuda import quantized as q

    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    target = GPUTarget("cuda", 90, 32)
    done = []
    ptxas = get_ptxas(90).path

    def build(fn, signature: dict, constants: dict, name: str, warps: int, aligned: tuple[int, ...]) -> None:
        signature = {**signature, **{k: "constexpr" for k in constants}}
        attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
        src = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
        kernel = triton.compile(src, target=target, options={"num_warps": warps})
        assert kernel.asm.get("cubin"), name
        ptx = kernel.asm["ptx"]
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
                                  capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores", info)
        done.append(dict(kernel=name, regs=int(regs.group(1)) if regs else None,
                         spill_bytes=int(spill.group(1)) if spill else None,
                         v4_loads=len(re.findall(r"ld\.global[.\w]*\.v4", ptx)),
                         loads=len(re.findall(r"ld\.global", ptx)),
                         async_copies=len(re.findall(r"cp\.async\.c[ag]", ptx))))
    sig = {"X": f"*{act}", "W": "*u8", "Y": f"*{act}", "M": "i32", "N": "i32", "nblocks": "i32",
           "per_split": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "stride_ys": "i32"}
    for dtype in kinds:
        code, vb, bb, _ = q.GGUF_LAYOUTS[dtype]
        for m in rows:
            cfg = gemv.gemv_config(dtype, m)
            blocks = 1 if vb == 256 else cfg.blocks
            build(gemv._gguf_gemv_kernel, sig,
                  dict(QTYPE=code, BB=bb, BLOCK_M=gemv._rows_tile(m), BLOCK_N=cfg.block_n, BLOCKS=blocks,
                       G=gemv._GROUPS[dtype] or blocks, R=gemv._GROUP_VALUES[dtype], STAGES=3),
                  f"gemv {dtype} x{m}", cfg.num_warps, (0, 1, 2, 7, 8))
        build(gemv._gguf_dequant_kernel, {"W": "*u8", "Out": f"*{act}", "N": "i32", "nblocks": "i32",
                                          "stride_wn": "i32", "stride_on": "i32"},
              dict(QTYPE=code, BB=bb, BLOCK_N=16, BLOCKS=1 if vb == 256 else 8), f"dequant {dtype}", 4, (0, 1, 4, 5))
    fsig = {"X": f"*{act}", "W": "*u8", "S": "*fp32", "Y": f"*{act}", "M": "i32", "N": "i32", "K": "i32",
            "per_split": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "stride_ys": "i32",
            "stride_sn": "i32"}
    for m in rows:
        cfg = gemv.gemv_config("fp8", m)
        for row_scale in (True, False):
            build(gemv._fp8_gemv_kernel, fsig,
                  dict(SBN=1 if row_scale else 128, SBK=6656 if row_scale else 128, BLOCK_M=gemv._rows_tile(m),
                       BLOCK_N=cfg.block_n, BLOCK_K=16 * cfg.blocks, ROW_SCALE=row_scale, STAGES=3),
                  f"gemv fp8 x{m} {'row' if row_scale else 'block'} scales", cfg.num_warps, (0, 1, 3, 6, 8, 9))
    build(q._quantize_rows_kernel, {"X": f"*{act}", "Q": "*u8", "S": "*fp32", "K": "i32", "stride_xm": "i32",
                                    "stride_qm": "i32"},
          dict(E4M3_MAX=448.0, BLOCK_K=4096), "w8a8 activations", 8, (0, 1, 3, 4, 5))
    return done
