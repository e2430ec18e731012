"""GPU decode/prefill figures of the cuda executor, and of ``musegl serve`` on the same shape.

Builds the torch executor at a Muse Glimmer config (default: the 30B shape of
transformers' ``MuseGlimmerTextConfig()``; ``--layers N`` keeps the first N
layers; ``--tiny`` a 4-layer hidden-64 shape for a CPU smoke run) with dummy
weights made on the device (``--load-format dummy``: seeded, repeatable) and
prints one JSON line per figure (also appended to ``--out``):

* ``bandwidth`` (CUDA): measured device-to-device copy bandwidth and the
  roofline ms/token of a batch-1 decode step (every weight but the embedding
  table read once);
* ``prefill``: one ``--prefill-tokens`` step of one fresh sequence, tok/s;
  ``ttft`` (after the decode points): a ``--ttft-tokens`` prompt prefilled in
  ``--prefill-chunk`` chunks, as the engine splits it, seconds to its first
  sampled token (a point that fails, e.g. out of memory, prints ``error``
  and the others go on);
* ``decode``: at each ``--contexts`` value and batch size, ms per step and
  tok/s, each sequence at that many positions, then ``--wide-batches`` at
  ``--wide-context``. Steps run as the engine runs them: on an asynchronous
  executor (CUDA) step N+1 is launched, its rows following step N's ids on the
  device, before step N is read (``pipelined: true``); the host's work
  (building the chunks, staging, reading the ids) is included.
  ``sync_ms_per_step`` is the same with one ``executor.step`` at a time. The
  positions before the context are the cache as ``allocate_kv`` left it
  (zeros; ``--fill prefill`` prefills them instead): attention reads the same
  bytes either way. A point whose KV does not fit the pool (device memory
  less the weights and ``--headroom-gib``) is printed with ``skipped``;
* the same ``prefill``/``decode`` figures for transformers on the same
  weights (``engine: transformers``), with ``--baseline``;
* ``serve`` (phase ``serve``): the same config through ``musegl serve
  --load-format dummy`` (a bare config.json, so the demo tokenizer) and
  ``musegl bench`` at each ``--serve-concurrency``: output tok/s, TTFT and
  inter-token p50, ``decode_tok_s`` = concurrency / inter-token p50; then
  ``serve_ttft``: a ``--ttft-tokens`` prompt's TTFT through HTTP (a one-slot
  server: every slot reserves ``--max-context``);
* ``rows`` (phase ``rows``): ``--rows-batch`` concurrent requests (sampled,
  ``ignore_eos``) plain, with a quarter of them under a JSON schema (an open
  array of strings, which random weights never close), and with top-5
  logprobs on every row; completion tok/s and each ratio to plain;
* ``dflash`` (phase ``dflash``): ``musegl serve --dflash DRAFT`` with a
  random draft at ``MuseGlimmerAssistantConfig()`` defaults (tapped layers
  spread over the target's depth) and the benchmark-only replay
  (``MUSEGL_DFLASH_BENCHMARK_ACCEPT``, plugins/dflash/musegl_dflash/replay.py):
  each ``--dflash-batches`` concurrency ``c`` has prompts of its own (bench
  seed ``c``); before its first timed run they run once short (warm-up: the
  shapes of batch ``c``), then once to record the target's output; the
  ``--dflash-accept`` lengths run in the order given, each at every
  concurrency (default 4, 16, 2, 8), replaying the newest recording; output
  tok/s, ``decode_only_tok_s`` (without the time to the first token), the
  measured acceptance length (engine counters) and both ratios to the plain
  server on the same requests (``dflash_plain``, measured in the same run,
  warmed up the same way).

``--tensor-parallel-size N`` splits the model over N devices (the executor phase
through ``TensorParallelExecutor``, the served phases through ``musegl serve
--tensor-parallel-size N``; ``output_tok_s_per_device`` is tok/s over N).

``--phases`` picks any of ``executor,serve,rows,dflash`` (default all).
``--device cpu`` runs everything on the CPU (``torch-cpu``, float32) for the
smoke run: ``python benchmarks/gpu_decode.py --device cpu --tiny`` plus the
small-shape options that ``SMOKE=1 benchmarks/h200_run.sh`` passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "cuda"), str(ROOT / "benchmarks")]

from musegl_core.engine.executor import SeqChunk, Step  # noqa: E402
from musegl_cuda.executor import TorchExecutor  # noqa: E402
from musegl_cuda.config_only import ConfigOnly  # noqa: E402

PHASES = ("executor", "serve", "rows", "dflash")
#: ``--tiny``: a shape the CPU runs in seconds (the demo tokenizer's vocabulary).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=64)
TINY_DRAFT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=64)
#: The open array of strings of benchmarks/constrained.py: random weights never close it.
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
          "required": ["items"]}

OUT: list = []  # the --out file, when given
PROFILE_DIR: list = []  # --profile: the servers' table directory


def start_profile(label: str, skip: int = 4, count: int = 12) -> None:
    """--profile: the server records launches skip+1 .. skip+count from now (musegl_cuda.step_profile)."""
    if PROFILE_DIR:
        (PROFILE_DIR[0] / "start").write_text(f"{skip} {count} {label}")


def emit(**fields) -> None:
    line = json.dumps(fields)
    print(line, flush=True)
    for path in OUT:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def is_cuda(args) -> bool:
    return args.device.startswith("cuda")


def sync(args) -> None:
    if is_cuda(args):
        torch.cuda.synchronize()


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


def raw_text_config(args) -> dict:
    """The text config as a transformers dict: ``--config``, else ``MuseGlimmerTextConfig()``
    (``--tiny``: the small shape), cut to ``--layers``."""
    if args.config:
        src = Path(args.config) / "config.json" if Path(args.config).is_dir() else Path(args.config)
        raw = json.loads(src.read_text())
        raw = raw.get("text_config", raw)
    else:
        from transformers import MuseGlimmerTextConfig

        raw = MuseGlimmerTextConfig(**(TINY if args.tiny else {})).to_dict()
    if args.layers:
        if not 1 <= args.layers <= raw["num_hidden_layers"]:
            raise SystemExit(f"--layers must be in 1..{raw['num_hidden_layers']}")
        full = raw["num_hidden_layers"]
        raw["num_hidden_layers"] = args.layers
        for key, value in raw.items():  # the per-layer lists (layer_types, layer_rope_theta)
            if isinstance(value, list) and len(value) == full:
                raw[key] = value[:args.layers]
    return raw


def text_config(args) -> ConfigOnly:
    from musegl_core.checkpoint.hf_reader import text_config_dict, text_config_from_dict

    raw = raw_text_config(args)
    name = "muse-glimmer-tiny" if args.tiny else "muse-glimmer-30b"
    return ConfigOnly(text_config_from_dict(text_config_dict(raw, "MuseGlimmerTextConfig()")),
                      f"{name}-{raw['num_hidden_layers']}l")


def replay_ms(graph, repeat: int = 10) -> float:
    """Milliseconds of one replay of ``graph``, replayed back to back (GPU time alone, no host work)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def timed(args, fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        sync(args)
        t = time.perf_counter()
        fn()
        sync(args)
        out.append(time.perf_counter() - t)
    return out


def decode_points(args) -> list[tuple[int, int]]:
    """(context, batch) in the order they run."""
    points = [(ctx, b) for ctx in int_list(args.contexts) for b in int_list(args.batches)]
    points += [(args.wide_context, b) for b in int_list(args.wide_batches)]
    return points


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_musegl(args, checkpoint, rng, tok_s: dict[tuple[int, int], float]):
    c = checkpoint.config
    cuda = is_cuda(args)
    if args.tensor_parallel_size > 1:  # the ranks' processes, the config from a bare config.json
        from musegl_cuda.parallel.executor import TensorParallelExecutor
        from musegl_cuda.parallel.rank import RankSpec

        folder = Path(tempfile.mkdtemp(prefix="gpu-decode-tp-"))
        (folder / "config.json").write_text(json.dumps(raw_text_config(args)))
        executor = TensorParallelExecutor(RankSpec(
            str(folder), "cuda" if cuda else "cpu", args.tensor_parallel_size,
            dtype="bfloat16" if cuda else "float32", dummy=True,
            forward_sizes=forward_sizes(args)))
        model = None  # no roofline figure: the weights are spread over the ranks
        emit(figure="tensor_parallel", ranks=args.tensor_parallel_size,
             weight_gb_total=round(sum(executor.weight_bytes.values()) / 1e9, 2))
    else:
        executor = TorchExecutor(checkpoint, device=args.device, dtype="bfloat16" if cuda else "float32",
                                 dummy_seed=0, forward_sizes=forward_sizes(args), dummy_kind=args.weights_kind,
                                 w8a8_rows=args.fp8_w8a8_rows)
        model = executor.model
    if cuda and model is not None and model.device_weights:  # random matrices as stored (--weights-kind)
        weight_bytes = sum(executor.weight_bytes.values())
        read_bytes = weight_bytes - model.embed_matrix.nbytes
        bw = copy_bandwidth()
        emit(figure="bandwidth", copy_gbps=round(bw / 1e9, 1), weight_gb=round(weight_bytes / 1e9, 2),
             weights_kind=args.weights_kind, roofline_ms_per_token=round(read_bytes / bw * 1e3, 2))
    elif cuda and model is not None:
        weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                           if not n.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight",
                                              "attn.gate_proj.weight", "mlp.gate_proj.weight", ".up_proj.weight")))
        read_bytes = weight_bytes - model.embed_tokens.numel() * model.embed_tokens.element_size()
        bw = copy_bandwidth()
        emit(figure="bandwidth", copy_gbps=round(bw / 1e9, 1), weight_gb=round(weight_bytes / 1e9, 2),
             roofline_ms_per_token=round(read_bytes / bw * 1e3, 2))
    bs = executor.block_size
    limit = c.max_position_embeddings - 2 * args.steps - 16  # the last decode position stays inside the model

    def per_seq(context: int) -> int:  # warm-up, synchronous and pipelined steps
        return -(-(min(context, limit) + 2 * args.steps + 16) // bs)

    wanted = max([b * per_seq(ctx) for ctx, b in decode_points(args)] + [-(-args.ttft_tokens // bs)]) + 8
    per_block = executor.kv_bytes_per_block()
    room = executor.kv_memory_available()
    fits = max(64, int((room - args.headroom_gib * 2**30) // per_block)) if room is not None else wanted
    blocks = min(wanted, fits)
    t = time.perf_counter()
    executor.allocate_kv(blocks)
    emit(figure="startup", graphs_s=round(time.perf_counter() - t, 1), kv_blocks=blocks, kv_blocks_wanted=wanted,
         kv_gib=round(blocks * per_block / 2**30, 1), block_size=bs)

    # prefill: one fresh sequence of prefill_tokens rows in one step
    n = args.prefill_tokens
    prompt = rng.integers(4, c.vocab_size, size=n).tolist()
    table = list(range(-(-n // bs)))
    step = Step([SeqChunk(0, prompt, list(range(n)), table, sample=1)])
    times = timed(args, lambda: executor.step(step), 1 + args.prefill_repeat)[1:]
    emit(engine="musegl", figure="prefill", tokens=n, s=round(statistics.median(times), 4),
         tok_s=round(n / statistics.median(times), 1))
    if args.profile and cuda:
        print_profile(f"a {n}-token prefill step", 1, lambda: executor.step(step))

    for context, b in decode_points(args):
        try:
            decode_one(args, executor, rng, context, min(context, limit), b, per_seq(context), blocks, tok_s)
        except (RuntimeError, MemoryError) as exc:  # one point failing (memory) leaves the others
            emit(engine="musegl", figure="decode", batch=b, context=context, error=f"{type(exc).__name__}: {exc}"[:300])
            release_cached()

    # time to the first token of a long prompt, in the engine's chunks (last: the most memory),
    # once per --ttft-chunks size (a whole-prompt chunk is one step)
    n = args.ttft_tokens
    if -(-n // bs) <= blocks:
        prompt = rng.integers(4, c.vocab_size, size=n).tolist()
        table = list(range(-(-n // bs)))
        for chunk in int_list(args.ttft_chunks or str(args.prefill_chunk)):
            ttft_one(args, executor, prompt, table, chunk)
    else:
        emit(engine="musegl", figure="ttft", tokens=n, skipped=f"needs {-(-n // bs)} KV blocks, the pool has {blocks}")
    return executor


def ttft_one(args, executor, prompt: list[int], table: list[int], chunk: int) -> None:
    """The ``len(prompt)``-token prompt's time to the first token in steps of ``chunk`` rows (the
    median of two runs after a first one: a new chunk length's first run plans cuDNN's attention)."""
    n, cuda = len(prompt), is_cuda(args)

    def ttft():
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            executor.step(Step([SeqChunk(1, prompt[lo:hi], list(range(lo, hi)), table,
                                         sample=1 if hi == n else 0)]))

    try:
        times = timed(args, ttft, 3)[1:]
        s = statistics.median(times)
        emit(engine="musegl", figure="ttft", tokens=n, chunk=chunk, s=round(s, 3), tok_s=round(n / s, 1),
             runs_s=[round(t, 3) for t in times])
        if args.profile and cuda:  # the chunk that reads the most keys (its cache is the run's own)
            lo = (n - 1) // chunk * chunk
            last = Step([SeqChunk(1, prompt[lo:], list(range(lo, n)), table, sample=1)])
            print_profile(f"the last {n - lo}-row chunk of the {n}-token prompt", 1, lambda: executor.step(last))
    except (RuntimeError, MemoryError) as exc:
        emit(engine="musegl", figure="ttft", tokens=n, chunk=chunk, error=f"{type(exc).__name__}: {exc}"[:300])
        release_cached()


def decode_one(args, executor, rng, context, at, b, per_seq, blocks, tok_s) -> None:
    c = executor.config
    need = b * per_seq
    if need > blocks:
        emit(engine="musegl", figure="decode", batch=b, context=context,
             skipped=f"needs {need} KV blocks ({b} x {per_seq}), the pool has {blocks}")
        return
    seqs = [(i, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(b)]
    handle = 10_000 * (context + 1) + b * 1000
    if args.fill == "prefill":  # every sequence prefilled to `context` positions, several per step
        per_step = max(1, args.prefill_chunk // at)
        for lo in range(0, b, per_step):
            executor.step(Step([SeqChunk(handle + i, rng.integers(4, c.vocab_size, size=at).tolist(),
                                         list(range(at)), t, sample=1) for i, t in seqs[lo:lo + per_step]]))
    last = [int(x) for x in rng.integers(4, c.vocab_size, size=b)]
    width = executor.limits.padded_width(b)

    def build(pos, follows=False):
        return Step([SeqChunk(handle + i, [last[k]], [pos], t, sample=1, follows=follows)
                     for k, (i, t) in enumerate(seqs)], width=width)

    def read(out):
        for k, (i, _) in enumerate(seqs):
            last[k] = out.tokens[handle + i][0]

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
        decode(at + w)
    sync(args)
    t0 = time.perf_counter()
    for s in range(args.steps):
        decode(at + 3 + s)
    sync(args)
    sync_ms = (time.perf_counter() - t0) / args.steps * 1e3
    ms = sync_ms
    if executor.limits.async_steps:
        start = at + 3 + args.steps
        pipelined(start, 3)
        sync(args)
        t0 = time.perf_counter()
        pipelined(start + 3, args.steps - 3)
        sync(args)
        ms = (time.perf_counter() - t0) / (args.steps - 3) * 1e3
    tok_s[(context, b)] = round(b / ms * 1e3, 1)
    graphs = getattr(executor, "graphs", None)
    graph_ms = None
    if graphs is not None and width in graphs.graphs:  # the replay alone, no host work
        graph_ms = round(replay_ms(graphs.graphs[width]), 2)
    if args.profile and is_cuda(args) and f"{context}x{b}" in args.profile_at.split(","):
        print_profile(f"4 decode steps at batch {b}, context {context}", 4,
                      lambda: [decode(at + 3 + 2 * args.steps + s) for s in range(4)])
    emit(engine="musegl", figure="decode", batch=b, context=context, positions=at,
         graph=width in executor.limits.step_sizes, pipelined=executor.limits.async_steps,
         ms_per_step=round(ms, 2), tok_s=round(b / ms * 1e3, 1), sync_ms_per_step=round(sync_ms, 2),
         graph_ms=graph_ms, fill=args.fill)


def print_profile(what: str, launches: int, fn) -> None:
    """torch.profiler's kernels of ``fn`` by total GPU time, and their sum per launch, on stderr."""
    from torch.profiler import ProfilerActivity, profile

    from musegl_cuda.step_profile import device_time_us

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) * 1e3
    events = prof.key_averages()
    kernel_ms = device_time_us(events) / 1e3
    print(f"--- profile: {what}: {wall_ms / launches:.2f} ms wall and {kernel_ms / launches:.2f} ms of GPU "
          f"kernels a launch (under the profiler)", file=sys.stderr)
    print(events.table(sort_by="self_cuda_time_total", row_limit=24, max_name_column_width=70), file=sys.stderr)


def release_cached() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def release_kv(executor) -> None:
    """Drop the cache and the graphs that hold it (the weights stay, for the baseline to copy)."""
    for name in ("graphs", "samplers", "kv"):
        if hasattr(executor, name):
            setattr(executor, name, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_transformers(args, checkpoint, holder: list, rng):
    """``holder`` holds the executor, whose weights are copied and which is then freed."""
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    from musegl_core.checkpoint.hf_reader import text_weight_names

    c = checkpoint.config
    device = args.device
    config = MuseGlimmerConfig(text_config=raw_text_config(args),
                               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, pos_emb_height=4, pos_emb_width=4),
                               out_hidden_size=128, projector_hidden_size=64)
    executor = holder.pop()
    release_kv(executor)
    dtype = torch.bfloat16 if is_cuda(args) else torch.float32
    torch.set_default_dtype(dtype)
    with torch.device(device):
        hf = MuseGlimmerForConditionalGeneration(config).eval()
    torch.set_default_dtype(torch.float32)
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name in text_weight_names(c):
            value = executor.model.checkpoint_weight(name)
            key = "lm_head.weight" if name == "lm_head.weight" else f"model.language_model.{name}"
            params[key].copy_(value)
    executor.close()
    del executor
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    n = args.prefill_tokens
    ids = torch.tensor([rng.integers(4, c.vocab_size, size=n).tolist()], device=device)
    with torch.no_grad():
        times = timed(args, lambda: hf(input_ids=ids, logits_to_keep=1), 1 + args.prefill_repeat)[1:]
    emit(engine="transformers", figure="prefill", tokens=n, s=round(statistics.median(times), 4),
         tok_s=round(n / statistics.median(times), 1))
    context = int_list(args.contexts)[0]
    for b in int_list(args.batches):
        ids = torch.tensor(rng.integers(4, c.vocab_size, size=(b, context)).tolist(), device=device)
        steps = args.baseline_steps

        def gen(k):
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                            do_sample=False)

        gen(2)
        first = statistics.median(timed(args, lambda: gen(1), 2))
        total = timed(args, lambda: gen(steps + 1), 1)[0]
        ms = (total - first) / steps * 1e3
        emit(engine="transformers", figure="decode", batch=b, context=context, ms_per_step=round(ms, 2),
             tok_s=round(b / ms * 1e3, 1))


# -- served phases -------------------------------------------------------------------------
def write_model_dir(args, tmp: Path) -> Path:
    model = tmp / "target"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(raw_text_config(args)))
    return model


def write_draft(args, tmp: Path, num_layers: int) -> Path:
    """A random DFlash draft at ``MuseGlimmerAssistantConfig()`` defaults (``--tiny``: its small
    shape), reading target layers spread over the target's depth, saved as a Hugging Face directory."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    base = MuseGlimmerAssistantConfig(**(TINY_DRAFT if args.tiny else {}))
    taps = len(base.target_layer_ids)
    layers = list(base.target_layer_ids)  # the released draft's taps, where the target has them
    if max(layers) >= num_layers:
        layers = sorted({round(1 + i * (num_layers - 2) / max(taps - 1, 1)) for i in range(taps)}) \
            if num_layers >= 3 else list(range(num_layers))
    config = MuseGlimmerAssistantConfig(**(TINY_DRAFT if args.tiny else {}), target_layer_ids=layers)
    dtype = torch.bfloat16 if is_cuda(args) else torch.float32
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            draft = MuseGlimmerAssistantModel(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    path = tmp / "draft"
    draft.save_pretrained(path)
    del draft
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    emit(figure="dflash_draft", layers=config.num_hidden_layers, hidden=config.hidden_size,
         target_layer_ids=layers, block_size=config.block_size)
    return path


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    if PROFILE_DIR:  # --profile: the servers record windows of steps when start_profile asks
        from musegl_cuda.step_profile import ENV as PROFILE_ENV

        extra = {**(extra or {}), PROFILE_ENV: str(PROFILE_DIR[0])}
    return {**os.environ, **(extra or {}),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins" / "cuda"), os.environ.get("PYTHONPATH", "")])}


def forward_sizes(args) -> tuple[int, ...] | None:
    """The decode graphs' widths: ``--forward-sizes``, else (None) the executor's default, which
    also sets a served DFlash step's verify budget (the widest graph)."""
    return tuple(int_list(args.forward_sizes)) if is_cuda(args) and args.forward_sizes else None


def serve_flags(args, width: int, context: int | None = None) -> list[str]:
    executor = "cuda" if is_cuda(args) else "torch-cpu"
    flags = ["--load-format", "dummy", "--executor", executor, "--max-sessions", str(width),
             "--max-inflight-requests", str(width), "--max-decode-sequences", str(width),
             "--max-context", str(context or args.serve_context)]
    if is_cuda(args) and args.forward_sizes:
        flags += ["--forward-sizes", args.forward_sizes]
    if args.tensor_parallel_size > 1:
        flags += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    return flags + [part for flag in args.serve_flag for part in flag.split("=", 1)]


def bench(args, url: str, concurrency: int, requests: int, max_tokens: int, prompt_tokens: int,
          env: dict[str, str], seed: int = 0) -> dict | str:
    command = [sys.executable, "-m", "musegl_core.cli.main", "bench", "--url", url, "-c", str(concurrency),
               "-n", str(requests), "--max-tokens", str(max_tokens), "--prompt-tokens", str(prompt_tokens),
               "--seed", str(seed), "--json", "--no-progress", "--tensor-parallel-size", str(args.tensor_parallel_size)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return done.stderr[-400:] or done.stdout[-400:]
    return json.loads(done.stdout)


def decode_only_tok_s(report: dict) -> float | None:
    """Output tok/s without the time to the first token: the tokens after each request's first,
    over the mean time from first token to last (the requests run as one wave)."""
    latency, ttft = report["latency"]["mean"], report["ttft"]["mean"]
    tokens = report["output_tokens"] - report["succeeded"]
    if latency is None or ttft is None or latency <= ttft or tokens <= 0:
        return None
    return round(tokens / (latency - ttft), 1)


def served(report: dict) -> dict:
    itl = report["itl"]["p50"]
    return dict(requests=report["requests"], errors=report["errors"],
                output_tok_s=round(report["output_tokens_per_s"], 1), decode_only_tok_s=decode_only_tok_s(report),
                output_tok_s_per_device=round(report["output_tokens_per_s_per_device"], 1),
                ttft_p50_ms=round(report["ttft"]["p50"] * 1e3, 1) if report["ttft"]["p50"] is not None else None,
                itl_p50_ms=round(itl * 1e3, 2) if itl else None)


def run_serve(args, tmp: Path, executor_tok_s: dict, plain: dict[int, dict]) -> None:
    """The HTTP path at the same shape: ``musegl serve --load-format dummy`` + ``musegl bench``."""
    from common import serve_process

    levels = int_list(args.serve_concurrency)
    model = write_model_dir(args, tmp)
    env = server_env()
    width = max(levels + [args.rows_batch if "rows" in args.phases else 1]
                + (int_list(args.dflash_batches) if "dflash" in args.phases else []))
    t0 = time.perf_counter()
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    with serve_process(model, *serve_flags(args, width), ready_timeout=args.ready_timeout) as (url, _):
        emit(engine="musegl-serve", figure="serve_startup", s=round(time.perf_counter() - t0, 1))
        if "serve" in args.phases:
            for c in levels:
                start_profile(f"serve_c{c}", skip=8)
                report = bench(args, url, c, max(2 * c, 4), args.serve_max_tokens, args.serve_prompt_tokens, env)
                if isinstance(report, str):
                    emit(engine="musegl-serve", figure="serve", concurrency=c, error=report)
                    continue
                fig = served(report)
                itl = report["itl"]["p50"]
                decode_tok_s = c / itl if itl else None
                base = executor_tok_s.get((int_list(args.contexts)[0], c))
                emit(engine="musegl-serve", figure="serve", concurrency=c, **fig,
                     decode_tok_s=round(decode_tok_s, 1) if decode_tok_s else None, executor_tok_s=base,
                     vs_executor=round(decode_tok_s / base, 3) if decode_tok_s and base else None)
        if "rows" in args.phases:
            run_rows(args, url)
        if "dflash" in args.phases:  # the plain figures the DFlash runs are compared with: same requests
            run_dflash_plain(args, url, plain)
    if "serve" in args.phases:  # one slot holding the long prompt (every slot reserves --max-context)
        flags = serve_flags(args, 1, args.ttft_tokens + 1024)  # the prompt, its template, the calibration
        with serve_process(model, *flags, ready_timeout=args.ready_timeout) as (url, _):
            report = bench(args, url, 1, 3, 2, args.ttft_tokens, env)
            if isinstance(report, str):
                emit(engine="musegl-serve", figure="serve_ttft", error=report)
            else:
                emit(engine="musegl-serve", figure="serve_ttft", prompt_tokens=report["prompt_tokens"] // 3,
                     ttft_p50_s=round(report["ttft"]["p50"], 3), ttft_p95_s=round(report["ttft"]["p95"], 3))


async def completions(url: str, n: int, max_tokens: int, body_of) -> tuple[int, float]:
    """``n`` concurrent chat requests; (completion tokens, seconds)."""
    import httpx

    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=n + 2)) as http:
        async def one(i: int) -> int:
            response = await http.post(f"{url}/v1/chat/completions", json=body_of(i))
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(tokens), time.perf_counter() - started


def run_rows(args, url: str) -> None:
    """A batch of sampled rows: plain, a quarter under a JSON schema, top-5 logprobs on all."""
    n, m = args.rows_batch, args.rows_max_tokens

    def body(i: int, constrained: bool = False, logprobs: bool = False) -> dict:
        out = {"model": "m", "messages": [{"role": "user", "content": f"List things, case {i}. " * 8}],
               "max_tokens": m, "ignore_eos": True, "temperature": 0.8, "seed": i}
        if constrained:
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "list", "schema": SCHEMA}}
        if logprobs:
            out |= {"logprobs": True, "top_logprobs": 5}
        return out

    cases = {"plain": lambda i: body(i), "json_schema_quarter": lambda i: body(i, constrained=i % 4 == 0),
             "top5_logprobs": lambda i: body(i, logprobs=True)}
    asyncio.run(completions(url, 2, 4, cases["json_schema_quarter"]))  # warm-up: the grammar vocabulary
    rates = {}
    for name, body_of in cases.items():
        tokens, seconds = asyncio.run(completions(url, n, m, body_of))
        rates[name] = tokens / seconds
        emit(engine="musegl-serve", figure="rows", case=name, batch=n, max_tokens=m, completion_tokens=tokens,
             s=round(seconds, 2), tok_s=round(rates[name], 1),
             vs_plain=round(rates[name] / rates["plain"], 3))


def dflash_bench(args, url: str, c: int, env: dict[str, str], max_tokens: int | None = None) -> dict | str:
    """The DFlash phase's requests at concurrency ``c``: ``c`` prompts of their own (seed ``c``: a
    replay never follows another concurrency's recording, made under another batch mix)."""
    return bench(args, url, c, c, max_tokens or args.dflash_max_tokens, args.serve_prompt_tokens, env, seed=c)


def warm_up(args, url: str, c: int, env: dict[str, str]) -> None:
    """The same requests, shorter and untimed: the shapes of batch ``c`` (prefill of ``c`` prompts,
    ``c``-row steps) run once before anything at ``c`` is timed or recorded."""
    dflash_bench(args, url, c, env, max_tokens=min(32, args.dflash_max_tokens))


def run_dflash_plain(args, url: str, plain: dict[int, dict]) -> None:
    for c in int_list(args.dflash_batches):
        if c in plain:
            continue
        warm_up(args, url, c, server_env())
        start_profile(f"dflash_plain_c{c}")
        report = dflash_bench(args, url, c, server_env())
        if isinstance(report, str):
            emit(engine="musegl-serve", figure="dflash_plain", concurrency=c, error=report)
            continue
        plain[c] = served(report)
        emit(engine="musegl-serve", figure="dflash_plain", concurrency=c, **plain[c])


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def replay_counts(control: Path) -> dict:
    """The replay's counts (``musegl_dflash.replay.ReplayCounts``, written beside the control file)."""
    try:
        return json.loads(control.with_name(control.name + ".stats").read_text())
    except (OSError, ValueError):
        return {}


def replayed_run(args, url: str, c: int, env: dict[str, str], control: Path) -> dict:
    """One DFlash run of batch ``c`` at the control file's length: its report (or error text) under
    ``report``, the acceptance the engine measured, and what the replay did meanwhile (sequences that
    followed a recording from their first proposal, that found none, of those the ones whose first
    token differs from the recorded one, the times one left its recording and the median of the
    tokens it had generated then)."""
    from musegl_core.testing.speculation import draft_metric

    names = ("spec_verify_blocks", "spec_accepted_tokens")
    before = [draft_metric(url, n) for n in names]
    counts = replay_counts(control)
    report = dflash_bench(args, url, c, env)
    blocks, accepted = (draft_metric(url, n) - b for n, b in zip(names, before))
    after = replay_counts(control)
    moved = {f"replay_{key}": after.get(key, 0) - counts.get(key, 0)
             for key in ("followed", "unmatched", "first_token_differs", "left")}
    left_after = sorted(after.get("left_after", [])[len(counts.get("left_after", [])):])
    return dict(report=report, measured_acceptance=round((accepted + blocks) / blocks, 2) if blocks else None,
                verify_blocks=int(blocks), **moved,
                replay_left_after_median=left_after[len(left_after) // 2] if left_after else None)


def settle_replay(args, url: str, c: int, k: int, env: dict[str, str], control: Path) -> None:
    """Untimed replays of batch ``c`` at length ``k`` until the replay follows its recordings: each
    run records what the target produced under the replay's own batch mix, which the next run can
    follow. Stops once the measured acceptance reaches ``--dflash-settle-share`` of ``k`` or stops
    growing (the verify budget caps it below ``k`` at wide batches: with decode graphs up to 64 rows
    batch 32 verifies one draft a sequence, at most 2), after at most ``--dflash-settles`` runs. On
    an H100 batch 32 settled at 3.64, then 3.66 of 4 (session 16)."""
    last = 0.0
    for attempt in range(1, max(1, args.dflash_settles) + 1):
        settle = replayed_run(args, url, c, env, control)
        settle.pop("report")
        emit(engine="musegl-serve", figure="dflash_settle", concurrency=c, accept=k, attempt=attempt, **settle)
        got = settle.get("measured_acceptance") or 0.0
        if got >= args.dflash_settle_share * k or got <= last * 1.02:
            return
        last = got


def run_dflash(args, tmp: Path, plain: dict[int, dict]) -> None:
    """Served DFlash at fixed acceptance lengths (the benchmark-only replay), in the order of
    ``--dflash-accept``: every batch at the first length, then every batch at the next, ... (so
    that a time cap cuts the last lengths, not the last batches)."""
    from common import serve_process

    from musegl_dflash.replay import ENV

    raw = raw_text_config(args)
    model = tmp / "target" if (tmp / "target").exists() else write_model_dir(args, tmp)
    draft = write_draft(args, tmp, raw["num_hidden_layers"])
    control = tmp / "accept"
    control.write_text("0")
    batches = int_list(args.dflash_batches)
    env = server_env({ENV: str(control)})
    width = max(batches)
    if any(c not in plain for c in batches):  # the plain figures, same requests, same run (no phase serve/rows)
        with serve_process(model, *serve_flags(args, width), ready_timeout=args.ready_timeout) as (url, _):
            run_dflash_plain(args, url, plain)
    os.environ[ENV] = str(control)
    try:
        with serve_process(model, *serve_flags(args, width), "--dflash", str(draft),
                           ready_timeout=args.ready_timeout) as (url, _):
            recorded: set[int] = set()
            for k in int_list(args.dflash_accept):
                for c in batches:
                    if c not in recorded:
                        # warm first, then record: a recording made while batch c's shapes ran for
                        # the first time followed other numerics than every later run (on the
                        # H200, batch 8's first length replayed at 1.07 instead of 2)
                        control.write_text("0")
                        warm_up(args, url, c, env)
                        dflash_bench(args, url, c, env)
                        # then untimed replays, whose own output the timed runs follow: on the
                        # H200 the first replay after the recording run left it early at batches 8
                        # and 32 (1.07 of 2; 1.86 of 4), a replay after a replay ran at its length
                        # (3.71, 7.38, 13.47; session 15's 1.94 of 4 at batch 32 was the 64-row
                        # verify budget of graphs up to 64 rows, not the replay)
                        control.write_text(str(k))
                        settle_replay(args, url, c, k, env, control)
                        recorded.add(c)
                    control.write_text(str(k))
                    start_profile(f"dflash_c{c}_accept{k}")
                    measured = replayed_run(args, url, c, env, control)
                    report = measured.pop("report")
                    if isinstance(report, str):
                        emit(engine="musegl-serve", figure="dflash", concurrency=c, accept=k, error=report)
                        continue
                    fig = served(report)
                    base = plain.get(c, {})
                    emit(engine="musegl-serve", figure="dflash", concurrency=c, accept=k, **measured,
                         **fig, plain_output_tok_s=base.get("output_tok_s"),
                         plain_decode_only_tok_s=base.get("decode_only_tok_s"),
                         vs_plain=ratio(fig["output_tok_s"], base.get("output_tok_s")),
                         decode_only_vs_plain=ratio(fig["decode_only_tok_s"], base.get("decode_only_tok_s")))
    finally:
        os.environ.pop(ENV, None)


def main() -> int:
    from common import exit_on_termination

    exit_on_termination()  # SIGTERM (timeout) ends through the cleanup: the servers' groups are stopped
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="a Hugging Face directory or config.json (default: MuseGlimmerTextConfig())")
    p.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 shape (CPU smoke runs)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (reduced depth)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (float32, the torch-cpu executor)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"any of {','.join(PHASES)} (default all)")
    p.add_argument("--out", default=None, help="also append every JSON line to this file")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="512", help="positions in the cache of each decoding sequence, "
                   "comma-separated (e.g. 512,8192,32768,131072; capped at the model's positions)")
    p.add_argument("--wide-batches", default="", help="more batch sizes, at --wide-context (e.g. 128,256)")
    p.add_argument("--wide-context", type=int, default=2048)
    p.add_argument("--fill", choices=("zeros", "prefill"), default="zeros",
                   help="the positions before the context: the zeroed cache (default) or prefilled")
    p.add_argument("--headroom-gib", type=float, default=12.0,
                   help="device memory left beside the KV pool (activations, graphs, the server phases)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per point")
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--prefill-repeat", type=int, default=3)
    p.add_argument("--ttft-tokens", type=int, default=32768, help="the long prompt of the ttft figures")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="prefill chunk of the executor's ttft figure")
    p.add_argument("--ttft-chunks", default="", help="chunk sizes of the executor's ttft figure, comma-separated, "
                   "one line each (default: --prefill-chunk)")
    p.add_argument("--forward-sizes", default="",
                   help="decode graph widths of the executor and the servers, comma-separated (default: the "
                        "executor's, 1..128; they also set served DFlash's verify budget, the widest graph: "
                        "with 1..64 batch 32 verified 1 draft a sequence, acceptance <= 2)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="the model split over N devices (rank processes; served: musegl serve "
                        "--tensor-parallel-size N, musegl bench's tokens/s per device)")
    p.add_argument("--weights-kind", default=None,
                   help="random matrices as stored instead of bf16: fp8 (e4m3, a scale per row), a GGUF type "
                        "(q4_k, q5_k, q6_k, q8_0, q4_0) or q4_k_m (Q4_K_M's types per matrix); cuda only")
    p.add_argument("--fp8-w8a8-rows", type=int, default=None,
                   help="with --weights-kind fp8: products of at least N rows run W8A8 (default: the executor's)")
    p.add_argument("--baseline", action="store_true", help="also transformers on the same weights")
    p.add_argument("--baseline-steps", type=int, default=16)
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler tables (CUDA): the executor's prefill step and 4 decode steps at each "
                        "--profile-at point (stderr); the served plain and DFlash runs' steps (the servers' "
                        "MUSEGL_BENCHMARK_PROFILE, tables in --profile-dir)")
    p.add_argument("--profile-at", default="512x1,512x64",
                   help="the decode points profiled, CONTEXTxBATCH, comma-separated")
    p.add_argument("--profile-dir", default=None,
                   help="where the servers write their tables (default: profiles/ beside --out)")
    p.add_argument("--dense-min-rows", type=int, default=None,
                   help="rows of a single-sequence prefill chunk from which its global layers run through torch's "
                        "fused attention (musegl_cuda.cuda.dense_attention.MIN_ROWS; a huge value: never)")
    p.add_argument("--blas", choices=("cublas", "cublaslt"), help="torch's preferred BLAS library (default: torch's)")
    p.add_argument("--serve-concurrency", default="1,8,32,64")
    p.add_argument("--serve-max-tokens", type=int, default=128)
    p.add_argument("--serve-prompt-tokens", type=int, default=256)
    p.add_argument("--serve-context", type=int, default=2048,
                   help="--max-context of the servers (the TTFT server: --ttft-tokens + 1024, one slot)")
    p.add_argument("--serve-flag", action="append", default=[], help="extra musegl serve flag (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--rows-batch", type=int, default=64)
    p.add_argument("--rows-max-tokens", type=int, default=128)
    p.add_argument("--dflash-batches", default="1,8,32")
    p.add_argument("--dflash-accept", default="4,16,2,8",
                   help="acceptance lengths to replay (at most 16), in this order (each at every batch)")
    p.add_argument("--dflash-max-tokens", type=int, default=256)
    p.add_argument("--dflash-settles", type=int, default=4,
                   help="most untimed replays of a batch before its first timed length (see settle_replay)")
    p.add_argument("--dflash-settle-share", type=float, default=0.95,
                   help="the settle replays stop once the measured acceptance reaches this share of the length")
    args = p.parse_args()
    args.phases = [x for x in args.phases.split(",") if x]
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases {', '.join(sorted(unknown))}")
    if is_cuda(args) and not torch.cuda.is_available():
        print("gpu_decode.py: no CUDA GPU (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if args.out:
        OUT.append(args.out)
    if args.profile and is_cuda(args):
        folder = Path(args.profile_dir or (Path(args.out).resolve().parent / "profiles" if args.out else "profiles"))
        folder.mkdir(parents=True, exist_ok=True)
        PROFILE_DIR.append(folder)
        from musegl_cuda.step_profile import ENV as PROFILE_ENV

        os.environ[PROFILE_ENV] = str(folder)  # the servers inherit this process's environment
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.dense_min_rows is not None:
        from musegl_cuda.cuda import dense_attention

        dense_attention.MIN_ROWS = args.dense_min_rows
        emit(figure="setting", dense_min_rows=args.dense_min_rows)
    rng = np.random.default_rng(0)
    checkpoint = text_config(args)
    emit(figure="setup", device=torch.cuda.get_device_name() if is_cuda(args) else "cpu", torch=torch.__version__,
         model=checkpoint.name, layers=checkpoint.config.num_layers, hidden=checkpoint.config.hidden_size,
         phases=args.phases, tensor_parallel_size=args.tensor_parallel_size)
    if args.baseline and args.tensor_parallel_size > 1:
        p.error("--baseline copies one device's weights into transformers: run it without --tensor-parallel-size")
    executor_tok_s: dict = {}
    if "executor" in args.phases:
        holder = [run_musegl(args, checkpoint, rng, executor_tok_s)]
        if args.baseline:
            run_transformers(args, checkpoint, holder, rng)
        else:
            holder.pop().close()
        holder.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    plain: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "serve" in args.phases or "rows" in args.phases:
            run_serve(args, Path(tmp), executor_tok_s, plain)
        if "dflash" in args.phases:
            run_dflash(args, Path(tmp), plain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
