"""GPU decode/prefill figures of the cuda executor, and transformers' on the same weights.

Builds the torch executor at a Muse Glimmer config (default: the 30B shape of
transformers' ``MuseGlimmerTextConfig()``) with dummy weights made on the GPU
(``--load-format dummy``: seeded, repeatable), captures its decode graphs,
and prints one JSON line per figure:

* ``bandwidth``: measured device-to-device copy bandwidth and the roofline
  ms/token of a batch-1 decode step (every weight but the embedding table
  read once);
* ``prefill``: one ``--prefill-tokens`` step of one fresh sequence, tok/s;
* ``decode``: at each batch size, ms per step and tok/s, each sequence at
  ``--context`` positions. Steps run as the engine runs them: on an
  asynchronous executor (CUDA) step N+1 is launched, its rows following step
  N's ids on the device, before step N is read (``pipelined: true``); the
  host's work (building the chunks, staging, reading the ids, building the
  output) is included. ``sync_ms_per_step`` is the same with one
  ``executor.step`` at a time (the host's work between the steps);
* the same ``prefill``/``decode`` figures for transformers (``generate``,
  greedy, ``min_new_tokens`` = ``max_new_tokens``) on the same weights in
  the same run (``engine: transformers``), unless ``--no-baseline``;
* ``serve``: then the same config through ``musegl serve --load-format
  dummy`` (a bare config.json, so the demo tokenizer) and ``musegl bench``
  at each ``--serve-concurrency`` (default 1,64), unless ``--no-serve``:
  output tok/s, TTFT and inter-token p50, and ``decode_tok_s`` =
  concurrency / inter-token p50 next to the executor-level decode tok/s at
  that batch (``vs_executor``: their ratio).

Needs a CUDA GPU and transformers with Muse Glimmer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "cuda")]

from musegl_core.engine.executor import SeqChunk, Step  # noqa: E402
from musegl_cuda.executor import TorchExecutor  # noqa: E402
from musegl_cuda.plugin import ConfigOnly, read_config_only  # noqa: E402


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s of a large device-to-device copy, read + written (median of 10)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * gib * 2**30 / statistics.median(times)


def text_config(args):
    if args.config:
        return read_config_only(args.config)
    from transformers import MuseGlimmerTextConfig

    from musegl_core.checkpoint.hf_reader import text_config_dict, text_config_from_dict

    raw = MuseGlimmerTextConfig().to_dict()
    return ConfigOnly(text_config_from_dict(text_config_dict(raw, "MuseGlimmerTextConfig()")), "muse-glimmer-30b")


def replay_ms(graph: torch.cuda.CUDAGraph, repeat: int = 10) -> float:
    """Milliseconds of one replay of ``graph``, replayed back to back (GPU time alone, no host work)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def run_musegl(args, checkpoint, rng, tok_s: dict[int, float]):
    c = checkpoint.config
    executor = TorchExecutor(checkpoint, device="cuda", dtype="bfloat16", dummy_seed=0,
                             forward_sizes=tuple(int(x) for x in args.forward_sizes.split(",")))
    model = executor.model
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if not n.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight",
                                          "attn.gate_proj.weight", "mlp.gate_proj.weight", ".up_proj.weight")))
    read_bytes = weight_bytes - model.embed_tokens.numel() * model.embed_tokens.element_size()
    bw = copy_bandwidth()
    emit(figure="bandwidth", copy_gbps=round(bw / 1e9, 1), weight_gb=round(weight_bytes / 1e9, 2),
         roofline_ms_per_token=round(read_bytes / bw * 1e3, 2))
    bs = executor.block_size
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-(args.context + 2 * args.steps + 16) // bs)  # warm-up, synchronous and pipelined steps
    blocks = max(max(batches) * per_seq, -(-args.prefill_tokens // bs)) + 8
    t = time.perf_counter()
    executor.allocate_kv(blocks)
    emit(figure="startup", graphs_s=round(time.perf_counter() - t, 1), kv_blocks=blocks)

    # prefill: one fresh sequence of prefill_tokens rows in one step
    n = args.prefill_tokens
    prompt = rng.integers(4, c.vocab_size, size=n).tolist()
    table = list(range(-(-n // bs)))
    step = Step([SeqChunk(0, prompt, list(range(n)), table, sample=1)])
    times = timed(lambda: executor.step(step), 1 + args.prefill_repeat)[1:]
    emit(engine="musegl", figure="prefill", tokens=n, s=round(statistics.median(times), 4),
         tok_s=round(n / statistics.median(times), 1))

    results = {}
    for b in batches:
        seqs = [(i, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(b)]
        # prefill every sequence to `context` positions, several per step
        per_step = max(1, 8192 // args.context)
        for lo in range(0, b, per_step):
            executor.step(Step([SeqChunk(1000 * b + i, rng.integers(4, c.vocab_size, size=args.context).tolist(),
                                         list(range(args.context)), t, sample=1) for i, t in seqs[lo:lo + per_step]]))
        last = [int(x) for x in rng.integers(4, c.vocab_size, size=b)]
        width = executor.limits.padded_width(b)

        def build(pos, follows=False):
            return Step([SeqChunk(1000 * b + i, [last[k]], [pos], t, sample=1, follows=follows)
                         for k, (i, t) in enumerate(seqs)], width=width)

        def read(out):
            for k, (i, _) in enumerate(seqs):
                last[k] = out.tokens[1000 * b + i][0]

        def decode(pos):
            read(executor.step(build(pos)))

        def pipelined(first, steps):
            """``steps`` decode steps as the engine runs them on an asynchronous executor:
            step N+1 (following N's ids on the device) is launched before N is read."""
            pending = executor.launch(build(first))
            for s in range(1, steps):
                ahead = executor.launch(build(first + s, follows=True))
                read(pending.result())
                pending = ahead
            read(pending.result())

        for w in range(3):
            decode(args.context + w)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(args.steps):
            decode(args.context + 3 + s)
        torch.cuda.synchronize()
        sync_ms = (time.perf_counter() - t0) / args.steps * 1e3
        ms = sync_ms
        if executor.limits.async_steps:
            at = args.context + 3 + args.steps
            pipelined(at, 3)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pipelined(at + 3, args.steps)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / args.steps * 1e3
        results[b] = ms
        tok_s[b] = round(b / ms * 1e3, 1)
        graph_ms = None
        if executor.graphs is not None and width in executor.graphs.graphs:  # the replay alone, no host work
            graph_ms = round(replay_ms(executor.graphs.graphs[width]), 2)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for s in range(4):
                    decode(args.context + 6 + 2 * args.steps + s)
                torch.cuda.synchronize()
            print(f"--- profile: 4 decode steps at batch {b}", file=sys.stderr)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60),
                  file=sys.stderr)
        if args.profile and graph_ms is not None:  # where a step's time goes outside the graph
            pos = args.context + 10 + 2 * args.steps
            graphs = executor.graphs

            def build():
                return Step([SeqChunk(1000 * b + i, [last[k]], [pos], t, sample=1)
                             for k, (i, t) in enumerate(seqs)], width=width)

            parts = {"build": [], "stage": [], "replay_sync": []}
            for _ in range(10):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step = build()
                t1 = time.perf_counter()
                graphs.stage_decode(step.chunks, width, executor.num_blocks, c.vocab_size)
                t2 = time.perf_counter()
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                graphs.replay(width)
                graphs.greedy_ids(width, b)
                t4 = time.perf_counter()
                for key, v in zip(parts, (t1 - t0, t2 - t1, t4 - t3)):
                    parts[key].append(v * 1e3)
            emit(engine="musegl", figure="decode_parts", batch=b,
                 **{f"{k}_ms": round(statistics.median(v), 3) for k, v in parts.items()})
        emit(engine="musegl", figure="decode", batch=b, context=args.context, graph=width in executor.limits.step_sizes,
             pipelined=executor.limits.async_steps, ms_per_step=round(ms, 2), tok_s=round(b / ms * 1e3, 1),
             sync_ms_per_step=round(sync_ms, 2), graph_ms=graph_ms)
    return executor


def run_transformers(args, checkpoint, holder: list, rng):
    """``holder`` holds the executor, whose weights are copied and which is then freed."""
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    from musegl_core.checkpoint.hf_reader import text_weight_names
    from musegl_cuda.model import CenteredRMSNorm

    c = checkpoint.config
    if args.config:
        raw = json.loads((Path(args.config) / "config.json" if Path(args.config).is_dir()
                          else Path(args.config)).read_text())
        text = raw.get("text_config", raw)
    else:
        from transformers import MuseGlimmerTextConfig

        text = MuseGlimmerTextConfig().to_dict()
    config = MuseGlimmerConfig(text_config=text,
                               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, pos_emb_height=4, pos_emb_width=4),
                               out_hidden_size=128, projector_hidden_size=64)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = MuseGlimmerForConditionalGeneration(config).eval()
    torch.set_default_dtype(torch.float32)
    params = dict(hf.named_parameters())
    executor = holder.pop()
    with torch.no_grad():
        for name in text_weight_names(c):
            target = executor.model._target(name)
            value = target.scale - 1.0 if isinstance(target, CenteredRMSNorm) else target
            key = "lm_head.weight" if name == "lm_head.weight" else f"model.language_model.{name}"
            params[key].copy_(value)
    executor.close()
    del executor
    torch.cuda.empty_cache()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    n = args.prefill_tokens
    ids = torch.tensor([rng.integers(4, c.vocab_size, size=n).tolist()], device="cuda")
    with torch.no_grad():
        times = timed(lambda: hf(input_ids=ids, logits_to_keep=1), 1 + args.prefill_repeat)[1:]
    emit(engine="transformers", figure="prefill", tokens=n, s=round(statistics.median(times), 4),
         tok_s=round(n / statistics.median(times), 1))
    for b in [int(x) for x in args.batches.split(",")]:
        ids = torch.tensor(rng.integers(4, c.vocab_size, size=(b, args.context)).tolist(), device="cuda")
        steps = args.baseline_steps

        def gen(k):
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                            do_sample=False)

        gen(2)
        first = statistics.median(timed(lambda: gen(1), 2))
        total = timed(lambda: gen(steps + 1), 1)[0]
        ms = (total - first) / steps * 1e3
        emit(engine="transformers", figure="decode", batch=b, context=args.context, ms_per_step=round(ms, 2),
             tok_s=round(b / ms * 1e3, 1))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_serve(args, executor_tok_s: dict[int, float]) -> None:
    """The HTTP path at the same shape: ``musegl serve --load-format dummy`` + ``musegl bench``."""
    import httpx

    levels = [int(x) for x in args.serve_concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.config:
            src = Path(args.config) / "config.json" if Path(args.config).is_dir() else Path(args.config)
            raw = json.loads(src.read_text())
        else:
            from transformers import MuseGlimmerTextConfig

            raw = MuseGlimmerTextConfig().to_dict()
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins" / "cuda"),
                                                            os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, "-m", "musegl_core.cli.main", "serve", "--load-format", "dummy",
                   "--model", tmp, "--executor", "cuda", "--port", str(port),
                   "--max-sessions", str(max(levels)), "--max-inflight-requests", str(max(levels)),
                   "--max-decode-sequences", str(max(levels)), "--max-context", str(args.serve_context),
                   "--forward-sizes", args.forward_sizes]
        t0 = time.perf_counter()
        server = subprocess.Popen(command, env=env, stdout=sys.stderr, stderr=sys.stderr)
        try:
            while True:
                if server.poll() is not None:
                    emit(engine="musegl-serve", figure="serve", error=f"musegl serve exited {server.returncode}")
                    return
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(1)
            emit(engine="musegl-serve", figure="serve_startup", s=round(time.perf_counter() - t0, 1))
            for c in levels:
                bench = [sys.executable, "-m", "musegl_core.cli.main", "bench", "--url", url, "-c", str(c),
                         "-n", str(max(2 * c, 8)), "--max-tokens", str(args.serve_max_tokens),
                         "--prompt-tokens", str(args.serve_prompt_tokens), "--json", "--no-progress"]
                done = subprocess.run(bench, env=env, capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    emit(engine="musegl-serve", figure="serve", concurrency=c, error=done.stderr[-400:])
                    continue
                report = json.loads(done.stdout)
                itl = report["itl"]["p50"]
                decode_tok_s = c / itl if itl else None
                base = executor_tok_s.get(c)
                emit(engine="musegl-serve", figure="serve", concurrency=c, requests=report["requests"],
                     errors=report["errors"], output_tok_s=round(report["output_tokens_per_s"], 1),
                     ttft_p50_ms=round(report["ttft"]["p50"] * 1e3, 1), itl_p50_ms=round(itl * 1e3, 2),
                     decode_tok_s=round(decode_tok_s, 1) if decode_tok_s else None, executor_tok_s=base,
                     vs_executor=round(decode_tok_s / base, 3) if decode_tok_s and base else None)
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="a Hugging Face directory or config.json (default: MuseGlimmerTextConfig())")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=512, help="positions in the cache of each decoding sequence")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--prefill-repeat", type=int, default=3)
    p.add_argument("--forward-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--no-baseline", action="store_true", help="skip transformers")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top kernels of 4 decode steps")
    p.add_argument("--baseline-steps", type=int, default=16)
    p.add_argument("--blas", choices=("cublas", "cublaslt"), help="torch's preferred BLAS library (default: torch's)")
    p.add_argument("--no-serve", action="store_true", help="skip musegl serve + musegl bench")
    p.add_argument("--serve-only", action="store_true", help="only musegl serve + musegl bench")
    p.add_argument("--serve-concurrency", default="1,64")
    p.add_argument("--serve-max-tokens", type=int, default=128)
    p.add_argument("--serve-prompt-tokens", type=int, default=256)
    p.add_argument("--serve-context", type=int, default=2048, help="--max-context of the server")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    rng = np.random.default_rng(0)
    checkpoint = text_config(args)
    emit(figure="setup", device=torch.cuda.get_device_name(), torch=torch.__version__, model=checkpoint.name,
         layers=checkpoint.config.num_layers, hidden=checkpoint.config.hidden_size)
    executor_tok_s: dict[int, float] = {}
    if not args.serve_only:
        holder = [run_musegl(args, checkpoint, rng, executor_tok_s)]
        if not args.no_baseline:
            run_transformers(args, checkpoint, holder, rng)
        else:
            holder.pop().close()
        holder.clear()
        torch.cuda.empty_cache()
    if not args.no_serve:
        run_serve(args, executor_tok_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
