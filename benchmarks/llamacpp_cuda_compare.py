"""musegl vs llama.cpp's CUDA ``llama-server`` on the same GPU and shape, in one run.

The agent workload of issue 32 and plain decode, each against both servers one after the other:

* **decode** (first, so that it is measured when the agent part outlasts a time cap): the
  ``chat`` workload at each ``--decode-concurrency`` (``--decode-prompt-tokens`` prompt,
  ``--decode-max-tokens`` generated tokens): output tok/s, inter-token p50;
* **agent**: ``musegl bench --workload agent`` with ``--conversations`` conversations (all in
  flight) of ``--turns`` turns, every conversation opening with the same system prompt of about
  ``--shared-system-tokens`` tokens and ten tool definitions (``--tools``), ``--prompt-tokens``
  new tokens a turn (user text or tool results) and ``--max-tokens`` generated tokens a turn
  (``ignore_eos``), musegl's sessions on (each conversation is a named session; llama.cpp keeps a
  slot's prompt cache); TTFT p50/p99, inter-token p50/p99, output tok/s, cached share of the
  prompt tokens. Each slot holds ``slot_context`` positions (``--slot-context``, else sized from
  what the workload sends: see :func:`slot_context`).

musegl serves ``--model`` (a directory with the bare ``config.json`` that ``make_gguf_30b.py
--config-out`` writes) with ``--load-format dummy`` (random weights on the GPU, the demo
tokenizer); llama.cpp serves ``--gguf`` (``make_gguf_30b.py``: same shape, same tokenizer) with
every layer on the GPU (``-ngl 999``), flash attention on (``-fa on``), one slot per conversation
and the official Muse Glimmer chat template (``--chat-template-file``; its output parser is off:
``--skip-chat-parsing``, random weights do not write its channel format). Prints one JSON line per
figure (``--out``: appended there too) and, last, the musegl / llama.cpp ratios with the issue's
targets (agent output tok/s >= 2.0x, TTFT p50 <= 0.5x).

    python benchmarks/llamacpp_cuda_compare.py --llama-server BIN --gguf M.gguf --model DIR
        [--sides musegl,llamacpp] [--device cpu] [--musegl-flag=--prefix-cache-entries=4 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import exit_on_termination, free_port, serve, server_process  # noqa: E402
from musegl_core.bench import BenchConfig, run_bench  # noqa: E402
from musegl_core.bench.report import BenchReport  # noqa: E402

TARGETS = {"agent_output_tok_s": (">=", 2.0), "agent_ttft_p50": ("<=", 0.5)}
OUT: list[str] = []


def emit(**fields) -> None:
    line = json.dumps(fields)
    print(line, flush=True)
    for path in OUT:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


#: Tokens of the ten tool definitions (Claude Code's, as the chat template writes them) and the
#: template's own text around the system prompt, rounded up.
TOOLS_AND_TEMPLATE_TOKENS = 4000
#: A reply of ``--max-tokens`` random-weight tokens, detokenized and sent back in the next turn's
#: history, tokenizes again into up to this many times as many tokens (random ids decode to rare
#: pieces that re-tokenize shorter).
REPLY_RETOKENIZE = 4
#: Added to the sum, for the estimate's errors.
SLOT_MARGIN = 1.25


def slot_context(args) -> int:
    """Positions one conversation needs (``--slot-context``, else from what the workload sends):
    the system prompt, the tool definitions and the template; then each turn's new user text, one
    tool result of the same size (an answer to each reply's tool call), the reply as it comes back
    in the history and the template's turn markers; with :data:`SLOT_MARGIN`. On the H200 run of
    issue 32 (12000 + tools, 500 a turn, 128 generated) a conversation grew by 1450-2030 tokens a
    turn and both servers refused turn 7 of the earlier estimate (22920 positions)."""
    if args.slot_context:
        return args.slot_context
    tools = 0 if args.no_tools else TOOLS_AND_TEMPLATE_TOKENS
    per_turn = args.prompt_tokens * (1 if args.no_tools else 2) + args.max_tokens * REPLY_RETOKENIZE + 64
    need = args.shared_system_tokens + tools + 256 + args.turns * per_turn + args.max_tokens
    return int(need * SLOT_MARGIN)


@contextlib.contextmanager
def llama_server(args, slots: int, context: int) -> Iterator[str]:
    port = free_port()
    command = [args.llama_server, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(slots), "-c", str(context * slots), "--jinja", "-fa", "on",
               "-ngl", "999" if args.device != "cpu" else "0"]
    if args.chat_template:
        command += ["--chat-template-file", str(args.chat_template), "--skip-chat-parsing"]
    if args.threads:
        command += ["-t", str(args.threads), "-tb", str(args.threads)]
    command += [part for flag in args.llama_flag for part in flag.split("=", 1)]
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    env = dict(os.environ)
    lib = Path(args.llama_server).resolve().parent
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib), env.get("LD_LIBRARY_PATH", "")]))
    with server_process(command, port, name="llama-server", env=env, ready_timeout=args.ready_timeout) as (url, _):
        yield url


@contextlib.contextmanager
def musegl_server(args, slots: int, context: int) -> Iterator[str]:
    executor = "torch-cpu" if args.device == "cpu" else "cuda"
    flags = ["--load-format", "dummy", "--executor", executor, "--max-sessions", str(slots),
             "--max-inflight-requests", str(2 * slots), "--max-decode-sequences", str(slots),
             "--max-context", str(context)]
    if not args.no_tools:
        flags += ["--tool-parser", "atem"]  # musegl refuses tools it cannot parse calls of
    flags += [part for flag in args.musegl_flag for part in flag.split("=", 1)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins" / "cuda"),
                                                os.environ.get("PYTHONPATH", "")])
    with serve(args.model, *flags, ready_timeout=args.ready_timeout) as url:
        yield url


def agent_figures(report: BenchReport) -> dict:
    def ms(value):
        return None if value is None else round(value * 1e3, 2)

    return dict(requests=report.requests, errors=report.errors, error_kinds=report.error_kinds,
                output_tok_s=round(report.output_tokens_per_s, 1), output_tokens=report.output_tokens,
                ttft_p50_ms=ms(report.ttft.p50), ttft_p99_ms=ms(report.ttft.p99),
                itl_p50_ms=ms(report.itl.p50), itl_p99_ms=ms(report.itl.p99),
                prompt_tokens=report.prompt_tokens, cached_tokens=report.cached_tokens,
                cached_share=round(report.cached_tokens / report.prompt_tokens, 4) if report.prompt_tokens else None,
                duration_s=round(report.duration_s, 1),
                # per turn: TTFT p50 and the mean new (uncached) prompt positions of a request
                per_turn=[dict(turn=t.turn, ttft_p50_ms=ms(t.ttft.p50),
                            new_rows=round((t.prompt_tokens - t.cached_tokens) / t.requests) if t.requests else None)
                       for t in report.turns])


def measure(args, side: str, url: str) -> dict:
    """Plain decode first (short: it must not wait behind the long agent part under the stage's
    time cap), then the agent workload; each part's line is printed as it finishes."""
    figures = {}
    for c in [int(x) for x in args.decode_concurrency.split(",") if x]:
        started = time.perf_counter()
        config = BenchConfig(url=url, workload="chat", concurrency=c, requests=c, max_tokens=args.decode_max_tokens,
                             prompt_tokens=args.decode_prompt_tokens, timeout=args.request_timeout)
        report = run_bench(config, progress=False)
        fig = dict(output_tok_s=round(report.output_tokens_per_s, 1), errors=report.errors,
                   itl_p50_ms=None if report.itl.p50 is None else round(report.itl.p50 * 1e3, 2),
                   decode_tok_s=round(c / report.itl.p50, 1) if report.itl.p50 else None,
                   wall_s=round(time.perf_counter() - started, 1))
        figures[f"decode_c{c}"] = fig
        emit(side=side, figure="decode", concurrency=c, max_tokens=args.decode_max_tokens, **fig)
    started = time.perf_counter()
    agent = BenchConfig(url=url, workload="agent", concurrency=args.conversations, conversations=args.conversations,
                        turns=args.turns, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                        baseline=False, shared_system_tokens=args.shared_system_tokens, tools=not args.no_tools,
                        timeout=args.request_timeout)
    figures["agent"] = agent_figures(run_bench(agent, progress=False))
    if side == "musegl" and args.metrics_out:  # where the engine's time went (step kinds, prefill, queue)
        import httpx

        Path(args.metrics_out).write_text(httpx.get(f"{url}/metrics", timeout=60).text, encoding="utf-8")
    emit(side=side, figure="agent", conversations=args.conversations, turns=args.turns,
         shared_system_tokens=args.shared_system_tokens, prompt_tokens_per_turn=args.prompt_tokens,
         max_tokens=args.max_tokens, **figures["agent"], wall_s=round(time.perf_counter() - started, 1))
    return figures


def main() -> int:
    exit_on_termination()  # SIGTERM (timeout) ends through the cleanup: the servers' groups are stopped
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="llama.cpp's server binary")
    p.add_argument("--gguf", type=Path, help="the GGUF llama.cpp serves (make_gguf_30b.py)")
    p.add_argument("--model", type=Path, required=True, help="the directory of the same shape's bare config.json")
    p.add_argument("--chat-template", type=Path, default=None,
                   help="models/templates/muse-glimmer.jinja of the llama.cpp tree (default: llama.cpp's fallback)")
    p.add_argument("--sides", default="musegl,llamacpp")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (torch-cpu, -ngl 0)")
    p.add_argument("--threads", type=int, default=None, help="llama-server threads (default: its own)")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--shared-system-tokens", type=int, default=12000)
    p.add_argument("--no-tools", action="store_true", help="send no tool definitions")
    p.add_argument("--prompt-tokens", type=int, default=500, help="new tokens a turn (user text, tool results)")
    p.add_argument("--max-tokens", type=int, default=256, help="generated tokens a turn")
    p.add_argument("--slot-context", type=int, default=None, help="context per conversation (default: computed)")
    p.add_argument("--decode-concurrency", default="1,32")
    p.add_argument("--decode-prompt-tokens", type=int, default=256)
    p.add_argument("--decode-max-tokens", type=int, default=128)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--musegl-flag", action="append", default=[], help="extra musegl serve flag (repeatable)")
    p.add_argument("--llama-flag", action="append", default=[], help="extra llama-server flag (repeatable)")
    p.add_argument("--out", default=None, help="also append every JSON line to this file")
    p.add_argument("--metrics-out", default=None, help="write musegl's /metrics after its agent part to this file")
    args = p.parse_args()
    if args.out:
        OUT.append(args.out)
    sides = [s for s in args.sides.split(",") if s]
    if "llamacpp" in sides and (not args.llama_server or not args.gguf):
        p.error("the llamacpp side needs --llama-server and --gguf")
    slots = max(args.conversations, max(int(x) for x in args.decode_concurrency.split(",") if x))
    context = slot_context(args)
    emit(figure="setup", sides=sides, slots=slots, slot_context=context, device=args.device,
         model=str(args.model), gguf=str(args.gguf) if args.gguf else None)
    results = {}
    for side in sides:
        runner = musegl_server if side == "musegl" else llama_server
        with runner(args, slots, context) as url:
            results[side] = measure(args, side, url)
    if {"musegl", "llamacpp"} <= set(results):
        ours, theirs = results["musegl"], results["llamacpp"]
        ratios = {"agent_output_tok_s": ours["agent"]["output_tok_s"] / theirs["agent"]["output_tok_s"]
                  if theirs["agent"]["output_tok_s"] else None,
                  "agent_ttft_p50": ours["agent"]["ttft_p50_ms"] / theirs["agent"]["ttft_p50_ms"]
                  if ours["agent"]["ttft_p50_ms"] and theirs["agent"]["ttft_p50_ms"] else None}
        for key in ours:
            if key.startswith("decode_") and key in theirs and theirs[key]["output_tok_s"]:
                ratios[f"{key}_output_tok_s"] = ours[key]["output_tok_s"] / theirs[key]["output_tok_s"]
        met = {k: r is not None and (r >= t if d == ">=" else r <= t) for k, (d, t) in TARGETS.items()
               for r in [ratios.get(k)]}
        emit(figure="ratio_musegl_over_llamacpp", **{k: None if v is None else round(v, 3) for k, v in ratios.items()},
             targets={k: f"{d} {t}" for k, (d, t) in TARGETS.items()}, met=met)
    errors = sum(f.get("errors", 0) for side in results.values() for f in side.values())
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
