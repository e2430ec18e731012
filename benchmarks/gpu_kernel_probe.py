"""Launch settings of the CUDA path's small kernels, measured at the 30B shape.

Three parts, one JSON line per figure:

* ``attention``: the paged attention kernel alone (plus the gate merge
  where it has more than one split), 52 launches captured in one CUDA graph,
  each over its own layer's cache (so nothing is served from L2 that a real
  step would read from memory), at each ``--batches`` x ``--contexts``:
  microseconds per layer for each split count, and with ``--sweep`` for
  each block size / warps / stages setting;
* ``step``: the whole decode graph of the executor (dummy 30B weights) at
  batch 1 and 64: graph replay time and step time (``executor.step``
  between two events), for each named setting of :mod:`musegl_cuda.cuda.kernels`
  or :mod:`musegl_cuda.model` (``--settings``), the graphs recaptured for
  each. ``reference`` loads ``--reference`` (another ``kernels.py``, e.g. the
  previous commit's) in place of the current kernels. Every setting decodes
  the same tokens, so settings that change no arithmetic print the same ids
  (``blas=cublaslt`` sends torch's products through cuBLASLt instead);
* ``host``: a step's parts outside the graph (replay alone, replay + the
  ids' copy, staging + replay, ``executor.step``, building the step too).
  The first two replay the inputs a capture leaves (one position per row),
  so their attention is nearly free; the others stage real rows.

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "cuda"), str(ROOT / "benchmarks")]

from musegl_core.engine.executor import SeqChunk, Step  # noqa: E402
from musegl_cuda.cuda import graphs as graphs_module  # noqa: E402
from musegl_cuda.cuda import kernels  # noqa: E402
from musegl_cuda import model as model_module  # noqa: E402


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def graph_us(fn, repeat: int = 20) -> float:
    """Median microseconds of one replay of a graph of ``fn``."""
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


def attention_part(args) -> dict:
    """Returns the best sweep setting per ``(batch, context)``."""
    found = {}
    heads, kvh, hd, bs, layers = 32, 2, 128, 16, 52
    dtype = torch.bfloat16
    width_gate = (2 * heads + 2 * kvh) * hd
    for batch, ctx in itertools.product([int(b) for b in args.batches.split(",")],
                                        [int(c) for c in args.contexts.split(",")]):
        per_seq = -(-ctx // bs)
        blocks = batch * per_seq
        caches = [(torch.randn(blocks * bs, kvh, hd, dtype=dtype, device="cuda"),
                   torch.randn(blocks * bs, kvh, hd, dtype=dtype, device="cuda")) for _ in range(layers)]
        tables = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, per_seq)
        tiles = torch.tensor([[i, i, 1, ctx - 1] for i in range(batch)], dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, hd, dtype=dtype, device="cuda")
        qkvg = torch.randn(batch, width_gate, dtype=dtype, device="cuda")
        gate_offset = (heads + 2 * kvh) * hd
        kv_bytes = layers * batch * ctx * kvh * hd * 2 * 2

        def run(splits):
            def fn():
                for k, v in caches:
                    kernels.gated_attention(q, k, v, bs, tables, tiles, batch, splits, 16, 2048, False, hd ** -0.5,
                                            qkvg, gate_offset)
            return fn

        default_splits = kernels.layer_splits(batch, kvh)[1]  # a global layer's (the probe is not sliding)
        for splits in sorted({1, 2, 3, 4, 6, 8, 16, 32, 64, 128, default_splits}):
            if splits > 4 * ctx // 64:
                continue
            us = graph_us(run(splits)) / layers
            emit(part="attention", batch=batch, context=ctx, splits=splits, default=splits == default_splits,
                 us_per_layer=round(us, 2), gbps=round(kv_bytes / layers / us / 1e3, 1))
        if args.sweep:
            best = None
            for splits in (1, 2) if batch >= 32 else (default_splits,):
                for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3)):
                    kernels.ATTENTION_BLOCK_N, kernels.ATTENTION_WARPS, kernels.ATTENTION_STAGES = \
                        block_n, warps, stages
                    try:
                        us = graph_us(run(splits)) / layers
                    except Exception as e:  # noqa: BLE001 (out of shared memory and the like)
                        emit(part="attention_sweep", batch=batch, context=ctx, splits=splits, block_n=block_n,
                             warps=warps, stages=stages, error=str(e).splitlines()[0][:120])
                        continue
                    emit(part="attention_sweep", batch=batch, context=ctx, splits=splits, block_n=block_n,
                         warps=warps, stages=stages, us_per_layer=round(us, 2))
                    if best is None or us < best[0]:
                        best = (us, splits, block_n, warps, stages)
            kernels.ATTENTION_BLOCK_N = kernels.ATTENTION_WARPS = kernels.ATTENTION_STAGES = None
            emit(part="attention_best", batch=batch, context=ctx, us_per_layer=round(best[0], 2),
                 splits=best[1], block_n=best[2], warps=best[3], stages=best[4])
            found[batch, ctx] = best
        del caches
        torch.cuda.empty_cache()
    return found


def load_reference(path: str):
    spec = importlib.util.spec_from_file_location("musegl_cuda_kernels_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def apply_setting(name: str, reference) -> None:
    """Set the kernels module (and the names other modules imported from it) for ``name``."""
    for attr in ("add_norm", "qk_norm_rope_store", "gated_attention", "attention_splits"):
        setattr(kernels, attr, ORIGINAL[attr])
    kernels.PROGRAMS_PER_SM = 2
    kernels.ADD_NORM_WARPS = None
    model_module.FUSED_FINAL_NORM = True
    kernels.ATTENTION_BLOCK_N = kernels.ATTENTION_WARPS = kernels.ATTENTION_STAGES = None
    torch.backends.cuda.preferred_blas_library("cublas")
    if name == "reference":
        kernels.add_norm = reference.add_norm
        kernels.qk_norm_rope_store = reference.qk_norm_rope_store

        def gated(q, k, v, bs, tables, tiles, n, splits, block_m, window, sliding, scale, qkvg, offset):
            acc, m, l = reference.paged_attention(q, k, v, bs, tables, tiles, n, splits, block_m, window, sliding,
                                                  scale)
            return reference.combine_gate(acc, m, l, qkvg, offset, q.dtype)

        kernels.gated_attention = gated
    else:
        for item in name.split(","):
            if item in ("", "current"):
                continue
            key, value = item.split("=")
            if key == "blas":  # which library torch's products go through: cublas (default) or cublaslt
                torch.backends.cuda.preferred_blas_library(value)
            elif key.startswith("model."):
                setattr(model_module, key.removeprefix("model."), bool(int(value)))
            else:
                setattr(kernels, key, float(value) if key == "PROGRAMS_PER_SM" else int(value))
    graphs_module.attention_splits = kernels.attention_splits


ORIGINAL = {attr: getattr(kernels, attr) for attr in ("add_norm", "qk_norm_rope_store", "gated_attention",
                                                      "attention_splits")}


def step_part(args, found: dict) -> None:
    from gpu_decode import replay_ms, text_config

    from musegl_cuda.executor import TorchExecutor

    checkpoint = text_config(argparse.Namespace(config=None))
    c = checkpoint.config
    executor = TorchExecutor(checkpoint, device="cuda", dtype="bfloat16", dummy_seed=0,
                             forward_sizes=(1, 64))
    bs = executor.block_size
    ctx = args.step_context
    per_seq = -(-(ctx + 64) // bs)
    executor.allocate_kv(64 * per_seq + 8)
    rng = np.random.default_rng(0)
    seqs = [(i, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(64)]
    for lo in range(0, 64, 16):
        executor.step(Step([SeqChunk(i, rng.integers(4, c.vocab_size, size=ctx).tolist(), list(range(ctx)), t,
                                     sample=1) for i, t in seqs[lo:lo + 16]]))
    reference = load_reference(args.reference) if args.reference else None
    graphs = executor.graphs
    for name in args.settings.split(";"):
        if name == "reference" and reference is None:
            continue
        if name == "best":  # the sweep's best at batch 64 and the step's context, if it ran
            best = found.get((64, ctx))
            if best is None:
                continue
            _us, splits, block_n, warps, stages = best
            ppsm = {1: 0.9, 2: 1, 3: 2}.get(splits, 2)
            name = (f"PROGRAMS_PER_SM={ppsm},ATTENTION_BLOCK_N={block_n},ATTENTION_WARPS={warps},"
                    f"ATTENTION_STAGES={stages}")
        apply_setting(name, reference)
        graphs.graphs.clear()
        try:
            graphs.capture(executor.num_blocks)
        except Exception as e:  # noqa: BLE001 (report and go on to the next setting)
            emit(part="step", setting=name, error=repr(e)[:300])
            torch.cuda.synchronize()
            continue
        for b in (1, 64):
            # the same tokens for every setting: settings that change no arithmetic give the same ids
            last = [int(x) for x in np.random.default_rng(b).integers(4, c.vocab_size, size=b)]
            step_ms = []
            for s in range(12):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = executor.step(Step([SeqChunk(i, [last[k]], [ctx + s], t, sample=1)
                                          for k, (i, t) in enumerate(seqs[:b])], width=b))
                end.record()
                torch.cuda.synchronize()
                if s >= 2:
                    step_ms.append(start.elapsed_time(end))
                last = [out.tokens[i][0] for i, _ in seqs[:b]]
            emit(part="step", setting=name, batch=b, context=ctx, graph_ms=round(replay_ms(graphs.graphs[b]), 3),
                 step_ms=round(statistics.median(step_ms), 3), ids=last[:4])
    apply_setting("current", reference)
    graphs.graphs.clear()
    graphs.capture(executor.num_blocks)
    host_part(executor, seqs, ctx + 20, rng)


def host_part(executor, seqs, pos, rng) -> None:
    """Where a graph step's time goes outside the graph: medians over 20 steps, ms."""
    import time

    graphs = executor.graphs
    c = executor.config
    for b in (1, 64):
        width = b
        last = [int(x) for x in rng.integers(4, c.vocab_size, size=b)]

        def build():
            return Step([SeqChunk(i, [last[k]], [pos], t, sample=1) for k, (i, t) in enumerate(seqs[:b])],
                        width=width)

        step = build()
        parts = {}

        def measure(name, fn):
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            parts[name] = round(statistics.median(times), 3)

        g = graphs.graphs[width]

        def b2b():
            for _ in range(10):
                g.replay()
        measure("replay_x10", b2b)
        parts["replay_x10"] = round(parts["replay_x10"] / 10, 3)
        measure("replay_sync", lambda: (graphs.replay(width), graphs.greedy_ids(width, b)))
        measure("stage_replay_sync", lambda: (graphs.stage_decode(step.chunks, width, executor.num_blocks,
                                                                  c.vocab_size),
                                              graphs.replay(width), graphs.greedy_ids(width, b)))
        measure("executor_step", lambda: executor.step(step))
        measure("build_executor_step", lambda: executor.step(build()))
        t0 = time.perf_counter()
        for _ in range(100):
            build()
        parts["build_only"] = round((time.perf_counter() - t0) * 10, 3)
        emit(part="host", batch=b, **parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--sweep", action="store_true", help="also sweep block size, warps and stages")
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--no-step", action="store_true")
    p.add_argument("--step-context", type=int, default=512)
    p.add_argument("--settings", default="reference;current",
                   help="';'-separated settings: 'reference', 'current', or comma-separated NAME=VALUE of "
                        "musegl_cuda.cuda.kernels (PROGRAMS_PER_SM, ADD_NORM_WARPS, ATTENTION_BLOCK_N, "
                        "ATTENTION_WARPS, ATTENTION_STAGES) or model.NAME=0|1 of musegl_cuda.model "
                        "(FUSED_FINAL_NORM), blas=cublas|cublaslt, or 'best' (the sweep's best at batch 64)")
    p.add_argument("--reference", help="a kernels.py to compare with (the setting 'reference')")
    args = p.parse_args()
    emit(part="setup", device=torch.cuda.get_device_name(), torch=torch.__version__)
    found = {} if args.no_attention else attention_part(args)
    if not args.no_step:
        step_part(args, found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
