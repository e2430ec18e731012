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

**The AgentX shape** (``--preset agentx``, issue 45): ``--conversations`` sessions whose
contexts grow past 100K (each opens with a context of its own, ``--context-tokens``, on top of
the shared system prompt and tools, and grows by ``--prompt-tokens`` of user text and as much
again of tool results a turn), ``--subagents`` subagent sessions spawned at their parents' turn
2 beside them (``musegl bench --subagents``), every session open at once with
``--concurrency`` requests in flight (``--interleave``). llama.cpp runs ``--llama-slots`` slots
(default: ``--concurrency``) and keeps the other sessions' prompts in host RAM with
``--cache-ram MIB``; musegl holds every session (``--max-sessions``), on the device and in its
host tier (``--kv-offload-memory SIZE``). Reported per side: sessions held (every warm turn
>= 95 % cached), warm-turn TTFT p50/p99 (turns after each session's first) and output tok/s.
The preset skips plain decode (``--decode-concurrency ""``).

    python benchmarks/llamacpp_cuda_compare.py --llama-server BIN --gguf M.gguf --model DIR
        [--sides musegl,llamacpp] [--device cpu] [--musegl-flag=--prefix-cache-entries=4 ...]
    python benchmarks/llamacpp_cuda_compare.py --preset agentx --cache-ram 32768 --kv-offload-memory 32GiB ...
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
#: ``--no-agent`` on a quantized file (issue 48: Q4_K_M decode at batch 1 and 32 concurrent requests)
QUANTIZED_TARGETS = {"decode_c1_output_tok_s": (">=", 1.3), "decode_c32_output_tok_s": (">=", 3.0)}
OUT: list[str] = []
#: ``--preset`` defaults (flags given on the command line win). ``agentx``: AgentX's coding-agent
#: traffic (a median session of 43 turns and 142K input tokens, 44 % spawning subagents) cut to a
#: stage of minutes: 8 sessions opening at about 104K positions (12K system + tools + 88K of their
#: own) and growing about 4.3K a turn to about 117K, 4 subagents of 16K beside them.
PRESETS = {
    "agentx": dict(conversations=8, turns=4, shared_system_tokens=12000, context_tokens=88000, prompt_tokens=2000,
                   max_tokens=64, subagents=4, subagent_turns=3, subagent_context_tokens=16000, concurrency=4,
                   interleave=True, decode_concurrency=""),
}


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
    own = max(args.context_tokens + args.turns * per_turn,
              args.subagent_context_tokens + args.subagent_turns * per_turn if args.subagents else 0)
    need = args.shared_system_tokens + tools + 256 + own + args.max_tokens
    native = native_context(args.model)
    return min(int(need * SLOT_MARGIN), native) if native else int(need * SLOT_MARGIN)


def native_context(model: Path) -> int | None:
    """The model's positions (``max_position_embeddings`` of its config.json), or None."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    raw = json.loads(config.read_text())
    return (raw.get("text_config") or raw).get("max_position_embeddings")


def sessions_of(args) -> int:
    """Named sessions the agent part opens: its conversations and their subagents."""
    return args.conversations + args.subagents


@contextlib.contextmanager
def llama_server(args, slots: int, context: int) -> Iterator[str]:
    port = free_port()
    slots = args.llama_slots or slots
    command = [args.llama_server, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(slots), "-c", str(context * slots), "--jinja", "-fa", "on",
               "-ngl", "999" if args.device != "cpu" else "0"]
    if args.cache_ram is not None:  # the host-RAM prompt cache (MiB)
        command += ["--cache-ram", str(args.cache_ram)]
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
    # --musegl-checkpoint: the checkpoint itself (e.g. the GGUF llama.cpp serves, its matrices as stored)
    weights = [] if args.musegl_checkpoint else ["--load-format", "dummy"]
    flags = [*weights, "--executor", executor, "--max-sessions", str(max(slots, sessions_of(args))),
             "--max-inflight-requests", str(2 * slots), "--max-decode-sequences", str(slots),
             "--max-context", str(context)]
    if args.kv_offload_memory:
        flags += ["--kv-offload-memory", args.kv_offload_memory]
    if not args.no_tools:
        flags += ["--tool-parser", "atem"]  # musegl refuses tools it cannot parse calls of
    flags += [part for flag in args.musegl_flag for part in flag.split("=", 1)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins" / "cuda"),
                                                os.environ.get("PYTHONPATH", "")])
    with serve(args.musegl_checkpoint or args.model, *flags, ready_timeout=args.ready_timeout) as url:
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
                # the warm turns (after each session's first) and the sessions held (every warm turn
                # >= 95 % cached): musegl bench's WarmStats
                sessions=report.warm.sessions if report.warm else None,
                sessions_held=report.warm.sessions_held if report.warm else None,
                warm_turns=report.warm.warm_turns if report.warm else None,
                warm_turns_held=report.warm.warm_turns_held if report.warm else None,
                warm_ttft_p50_ms=ms(report.warm.ttft.p50) if report.warm else None,
                warm_ttft_p99_ms=ms(report.warm.ttft.p99) if report.warm else None,
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
    if args.no_agent:
        return figures
    started = time.perf_counter()
    agent = BenchConfig(url=url, workload="agent", concurrency=args.concurrency or args.conversations,
                        conversations=args.conversations, turns=args.turns, prompt_tokens=args.prompt_tokens,
                        max_tokens=args.max_tokens, baseline=False, shared_system_tokens=args.shared_system_tokens,
                        tools=not args.no_tools, timeout=args.request_timeout, context_tokens=args.context_tokens,
                        subagents=args.subagents, subagent_turns=args.subagent_turns,
                        subagent_context_tokens=args.subagent_context_tokens, interleave=args.interleave)
    figures["agent"] = agent_figures(run_bench(agent, progress=False))
    if side == "musegl" and args.metrics_out:  # where the engine's time went (step kinds, prefill, queue)
        import httpx

        Path(args.metrics_out).write_text(httpx.get(f"{url}/metrics", timeout=60).text, encoding="utf-8")
    emit(side=side, figure="agent", conversations=args.conversations, turns=args.turns,
         shared_system_tokens=args.shared_system_tokens, prompt_tokens_per_turn=args.prompt_tokens,
         max_tokens=args.max_tokens, context_tokens=args.context_tokens, subagents=args.subagents,
         subagent_turns=args.subagent_turns, subagent_context_tokens=args.subagent_context_tokens,
         concurrency=args.concurrency or args.conversations, interleave=args.interleave,
         **figures["agent"], wall_s=round(time.perf_counter() - started, 1))
    return figures


#: what an ``agent`` line must match to stand in for a side of this run (``--previous``)
WORKLOAD_KEYS = ("conversations", "turns", "shared_system_tokens", "prompt_tokens_per_turn", "max_tokens",
                 "context_tokens", "subagents", "subagent_turns", "subagent_context_tokens", "concurrency",
                 "interleave")


def load_previous(path: Path, args) -> dict[str, dict]:
    """Per side, the newest ``decode`` and ``agent`` figures of an earlier run's JSON lines
    (``--out`` of a call that ran one side: a stage of minutes per side), the agent part only
    where its workload is this run's."""
    wanted = dict(conversations=args.conversations, turns=args.turns, shared_system_tokens=args.shared_system_tokens,
                  prompt_tokens_per_turn=args.prompt_tokens, max_tokens=args.max_tokens,
                  context_tokens=args.context_tokens, subagents=args.subagents, subagent_turns=args.subagent_turns,
                  subagent_context_tokens=args.subagent_context_tokens,
                  concurrency=args.concurrency or args.conversations, interleave=args.interleave)
    found: dict[str, dict] = {}
    if not Path(path).is_file():
        return found
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        side = row.get("side")
        if row.get("figure") == "agent" and all(row.get(k) == wanted[k] for k in WORKLOAD_KEYS):
            found.setdefault(side, {})["agent"] = row
        elif row.get("figure") == "decode" and side:
            found.setdefault(side, {})[f"decode_c{row['concurrency']}"] = row
    return {side: figures for side, figures in found.items() if "agent" in figures or args.no_agent}


def main() -> int:
    exit_on_termination()  # SIGTERM (timeout) ends through the cleanup: the servers' groups are stopped
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="defaults of a workload shape (agentx: see the module); flags given win")
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
    p.add_argument("--context-tokens", type=int, default=0, help="each conversation's own context ahead of its "
                   "first message (musegl bench --context-tokens)")
    p.add_argument("--subagents", type=int, default=0, help="subagent sessions spawned at their parents' turn 2")
    p.add_argument("--subagent-turns", type=int, default=3)
    p.add_argument("--subagent-context-tokens", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=None,
                   help="agent requests in flight (default: --conversations)")
    p.add_argument("--interleave", action="store_true",
                   help="every agent session open at once, --concurrency bounding the requests in flight")
    p.add_argument("--cache-ram", type=int, default=None, metavar="MIB",
                   help="llama-server --cache-ram (its host-RAM prompt cache; default: llama.cpp's, 8192)")
    p.add_argument("--llama-slots", type=int, default=None,
                   help="llama-server -np (default: the largest of --conversations and --decode-concurrency; "
                        "with --preset agentx: --concurrency, the other sessions waiting in --cache-ram)")
    p.add_argument("--kv-offload-memory", default=None, metavar="SIZE",
                   help="musegl serve --kv-offload-memory (its host tier; default: musegl's)")
    p.add_argument("--decode-concurrency", default="1,32")
    p.add_argument("--decode-prompt-tokens", type=int, default=256)
    p.add_argument("--decode-max-tokens", type=int, default=128)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--musegl-checkpoint", type=Path, default=None,
                   help="musegl serves this checkpoint (e.g. the same --gguf: a Q4_K_M file read as stored) "
                        "instead of --model's shape with random weights")
    p.add_argument("--no-agent", action="store_true", help="plain decode only (--decode-concurrency), no agent part")
    p.add_argument("--musegl-flag", action="append", default=[], help="extra musegl serve flag (repeatable)")
    p.add_argument("--llama-flag", action="append", default=[], help="extra llama-server flag (repeatable)")
    p.add_argument("--out", default=None, help="also append every JSON line to this file")
    p.add_argument("--previous", type=Path, default=None,
                   help="JSON lines of an earlier run on the same machine (its --out): a side not run now is "
                        "taken from there for the ratios (one side per call when both do not fit one)")
    p.add_argument("--metrics-out", default=None, help="write musegl's /metrics after its agent part to this file")
    known, _ = p.parse_known_args()
    if known.preset:
        p.set_defaults(**PRESETS[known.preset])
        if known.preset == "agentx":
            p.set_defaults(llama_slots=PRESETS["agentx"]["concurrency"])
    args = p.parse_args()
    if args.out:
        OUT.append(args.out)
    if args.preset == "agentx" and args.llama_slots == PRESETS["agentx"]["concurrency"] and args.concurrency:
        args.llama_slots = args.concurrency  # (a --concurrency given: llama.cpp's slots follow it)
    sides = [s for s in args.sides.split(",") if s]
    if "llamacpp" in sides and (not args.llama_server or not args.gguf):
        p.error("the llamacpp side needs --llama-server and --gguf")
    decode_levels = [int(x) for x in args.decode_concurrency.split(",") if x]
    slots = max([args.conversations if not args.interleave else (args.concurrency or args.conversations)]
                + decode_levels)
    context = slot_context(args)
    emit(figure="setup", sides=sides, slots=slots, slot_context=context, device=args.device,
         model=str(args.model), gguf=str(args.gguf) if args.gguf else None, preset=args.preset,
         sessions=sessions_of(args), llama_slots=args.llama_slots or slots, cache_ram_mib=args.cache_ram,
         kv_offload_memory=args.kv_offload_memory)
    results = {}
    for side in sides:
        runner = musegl_server if side == "musegl" else llama_server
        with runner(args, slots, context) as url:
            results[side] = measure(args, side, url)
    if args.previous:  # the other side, measured by an earlier call on the same machine
        for side, figures in load_previous(args.previous, args).items():
            if side not in results:
                results[side] = figures
                emit(figure="previous", side=side, path=str(args.previous), parts=sorted(figures))
    if {"musegl", "llamacpp"} <= set(results):
        ours, theirs = results["musegl"], results["llamacpp"]
        ratios, held = {}, {}
        if "agent" in ours and "agent" in theirs:
            ratios = {"agent_output_tok_s": ours["agent"]["output_tok_s"] / theirs["agent"]["output_tok_s"]
                      if theirs["agent"]["output_tok_s"] else None,
                      "agent_ttft_p50": ours["agent"]["ttft_p50_ms"] / theirs["agent"]["ttft_p50_ms"]
                      if ours["agent"]["ttft_p50_ms"] and theirs["agent"]["ttft_p50_ms"] else None}
            for key in ("warm_ttft_p50_ms", "warm_ttft_p99_ms"):
                mine, other = ours["agent"].get(key), theirs["agent"].get(key)
                ratios[f"agent_{key.removesuffix('_ms')}"] = mine / other if mine and other else None
            held = {side: f"{figs['agent']['sessions_held']} of {figs['agent']['sessions']}"
                    for side, figs in results.items() if figs["agent"].get("sessions") is not None}
        for key in ours:
            if key.startswith("decode_") and key in theirs and theirs[key]["output_tok_s"]:
                ratios[f"{key}_output_tok_s"] = ours[key]["output_tok_s"] / theirs[key]["output_tok_s"]
        targets = QUANTIZED_TARGETS if args.no_agent else TARGETS
        met = {k: r is not None and (r >= t if d == ">=" else r <= t) for k, (d, t) in targets.items()
               for r in [ratios.get(k)]}
        emit(figure="ratio_musegl_over_llamacpp", **{k: None if v is None else round(v, 3) for k, v in ratios.items()},
             targets={k: f"{d} {t}" for k, (d, t) in targets.items()}, met=met, sessions_held=held)
    errors = sum(f.get("errors", 0) for side in results.values() for f in side.values())
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
