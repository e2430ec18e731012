"""The agent workload on musegl and on llama.cpp's server, back to back in one run (issue 17, item 4).

Runs ``musegl bench --workload agent -c 8 --conversations 8 --turns 5 --prompt-tokens 256
--max-tokens 32`` (the same client code, without the anonymous baseline replay) against:

1. ``musegl serve MODEL`` with 8 session slots and a decode width of 8, and
2. llama.cpp's ``llama-server -m MODEL`` with 8 slots (``-np 8``) and 2 threads,

on the same GGUF (``benchmarks/make_bench_model.py``: the 513M Muse Glimmer text model, f16). musegl
runs once per ``--stall-factors`` value (``--prefill-stall-factor``; default 3 then 0: the prefill
budget, then the fixed chunks of before), then llama.cpp. Prints one JSON object: TTFT p50, output
tok/s and inter-token latency p50 of both servers, the ratios musegl / llama.cpp against the issue's
targets (TTFT <= 0.5x, throughput >= 1.0x, ITL <= 1.5x) and, for musegl, where its step time went
(``scheduling``, from the engine's ``/metrics`` counters before and after the run): steps that only
decoded, steps where decodes shared the forward with prefill chunks of arriving turns ("mixed"), and
prefill-only steps. ``itl_share_from_prefill`` is the part of the mean time a decode row waited for
its step that prefill sharing the step added:
``mixed_decode_rows x (mixed_mean - decode_mean) / (decode_rows x decode_mean + mixed_decode_rows x
mixed_mean)``; compare ``itl_p50`` with ``scheduling.decode.mean_step_s`` for the median.
``musegl_cpu_kernels`` says which stored-weight kernel path musegl ran (``--cpu-kernels`` forces one).

    python benchmarks/agent_compare.py --llama-server /path/llama-server [--model MODEL.gguf]
        [--stall-factors 6,0] [--musegl-flag=--max-prefill-chunk=256 ...] [--omp-wait-policy active]
        [--skip-llamacpp] [--cpu-kernels avx2]

The llama.cpp server is built from the tree vendored in the llama-cpp-python 0.3.36 sdist
(``benchmarks/README.md`` has the build command). Both servers run on the same machine one after the
other; figures measured on a machine shared with other work are only comparable within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Iterator

import httpx

from common import bench_checkpoint, free_port, pin_cpu_kernels, serve, server_process
from musegl_core.bench import BenchConfig, run_bench
from musegl_core.bench.report import BenchReport

TARGETS = {"ttft_p50": ("<=", 0.5), "output_tok_s": (">=", 1.0), "itl_p50": ("<=", 1.5)}
STEP_KINDS = ("decode", "mixed", "prefill")


@contextlib.contextmanager
def llama_server(binary: str, model: Path, *, slots: int, threads: int, context: int,
                 extra: list[str], omp_wait_policy: str, ready_timeout: float = 600.0) -> Iterator[str]:
    """Run llama.cpp's server; yield its base URL once ``/health`` answers 200."""
    port = free_port()
    command = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "-t", str(threads), "-tb", str(threads), "-c", str(context * slots), "--jinja", *extra]
    print("$ " + " ".join(command), file=sys.stderr)
    env = dict(os.environ)
    if omp_wait_policy != "default":
        env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    with server_process(command, port, name="llama-server", env=env, ready_timeout=ready_timeout) as (url, _):
        yield url


def engine_counters(url: str) -> dict[str, float]:
    """musegl's ``musegl_engine_*`` counters from ``/metrics``."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("musegl_engine_"):
            values[name.removeprefix("musegl_engine_").removesuffix("_total")] = float(value)
    return values


def scheduling_breakdown(before: dict[str, float], after: dict[str, float]) -> dict:
    """Step kinds over the measured phase and the share of decode wait that prefill added."""
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    out: dict = {}
    for kind in STEP_KINDS:
        steps = delta.get(f"{kind}_steps", 0.0)
        seconds = delta.get(f"{kind}_step_seconds", 0.0)
        out[kind] = {
            "steps": int(steps),
            "seconds": round(seconds, 3),
            "mean_step_s": seconds / steps if steps else None,
            "decode_rows": int(delta.get(f"{kind}_step_decode_rows", 0.0)),
            "prefill_rows": int(delta.get(f"{kind}_step_prefill_rows", 0.0)),
        }
    decode, mixed = out["decode"], out["mixed"]
    if decode["mean_step_s"] and mixed["steps"]:
        extra = mixed["decode_rows"] * (mixed["mean_step_s"] - decode["mean_step_s"])
        # time-weighted by decode rows: each decode row waits one whole step
        waited = decode["decode_rows"] * decode["mean_step_s"] + mixed["decode_rows"] * mixed["mean_step_s"]
        out["itl_share_from_prefill"] = extra / waited if waited else None
        out["decode_rows_in_mixed_steps"] = mixed["decode_rows"] / max(1, decode["decode_rows"] + mixed["decode_rows"])
    return out


def figures(report: BenchReport) -> dict:
    return {
        "ttft_p50": report.ttft.p50,
        "output_tok_s": report.output_tokens_per_s,
        "itl_p50": report.itl.p50,
        "ttft_p95": report.ttft.p95,
        "itl_p95": report.itl.p95,
        "itl_mean": report.itl.mean,
        "itl_count": report.itl.count,
        "duration_s": report.duration_s,
        "output_tokens": report.output_tokens,
        "prompt_tokens": report.prompt_tokens,
        "cached_tokens": report.cached_tokens,
        "errors": report.errors,
        "error_kinds": report.error_kinds,
    }


def agent_config(url: str, args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(url=url, workload="agent", concurrency=args.concurrency, conversations=args.conversations,
                       turns=args.turns, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                       baseline=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="the f16 GGUF (default: the cached bench preset, the file benchmarks/make_bench_model.py "
                        "writes)")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "llama-server"),
                   help="llama.cpp's server binary (env LLAMA_SERVER)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    p.add_argument("--concurrency", "-c", type=int, default=8)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=4096, help="context per session / slot (default 4096)")
    p.add_argument("--stall-factors", default="6,0",
                   help="musegl runs, one per --prefill-stall-factor, back to back (the first is compared with "
                        "llama.cpp in 'ratio_musegl_over_llamacpp'; default 6,0: the default bound and no bound)")
    p.add_argument("--musegl-flag", action="append", default=[], help="extra musegl serve flag (repeatable)")
    p.add_argument("--omp-wait-policy", default="passive", choices=["passive", "active", "default"],
                   help="OMP_WAIT_POLICY of llama-server (default passive: OpenMP busy-waiting slows it several "
                        "times on a machine shared with other work; use active on a quiet machine)")
    p.add_argument("--llama-flag", action="append", default=[], help="extra llama-server flag (repeatable)")
    p.add_argument("--llama-chat-template", default=None,
                   help="the official Muse Glimmer template for llama-server (models/templates/muse-glimmer.jinja "
                        "of the vendored llama.cpp tree); passed with --skip-chat-parsing (random weights do not "
                        "produce the channel format its parser expects). Without it llama-server falls back to "
                        "chatml, which tokenizes to more prompt tokens than musegl's template")
    p.add_argument("--skip-llamacpp", action="store_true", help="measure musegl only")
    p.add_argument("--cpu-kernels", default=None, choices=["avx512fp16", "avx512", "avx2", "fallback"],
                   help="musegl's stored-weight kernel path (MUSEGL_CPU_KERNELS; default: the best this CPU runs)")
    args = p.parse_args()
    kernels = pin_cpu_kernels(args.cpu_kernels)
    if args.model is None:
        args.model = bench_checkpoint()
    width = str(args.concurrency)
    flags = ["--max-sessions", width, "--max-inflight-requests", str(2 * args.concurrency),
             "--max-decode-sequences", width, "--max-context", str(args.context)]
    flags += [part for flag in args.musegl_flag for part in flag.split("=", 1)]
    factors = [float(f) for f in args.stall_factors.split(",") if f.strip()]
    result: dict = {"workload": {k: getattr(args, k) for k in ("concurrency", "conversations", "turns",
                                                                "prompt_tokens", "max_tokens")},
                    "model": str(args.model), "musegl_flags": flags, "omp_wait_policy": args.omp_wait_policy,
                    "musegl_cpu_kernels": kernels}
    runs: dict[str, dict] = {}
    for factor in factors:
        with serve(args.model, *flags, "--prefill-stall-factor", str(factor)) as url:
            before = engine_counters(url)
            report = run_bench(agent_config(url, args), progress=False)
            after = engine_counters(url)
        runs[f"{factor:g}"] = figures(report)
        runs[f"{factor:g}"]["scheduling"] = scheduling_breakdown(before, after)
    result["musegl_by_stall_factor"] = runs
    if not args.skip_llamacpp:
        extra = [part for flag in args.llama_flag for part in flag.split("=", 1)]
        if args.llama_chat_template:
            extra += ["--chat-template-file", args.llama_chat_template, "--skip-chat-parsing"]
        result["llama_chat_template"] = args.llama_chat_template or "chatml fallback (no template in the GGUF)"
        with llama_server(args.llama_server, args.model, slots=args.concurrency, threads=args.threads,
                          context=args.context, extra=extra, omp_wait_policy=args.omp_wait_policy) as url:
            report = run_bench(agent_config(url, args), progress=False)
        result["llamacpp"] = figures(report)
        result["targets"] = {key: f"{d} {t}" for key, (d, t) in TARGETS.items()}
        for name, ours in runs.items():
            ratios, met = {}, {}
            for key, (direction, target) in TARGETS.items():
                mine, theirs = ours[key], result["llamacpp"][key]
                ratio = mine / theirs if mine is not None and theirs else None
                ratios[key] = ratio
                met[key] = ratio is not None and (ratio <= target if direction == "<=" else ratio >= target)
            ours["ratio_over_llamacpp"] = ratios
            ours["met"] = met
    headline = runs[f"{factors[0]:g}"]
    result["musegl"] = {"prefill_stall_factor": factors[0], **headline}
    if "met" in headline:
        result["ratio_musegl_over_llamacpp"] = headline["ratio_over_llamacpp"]
        result["met"] = headline["met"]
    print(json.dumps(result, indent=2))
    errors = sum(run["errors"] for run in runs.values()) + result.get("llamacpp", {}).get("errors", 0)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
