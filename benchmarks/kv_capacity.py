"""KV capacity: how many named sessions a CPU server holds warm in one fixed KV budget.

Writes the converter-written tiny model with a sliding window of 8 (4 layers, 3 of
them sliding; ``musegl_core.tiny.make_tiny``), then, for each server checkout given
(``--checkout LABEL=PYTHON``: the interpreter of a checkout's virtualenv, so a
baseline such as ``/work/main/.venv/bin/python`` runs in the same run) and each
``--max-context`` factor, starts ``musegl serve`` on the CPU with one fixed
``--kv-cache-memory`` and ``--evict-idle-sessions``, and:

1. opens ``--sessions`` named sessions one after another, each with one chat turn
   whose history (chat template included) is about ``--windows`` × window tokens;
2. probes every session, newest first, with its history again (``max_tokens`` 1)
   and counts it **warm** when ``cached_tokens`` covers at least 95 % of the first
   turn's prompt (its next turn would start from its cache).

``--max-sessions`` is as many as the checkout lets that memory promise: a server
that reserves ``--max-context`` per session refuses more at start-up and its
one-line refusal says how many fit (the script reads it); one with blocks on
demand takes ``--sessions``. Prints one JSON line per run and, at the end, the
warm counts against the first checkout's.

    python benchmarks/kv_capacity.py --checkout main=/work/main/.venv/bin/python \\
        --checkout branch=.venv/bin/python --kv-cache-memory 2MiB --sessions 60 --factors 1.25,10

``--flags`` (default ``--sliding-window-kv``) go to every checkout but the first,
``--baseline-flags`` to the first. The host tier (``--kv-offload-memory``) is measured
with one checkout twice, the baseline without it:

    python benchmarks/kv_capacity.py --checkout nohost=.venv/bin/python --checkout host=.venv/bin/python \
        --baseline-flags "--sliding-window-kv --kv-offload-memory 0" \
        --flags "--sliding-window-kv --kv-offload-memory 64MiB" --kv-cache-memory 4MiB --sessions 70
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import httpx

from common import free_port, server_process
from musegl_core.tiny import PRESETS, make_tiny
from musegl_core.tokenizer import MuseTokenizer

WINDOW = 8


def write_model(outdir: Path) -> Path:
    preset = attrs.evolve(PRESETS["tiny"], name="window8", sliding_window=WINDOW)
    return make_tiny(outdir, preset=preset, seed=0)


def sessions_that_fit(python: str, model: Path, flags: list[str]) -> int | None:
    """The sessions a checkout that reserves --max-context per session accepts: what its start-up
    refusal of --max-sessions 100000 says fits; None when it starts (blocks on demand)."""
    command = [python, "-m", "musegl_core.cli.main", "serve", str(model), "--max-sessions", "100000", *flags,
               "--port", str(free_port())]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired:
        return None  # it started: nothing refused the sessions
    found = re.search(r"(\d+) sessions of \d+ tokens", done.stderr + done.stdout)
    if found is None:
        if done.returncode == 0:
            return None
        raise RuntimeError(f"could not read what fits: {done.stderr.strip()[-400:]}")
    return int(found.group(1))


def words(rng: random.Random, tokens: int, tokenizer) -> str:
    """Random words that the model's tokenizer encodes in about ``tokens`` ids."""
    vocabulary = ["amber", "river", "stone", "window", "cloud", "paper", "signal", "garden", "copper", "lantern",
                  "orbit", "meadow", "harbor", "thread", "violet", "canyon", "ember", "glacier", "pillow", "quartz"]
    text = []
    while len(tokenizer.encode(" ".join(text), special=False)) < tokens:
        text.append(rng.choice(vocabulary))
    return " ".join(text[:-1])


def run(label: str, python: str, model: Path, args, factor: float, extra: list[str]) -> dict:
    history = args.windows * WINDOW
    max_context = int(history * factor)
    flags = ["--kv-cache-memory", args.kv_cache_memory, "--max-context", str(max_context), "--evict-idle-sessions",
             "--max-inflight-requests", "1", "--device", "cpu", *(["--no-prefix-caching"] if args.no_prefix_caching
                                                                  else []), *extra]
    fit = sessions_that_fit(python, model, flags)
    max_sessions = fit if fit is not None else args.sessions
    if max_sessions == 0:  # the checkout refuses to start: not one session of --max-context fits
        figure = {"label": label, "flags": extra, "prefix_caching": not args.no_prefix_caching, "python": python,
                  "max_context": max_context, "kv_cache_memory": args.kv_cache_memory, "max_sessions": 0,
                  "sessions": args.sessions, "warm": 0, "refused": "no session of --max-context fits"}
        print(json.dumps(figure), flush=True)
        return figure
    port = free_port()
    command = [python, "-m", "musegl_core.cli.main", "serve", str(model), "--port", str(port),
               "--max-sessions", str(max_sessions), *flags]
    rng = random.Random(0)
    tokenizer = MuseTokenizer.load(str(model))
    histories = []
    with server_process(command, port, name=f"kv-capacity-{label}") as (url, _process):
        with httpx.Client(base_url=url, timeout=120) as http:
            def chat(session: str, messages: list, max_tokens: int) -> dict:
                r = http.post("/v1/chat/completions", json={
                    "model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "session_id": session})
                if r.status_code != 200:
                    raise RuntimeError(f"{label}: HTTP {r.status_code}: {r.text[:300]}")
                return r.json()["usage"]

            for i in range(args.sessions):
                messages = [{"role": "user", "content": words(rng, history - 100, tokenizer)}]
                usage = chat(f"s{i}", messages, 4)
                histories.append((f"s{i}", messages, usage["prompt_tokens"]))
            warm = 0
            for name, messages, prompt in reversed(histories):
                usage = chat(name, messages, 1)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                warm += cached >= 0.95 * prompt
    figure = {"label": label, "flags": extra, "prefix_caching": not args.no_prefix_caching, "python": python,
              "max_context": max_context, "history_tokens": histories[0][2],
              "kv_cache_memory": args.kv_cache_memory, "max_sessions": max_sessions, "sessions": args.sessions,
              "warm": warm}
    print(json.dumps(figure), flush=True)
    return figure


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", action="append", required=True, help="LABEL=PYTHON (the first is the baseline)")
    p.add_argument("--kv-cache-memory", default="4MiB")
    p.add_argument("--sessions", type=int, default=120)
    p.add_argument("--windows", type=int, default=40, help="history length in windows (of 8 tokens)")
    p.add_argument("--factors", default="1.25,10", help="--max-context as multiples of the history")
    p.add_argument("--flags", default="--sliding-window-kv", help="serve flags of every checkout but the baseline")
    p.add_argument("--baseline-flags", default="", help="serve flags of the baseline (the first checkout)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="serve with --no-prefix-caching: only resident sessions count, not their cached blocks")
    args = p.parse_args()
    checkouts = [tuple(c.split("=", 1)) for c in args.checkout]
    with tempfile.TemporaryDirectory(prefix="kv-capacity-") as tmp:
        model = write_model(Path(tmp))
        figures = [run(label, python, model, args, float(f), args.baseline_flags.split() if i == 0 else args.flags.split())
                   for f in args.factors.split(",") for i, (label, python) in enumerate(checkouts)]
    base = {f["max_context"]: f["warm"] for f in figures if f["label"] == checkouts[0][0]}
    for f in figures:
        if f["label"] != checkouts[0][0]:
            ratio = f["warm"] / base[f["max_context"]] if base[f["max_context"]] else float("inf")
            print(json.dumps({"label": f["label"], "max_context": f["max_context"], "warm": f["warm"],
                              "baseline_warm": base[f["max_context"]], "ratio": round(ratio, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
