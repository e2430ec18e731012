"""Load-test a running server: N concurrent clients, chat or agent workload."""

from __future__ import annotations

import json
import sys

from musegl_core.cli.main import OneLineParser
from musegl_core.errors import ConfigError

EPILOG = """\
workloads:
  chat   --requests independent prompts of about --prompt-tokens tokens
  agent  --conversations conversations of --turns turns in named sessions; each
         turn adds the reply and a new user message of about --prompt-tokens
         tokens, then the last turn's history is replayed without a session;
         the run deletes its sessions when its turns end (and when interrupted).
         --shared-system-tokens N opens every conversation with the same system
         prompt of about N tokens (a coding agent's rules and project notes) and
         --tools sends ten tool definitions each turn; a reply's tool calls are
         answered with a tool result before the next user message.
         --context-tokens N opens each conversation with a context of its own
         of about N tokens (files read, an earlier history); --subagents K adds K
         conversations spawned by the others at their turn 2 (--subagent-turns,
         --subagent-context-tokens), each in its own session beside its parent;
         --interleave keeps every conversation open at once, -c bounding the
         requests in flight. The report adds warm-turn TTFT (turns after the
         first) and the sessions held (every warm turn >= 95 % cached)

apis (--api):
  chat       Chat Completions, the workloads above (the default)
  messages   replay a --turns (default 10) agent conversation as Claude Code sends it:
             POST /v1/messages?beta=true, a system prompt of about --system-tokens
             tokens plus 10 tools, the billing block with a new cch= per request,
             X-Claude-Code-Session-Id, the whole history every turn
  responses  the same as Codex CLI sends it: POST /v1/responses, instructions,
             input items, store false, prompt_cache_key and session-id/thread-id
  Each turn is sent interleaved with the same conversation over Chat Completions
  (a named session); the report gives per-turn TTFT and cached share, later-turn
  TTFT over turn 1, and the front overhead against Chat Completions.

Every request is greedy; with --api chat it generates exactly --max-tokens tokens
(ignore_eos; the Messages and Responses APIs have no such field).
A refused request is reported with the server's error code and message, which
names the limit that refused it (--max-sessions, --max-queued-requests, ...).
Start the server without prefix snapshots (--prefix-cache-entries 0, the
default) when comparing sessions with anonymous requests.
"""

#: What ``musegl bench`` says when its HTTP client is not installed.
INSTALL_HINT = ("musegl bench needs httpx, which the bench extra installs: "
                "pip install 'musegl[bench]' (or pip install httpx)")


def main(argv: list[str]) -> int:
    import argparse

    p = OneLineParser(prog="musegl bench", description=__doc__, epilog=EPILOG,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)")
    p.add_argument("--workload", default=None, choices=["chat", "agent"],
                   help="default chat (agent with --api messages|responses)")
    p.add_argument("--api", default="chat", choices=["chat", "messages", "responses"],
                   help="the API to drive (default chat; see below)")
    p.add_argument("--system-tokens", type=int, default=12000,
                   help="--api messages|responses: approximate tokens of the system prompt (default 12000)")
    p.add_argument("--shared-system-tokens", type=int, default=0,
                   help="agent over chat: a system prompt of about N tokens shared by every conversation "
                        "(default 0: one line)")
    p.add_argument("--tools", action="store_true",
                   help="agent over chat: send a coding agent's ten tool definitions with every turn")
    p.add_argument("--context-tokens", type=int, default=0,
                   help="agent over chat: each conversation's own context of about N tokens ahead of its first "
                        "message (default 0)")
    p.add_argument("--subagents", type=int, default=0,
                   help="agent over chat: subagent conversations spawned at their parents' turn 2 (default 0)")
    p.add_argument("--subagent-turns", type=int, default=3, help="agent: turns of a subagent (default 3)")
    p.add_argument("--subagent-context-tokens", type=int, default=0,
                   help="agent: a subagent's own context in tokens (default 0)")
    p.add_argument("--interleave", action="store_true",
                   help="agent: every conversation open at once, --concurrency bounding the requests in flight")
    p.add_argument("--concurrency", "-c", type=int, default=1, help="concurrent clients (default 1)")
    p.add_argument("--requests", "-n", type=int, default=16, help="chat: number of requests (default 16)")
    p.add_argument("--conversations", type=int, default=None, help="agent: conversations (default: --concurrency)")
    p.add_argument("--turns", type=int, default=None,
                   help="agent: turns per conversation (default 5; 10 with --api messages|responses)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="agent: skip the anonymous replay of the last turn")
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=256,
                   help="approximate tokens per prompt / per agent user turn (default 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the filler text (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument("--api-key", default=None, help="bearer token (env MUSEGL_API_KEY)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="devices the server's model spans (its --tensor-parallel-size): the report adds the "
                        "output tokens/s per device, to compare tensor parallelism with replicas (default 1)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    args = p.parse_args(argv)
    try:
        from musegl_core.bench.report import render
        from musegl_core.bench.runner import BenchConfig, BenchError, run_bench
    except ImportError as exc:
        if exc.name != "httpx":
            raise
        raise ConfigError(INSTALL_HINT) from None
    from rich.console import Console

    replay = args.api != "chat"
    if replay and args.workload == "chat":
        raise ConfigError(f"--api {args.api} replays an agent conversation: use --workload agent (or leave it out)")
    args.workload = args.workload or ("agent" if replay else "chat")
    args.turns = args.turns if args.turns is not None else (10 if replay else 5)
    if args.timeout <= 0:
        raise ConfigError("--timeout must be positive")
    if args.api_key is None:
        import os

        args.api_key = os.environ.get("MUSEGL_API_KEY") or None
    try:
        config = BenchConfig(
            url=args.url, workload=args.workload, concurrency=args.concurrency, requests=args.requests,
            conversations=args.conversations, turns=args.turns, max_tokens=args.max_tokens,
            prompt_tokens=args.prompt_tokens, seed=args.seed, timeout=args.timeout, api_key=args.api_key,
            baseline=args.baseline, api=args.api, system_tokens=args.system_tokens,
            shared_system_tokens=args.shared_system_tokens, tools=args.tools,
            tensor_parallel_size=args.tensor_parallel_size, context_tokens=args.context_tokens,
            subagents=args.subagents, subagent_turns=args.subagent_turns,
            subagent_context_tokens=args.subagent_context_tokens, interleave=args.interleave,
        )
    except ValueError as exc:
        raise ConfigError(str(exc).replace("_", "-")) from None
    if config.conversations is not None and config.conversations < 1:
        raise ConfigError("--conversations must be at least 1")
    try:
        report = run_bench(config, progress=args.progress)
    except BenchError as exc:
        print(f"musegl bench: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render(report, Console())
    return 1 if report.errors else 0
