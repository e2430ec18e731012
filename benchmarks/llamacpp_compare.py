"""musegl vs llama.cpp's server on the same GGUF, same prompts, same run.

For each file type (default ``f16`` and ``q8_0`` of the ``bench`` checkpoint:
hidden 1024, 8 layers, 8/2 heads, head_dim 128, ffn 2816, vocabulary 202048,
random weights; ``q4_k_m`` is written by llama.cpp's own ``llama-quantize``),
starts llama.cpp's ``llama-server`` (``--threads`` threads, ``--parallel``
slots) and ``musegl serve`` (torch-cpu, weights as stored) on the same file,
and runs the ``chat`` workload of ``musegl bench`` against each at concurrency
1 and 4: about ``--prompt-tokens`` prompt tokens, exactly ``--max-tokens``
output tokens per request (greedy, ``ignore_eos``). With ``--rounds N`` both
servers stay up and the two sides take turns, N rounds of llama.cpp then
musegl, so that load from other work on the machine falls on both alike; the
figures are then the medians over the rounds (each round's kept too). Prints one
JSON object: output tok/s, inter-token and first-token latency per side and
concurrency, musegl / llama.cpp ratios with the issue's targets, and which
stored-weight kernel path musegl ran (``musegl_cpu_kernels``; ``--cpu-kernels``
forces one, e.g. ``avx2`` on an AVX-512 machine).

``llama-server`` comes from ``--llama-server``, ``$LLAMA_SERVER`` or ``PATH``
(benchmarks/README.md says how to build it from the llama-cpp-python sdist);
``--llama-env`` sets its environment (``LD_LIBRARY_PATH`` of a ``libggml-cpu``
built without AVX-512, ``OMP_WAIT_POLICY``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path
from typing import Iterator

from common import bench_checkpoint, free_port, pin_cpu_kernels, serve, server_process
from musegl_core.bench import BenchConfig, run_bench

# The targets: musegl / llama.cpp output tok/s, per file type and concurrency.
TARGETS = {"f16": {"1": 1.0, "4": 1.2}, "q8_0": {"1": 1.0}, "q4_k_m": {"1": 1.0}}
#: File types written by llama.cpp's llama-quantize from the f16 file (its own mix of types).
LLAMA_QUANTIZED = {"q4_k_m": "Q4_K_M"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def gguf_of(file_type: str, f16: Path) -> Path:
    """The bench checkpoint as ``file_type``: the cached f16 file itself, or a conversion
    of it written once beside it (same weights, same tokenizer metadata)."""
    if file_type == "f16":
        return f16
    target = f16.with_name(f"{f16.stem}-{file_type}.gguf")
    if target.exists():
        return target
    if file_type in LLAMA_QUANTIZED:
        from musegl_core.testing.llamacpp import quantize

        log(f"writing {target} (llama-quantize {LLAMA_QUANTIZED[file_type]} of {f16})")
        tmp = target.with_suffix(".partial")
        quantize(f16, tmp, LLAMA_QUANTIZED[file_type])
        os.replace(tmp, target)
        return target
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.loader import load_checkpoint

    log(f"writing {target} (from {f16})")
    checkpoint = load_checkpoint(f16)

    class Lazy(dict):  # each weight read from the f16 file when the writer asks for it
        def __getitem__(self, name: str):
            return checkpoint.read(name)

    weights = Lazy.fromkeys(checkpoint.tensor_names)
    tmp = target.with_suffix(".partial")
    write_text_gguf(tmp, checkpoint.config, weights, checkpoint.tokenizer, file_type=file_type,
                    name=checkpoint.name)
    checkpoint.close()
    os.replace(tmp, target)
    return target


def over_rounds(values: list):
    """One figure of several rounds: counts (ints) summed, measures (floats) their median
    (rounds without one left out; None when none has one)."""
    if all(isinstance(v, int) for v in values):
        return sum(values)
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def find_llama_server(given: str | None) -> str:
    path = given or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not path or not Path(path).exists():
        raise SystemExit("llama-server not found: pass --llama-server PATH or set LLAMA_SERVER "
                         "(benchmarks/README.md: building it from the llama-cpp-python sdist)")
    return path


@contextlib.contextmanager
def llama_server(binary: str, model: Path, threads: int, slots: int, context: int,
                 env: dict[str, str] | None = None, ready_timeout: float = 600.0) -> Iterator[str]:
    port = free_port()
    command = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
               "--threads-batch", str(threads), "--parallel", str(slots), "--ctx-size", str(context)]
    log("$ " + " ".join(f"{k}={v}" for k, v in (env or {}).items()) + " " + " ".join(command))
    with server_process(command, port, name="llama-server", env={**os.environ, **(env or {})},
                        ready_timeout=ready_timeout) as (url, _):
        yield url


def measure(url: str, concurrencies: list[int], args: argparse.Namespace) -> dict[str, dict]:
    out = {}
    for c in concurrencies:
        config = BenchConfig(url=url, workload="chat", concurrency=c, requests=args.requests_per_client * c,
                             max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens, seed=args.seed)
        report = run_bench(config, progress=False)
        out[str(c)] = {
            "output_tok_s": report.output_tokens_per_s,
            "itl_p50_ms": None if report.itl.p50 is None else report.itl.p50 * 1e3,
            "itl_p95_ms": None if report.itl.p95 is None else report.itl.p95 * 1e3,
            "ttft_p50_s": report.ttft.p50,
            "prompt_tokens_per_request": report.prompt_tokens / max(report.succeeded, 1),
            "output_tokens": report.output_tokens,
            "requests": report.requests,
            "errors": report.errors,
        }
        log(f"  c={c}: {out[str(c)]['output_tok_s']:.2f} tok/s, itl p50 {out[str(c)]['itl_p50_ms']} ms")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file-types", default="f16,q8_0",
                   help="comma-separated: f16, q8_0, q4_0, bf16, q4_k_m (llama-quantize)")
    p.add_argument("--concurrency", default="1,4", help="comma-separated concurrencies")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2, help="requests = this x concurrency")
    p.add_argument("--threads", type=int, default=2, help="llama-server --threads (musegl: torch's default)")
    p.add_argument("--slots", type=int, default=4, help="llama-server --parallel and musegl's decode width")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' filler text (same for both)")
    p.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary")
    p.add_argument("--llama-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of llama-server (repeatable), e.g. LD_LIBRARY_PATH=DIR of an AVX2 libggml-cpu")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of llama.cpp then musegl with both servers up (figures: medians over rounds)")
    p.add_argument("--musegl-flag", action="append", default=[], help="extra `musegl serve` flag (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--cpu-kernels", default=None, choices=["avx512fp16", "avx512", "avx2", "fallback"],
                   help="musegl's stored-weight kernel path (MUSEGL_CPU_KERNELS; default: the best this CPU runs)")
    args = p.parse_args()
    binary = find_llama_server(args.llama_server)
    kernels = pin_cpu_kernels(args.cpu_kernels)
    log(f"musegl stored-weight kernels: {kernels['path']}")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    per_slot = args.prompt_tokens + args.max_tokens + 256
    f16 = bench_checkpoint()
    figures: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load_avg_at_start": os.getloadavg()},
        "musegl_cpu_kernels": kernels,
        "workload": {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                     "requests_per_client": args.requests_per_client, "llama_threads": args.threads,
                     "slots": args.slots, "seed": args.seed},
        "results": {},
    }
    width = str(args.slots)
    musegl_flags = ("--max-decode-sequences", width, "--max-inflight-requests", width, "--max-sessions", width,
                    "--max-context", str(max(2048, per_slot)), *args.musegl_flag)
    llama_env = dict(item.split("=", 1) for item in args.llama_env)
    figures["workload"]["llama_env"] = llama_env
    figures["workload"]["rounds"] = args.rounds
    for file_type in args.file_types.split(","):
        model = gguf_of(file_type, f16)
        entry: dict = {"gguf": str(model), "bytes": model.stat().st_size}
        with contextlib.ExitStack() as stack:
            log(f"[{file_type}] starting llama.cpp and musegl")
            urls = {"llama.cpp": stack.enter_context(llama_server(binary, model, args.threads, args.slots,
                                                                  per_slot * args.slots, llama_env)),
                    "musegl": stack.enter_context(serve(model, *musegl_flags))}
            rounds = []
            for r in range(args.rounds):
                rounds.append({})
                for side, url in urls.items():
                    log(f"[{file_type}] round {r + 1}/{args.rounds}: {side}")
                    rounds[-1][side] = measure(url, concurrencies, args)
        for side in urls:
            entry[side] = {c: {key: over_rounds([rnd[side][c][key] for rnd in rounds])
                               for key in rounds[0][side][c]} for c in map(str, concurrencies)}
        ratios = {}
        for c in map(str, concurrencies):
            per_round = [rnd["musegl"][c]["output_tok_s"] / rnd["llama.cpp"][c]["output_tok_s"]
                         for rnd in rounds if rnd["llama.cpp"][c]["output_tok_s"]]
            ratios[c] = statistics.median(per_round) if per_round else None
            entry.setdefault("ratio_per_round", {})[c] = per_round
        entry["ratio_output_tok_s"] = ratios
        if args.rounds > 1:
            entry["rounds"] = rounds
        targets = TARGETS.get(file_type, {})
        entry["targets"] = {c: {"target": t, "met": ratios.get(c) is not None and ratios[c] >= t}
                            for c, t in targets.items() if c in ratios}
        figures["results"][file_type] = entry
    figures["machine"]["load_avg_at_end"] = os.getloadavg()
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    errors = sum(side[c]["errors"] for e in figures["results"].values() for side in (e["llama.cpp"], e["musegl"])
                 for c in side)
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
