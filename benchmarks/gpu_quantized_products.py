"""Weight products from quantized weights as stored, against bf16, on the 30B layer shapes.

For each weight format this times the four products of a decoder layer
(q/k/v/gate 8704 x 6656, output 6656 x 4096, gate/up 39936 x 6656, down
6656 x 19968) at 1, 32 and 64 rows (decode batches) and a 2,048-row prefill chunk,
``--layers`` layers of distinct random matrices in one CUDA graph (so every launch
reads its weights from memory, not from the L2 cache), the median of
``--repeat`` replays:

* ``bf16``: ``F.linear`` (cuBLAS, no workspace, as the executor runs it);
* ``q4_k`` ``q5_k`` ``q6_k`` ``q8_0`` ``q4_0``: ``GGUFMatrix.matmul`` as the executor runs it
  (the decode GEMV up to ``device_weights.GEMV_ROWS`` rows, the tiles, the bf16 scratch from
  ``device_weights.SCRATCH_ROWS`` rows);
* ``<gguf type>_tiles``: :func:`musegl_cuda.cuda.quantized.gguf_matmul` (tensor-core tiles)
  at every width;
* ``fp8_weight``: e4m3 weights with one scale per output row, dequantized in the Triton
  kernels (the GEMV up to ``GEMV_ROWS`` rows, :func:`~musegl_cuda.cuda.quantized.fp8_matmul`
  past it); ``fp8_tiles``: ``fp8_matmul`` at every width;
* ``fp8_w8a8``: the same weights, activations quantized per row to e4m3 and
  ``torch._scaled_mm`` (:meth:`~musegl_cuda.cuda.device_weights.FP8Matrix.w8a8`);
* ``<gguf type>_via_bf16`` (rows >= ``--via-bf16-rows`` only): the alternative for prefill
  chunks and wide batches (``device_weights.SCRATCH_ROWS``), every weight row decoded to a
  bf16 scratch (``gemv.gguf_dequant``) and ``F.linear``.

``--gemv-sweep`` then times every launch config of the decode GEMV
(:func:`musegl_cuda.cuda.gemv.sweep_configs`) for ``--sweep-formats`` at ``--sweep-rows``
rows (``part: "gemv_sweep"``, the same per-layer timing and GB/s against bf16 cuBLAS at
the same rows), ``part: "gemv_best"`` lines name the fastest config per (format, rows):
what ``gemv.GEMV_CONFIGS`` should hold, and ``part: "gemv_shape"`` lines time that config
on each of the four shapes apart, in GB/s of stored bytes beside bf16 cuBLAS's GEMV.

One JSON line per (format, rows): microseconds per layer, the weight bytes streamed per
second, and the time as a ratio of bf16's at the same rows in the same run. The FP8 lines
are what ``--fp8-w8a8-rows`` should follow (W8A8 where it is faster, at 1, 64 and prefill);
the GGUF lines, against bf16, what the stored bytes buy at decode. ``--check`` first
compares every format's product with bf16 ``F.linear`` on its dequantized weights.

    python benchmarks/gpu_quantized_products.py --gemv-sweep --out $OUT/quantized_products.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # as the executor runs them

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "plugins" / "cuda")]

from musegl_cuda.cuda import gemv  # noqa: E402
from musegl_cuda.cuda.device_weights import FP8Matrix, GGUFMatrix  # noqa: E402
from musegl_cuda.cuda.quantized import GGUF_LAYOUTS  # noqa: E402
from musegl_cuda.quantization import quantize_fp8  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 6656, 32, 2, 128, 19968
SHAPES = {  # (out, in)
    "qkvg": ((2 * HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * FFN, HIDDEN),
    "down": (HIDDEN, FFN),
}
FORMATS = ("bf16", "q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "fp8_weight", "fp8_w8a8", "q4_k_tiles", "q6_k_tiles",
           "fp8_tiles", "q4_k_via_bf16", "q6_k_via_bf16")


def random_gguf(dtype: str, n: int, k: int, device: str) -> torch.Tensor:
    """Random blocks with a small positive float16 ``d`` (and ``dmin``)."""
    _, vb, bb, _ = GGUF_LAYOUTS[dtype]
    raw = torch.randint(0, 256, (n, k // vb, bb), dtype=torch.uint8, device=device)
    small = torch.tensor([2e-4], dtype=torch.float16).view(torch.uint8).to(device)
    spots = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}[dtype]
    for at in spots:
        raw[:, :, at:at + 2] = small
    return raw.reshape(n, -1)


def build(fmt: str, n: int, k: int, device: str):
    """``(product(x) -> y, stored bytes, the matrix)``."""
    if fmt == "bf16":
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        return (lambda x: F.linear(x, w)), w.numel() * 2, w
    if fmt.startswith("fp8"):
        q, scales = quantize_fp8(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02)
        matrix = FP8Matrix(q, scales, (1, k), torch.bfloat16, w8a8_rows=None)
        if fmt == "fp8_tiles":
            matrix.gemv_rows = 0
        fn = matrix.w8a8 if fmt == "fp8_w8a8" else matrix.matmul
        return fn, matrix.nbytes, matrix
    gguf_type = fmt.removesuffix("_via_bf16").removesuffix("_tiles")
    matrix = GGUFMatrix(gguf_type, random_gguf(gguf_type, n, k, device), n, k, torch.bfloat16)
    if fmt.endswith("_via_bf16"):
        matrix.scratch_rows = 1
    if fmt.endswith("_tiles"):
        matrix.scratch_rows, matrix.gemv_rows = None, 0
    return matrix.matmul, matrix.nbytes, matrix


def graph_us(fn, repeat: int) -> float:
    """Median microseconds of one replay of a CUDA graph of ``fn``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times)


def check(device: str, emit) -> int:
    """Each format's product against bf16 ``F.linear`` on its own dequantized weights."""
    from quantized_checks import dequantized

    failures = 0
    n, k = 512, 1024
    for fmt in FORMATS[1:]:
        if fmt.endswith("_via_bf16"):
            continue
        fn, _, matrix = build(fmt, n, k, device)
        if isinstance(matrix, FP8Matrix):
            weight = matrix.dequantized()
        else:
            weight = dequantized(matrix.dtype, matrix.data.cpu().numpy(), n, k).to(device)
        for m in (1, 5, 16, 64, 300):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = F.linear(x.float(), weight.float())
            err = float((fn(x).float() - want).abs().max() / want.abs().max())
            ok = err < (6e-2 if fmt == "fp8_w8a8" else 2e-2)
            failures += not ok
            emit(part="check", format=fmt, rows=m, rel_err=err, ok=ok)
    return failures


def layer_us(products: list[list], m: int, repeat: int, only: str | None = None) -> float:
    """Microseconds per layer of ``products`` (per layer, one ``x -> y`` per shape) at ``m`` rows;
    ``only``: that shape's product alone."""
    xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES.values()}

    def step() -> None:
        for layer in products:
            for fn, (name, (_, k)) in zip(layer, SHAPES.items()):
                if only is None or name == only:
                    fn(xs[k])

    return graph_us(step, repeat) / len(products)


def gemv_product(matrix, config):
    if isinstance(matrix, FP8Matrix):
        return lambda x: gemv.fp8_gemv(x, matrix.weight, matrix.scales, matrix.block, config=config)
    return lambda x: gemv.gguf_gemv(x, matrix.data, matrix.dtype, matrix.rows_count, matrix.cols, config=config)


def sweep(args, emit, bf16_us: dict[int, float]) -> None:
    """Every GEMV config of :func:`gemv.sweep_configs` per format and rows, then the fastest."""
    sweep_rows = [int(r) for r in args.sweep_rows.split(",")]
    torch.manual_seed(0)
    dense = [[build("bf16", n, k, "cuda")[0] for n, k in SHAPES.values()] for _ in range(args.layers)]
    shape_us: dict[tuple[str, int], float] = {}  # bf16 cuBLAS per shape and rows
    for m in sweep_rows:
        if m not in bf16_us:
            bf16_us[m] = layer_us(dense, m, args.repeat)
        for name in SHAPES:
            shape_us[name, m] = layer_us(dense, m, args.repeat, only=name)
    del dense
    for fmt in args.sweep_formats.split(","):
        kind = "fp8" if fmt.startswith("fp8") else fmt
        torch.manual_seed(0)
        built = [[build(fmt, n, k, "cuda") for n, k in SHAPES.values()] for _ in range(args.layers)]
        stored = sum(b for layer in built for _, b, _ in layer) / args.layers
        for m in sweep_rows:
            best = None
            for config in gemv.sweep_configs(kind):
                try:
                    us = layer_us([[gemv_product(mx, config) for _, _, mx in layer] for layer in built], m,
                                  args.repeat)
                except Exception as e:  # a config the compiler rejects (registers, shared memory)
                    emit(part="gemv_sweep", format=fmt, rows=m, config=attrs_dict(config), error=repr(e)[:300])
                    continue
                emit(part="gemv_sweep", format=fmt, rows=m, config=attrs_dict(config), us_per_layer=round(us, 1),
                     gb_per_s=round(stored / us / 1e3, 1), vs_bf16=round(us / bf16_us[m], 3))
                if best is None or us < best[0]:
                    best = (us, config)
            if best is not None:
                us, config = best
                emit(part="gemv_best", format=fmt, rows=m, config=attrs_dict(config), us_per_layer=round(us, 1),
                     gb_per_s=round(stored / us / 1e3, 1), vs_bf16=round(us / bf16_us[m], 3),
                     table=attrs_dict(gemv.gemv_config(kind, m)))
                for name, (n, k) in SHAPES.items():  # the four products apart, against bf16's GEMV
                    one = layer_us([[gemv_product(mx, config) for _, _, mx in layer] for layer in built], m,
                                   args.repeat, only=name)
                    nbytes = dict(zip(SHAPES, (b for _, b, _ in built[0])))[name]
                    emit(part="gemv_shape", format=fmt, rows=m, shape=name, out=n, depth=k,
                         config=attrs_dict(config), us=round(one, 2), gb_per_s=round(nbytes / one / 1e3, 1),
                         bf16_us=round(shape_us[name, m], 2),
                         bf16_gb_per_s=round(n * k * 2 / shape_us[name, m] / 1e3, 1),
                         vs_bf16=round(one / shape_us[name, m], 3))
        del built
        torch.cuda.empty_cache()


def attrs_dict(config) -> dict:
    import attrs

    return attrs.asdict(config)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,2048")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--layers", type=int, default=4, help="layers of distinct matrices in one graph (default 4)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--via-bf16-rows", type=int, default=16, help="the *_via_bf16 formats from this many rows")
    p.add_argument("--gemv-sweep", action="store_true", help="also time every decode GEMV config")
    p.add_argument("--sweep-formats", default="q4_k,q6_k,fp8_weight")
    p.add_argument("--sweep-rows", default="1,4,8")
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "tests"))
    out = open(args.out, "a") if args.out else None

    def emit(**fields) -> None:
        line = json.dumps(fields)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    device = "cuda"
    emit(part="device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    failures = 0 if args.no_check else check(device, emit)
    rows = [int(r) for r in args.rows.split(",")]
    bf16_us: dict[int, float] = {}
    for fmt in args.formats.split(","):
        torch.manual_seed(0)
        layers = [[build(fmt, n, k, device) for n, k in SHAPES.values()] for _ in range(args.layers)]
        stored = sum(b for layer in layers for _, b, _ in layer) / args.layers
        for m in rows:
            if fmt.endswith("_via_bf16") and m < args.via_bf16_rows:
                continue
            xs = {k: torch.randn(m, k, device=device, dtype=torch.bfloat16) for _, k in SHAPES.values()}

            def step() -> None:
                for layer in layers:
                    for (fn, _, _), (_, k) in zip(layer, SHAPES.values()):
                        fn(xs[k])

            us = graph_us(step, args.repeat) / args.layers
            if fmt == "bf16":
                bf16_us[m] = us
            emit(part="product", format=fmt, rows=m, us_per_layer=round(us, 1),
                 stored_mb_per_layer=round(stored / 1e6, 1), tb_per_s=round(stored / us / 1e6, 3),
                 gb_per_s=round(stored / us / 1e3, 1),
                 vs_bf16=round(us / bf16_us[m], 3) if m in bf16_us else None)
        del layers
        torch.cuda.empty_cache()
    if args.gemv_sweep:
        sweep(args, emit, bf16_us)
    if out is not None:
        out.close()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
