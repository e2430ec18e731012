"""Restore, not recompute: a long session's next first token from the host tier vs a re-prefill.

Writes the converter-written tiny model (``musegl_core.tiny.make_tiny``, preset ``tiny``) and
runs two engines on the CPU (the torch executor, in this process), each with a device pool
that holds one ``--tokens`` session and a little more:

* **host**: ``--kv-offload-memory`` large enough for two such sessions;
* **recompute**: no host tier (``--kv-offload-memory 0``), ``--evict-idle-sessions``.

On each, named session ``a`` runs a ``--tokens`` prompt (one generated token), then session
``b`` runs another ``--tokens`` prompt, which pushes ``a`` off the device (host: into the
host tier; recompute: evicted, its blocks reused). Then ``a``'s next turn (its history plus
``--turn`` new tokens) is timed from submission to its first token: the host engine restores
``a``'s blocks and computes only the new tokens, the other re-prefills everything. Prints one
JSON line per engine and the ratio (host / recompute), all measured in the same run.

    python benchmarks/kv_restore.py --tokens 32768
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.tiny import make_tiny
from musegl_core.tokenizer import MuseTokenizer
from musegl_cuda.executor import TorchExecutor

BLOCK = 16


def timed_engine(model: Path, tokens: int, host: int):
    executor = TorchExecutor(load_checkpoint(str(model)), device="cpu", dtype="float32", block_size=BLOCK)
    blocks = -(-(tokens + 64) // BLOCK) + 8  # one session and its next turn, a little more
    stamps: dict[str, float] = {}
    done: dict[str, ev.Done] = {}

    def emit(event) -> None:
        if isinstance(event, ev.Started):
            stamps[event.id] = time.perf_counter()
        elif isinstance(event, ev.Done):
            done[event.id] = event
        elif isinstance(event, ev.Failed):
            raise RuntimeError(f"{event.id} failed: {event.error}")

    config = EngineConfig(max_context=tokens + 256, max_sessions=4, max_inflight_requests=1, kv_blocks=blocks,
                          kv_offload_memory=host, evict_idle_sessions=True, max_prefill_chunk=2048,
                          solo_prefill_chunk=2048)
    engine = Engine(executor, MuseTokenizer.load(str(model)), config, emit)
    return engine, executor, stamps, done


def scenario(engine: Engine, stamps: dict, done: dict, tokens: int, turn: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = engine.executor.info.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, min(vocab, 60000)) for _ in range(n)]

    def run(rid: str, session: str, ids: list[int]) -> tuple[float, ev.Done]:
        started = time.perf_counter()
        engine.submit(PreparedRequest(id=rid, prompt_ids=tuple(ids), max_tokens=1, ignore_eos=True,
                                      sampling=GREEDY, session_id=session, stream=True))
        engine.run_until_idle()
        return stamps[rid] - started, done[rid]

    history = prompt(tokens)
    first, a1 = run("a1", "a", history)
    run("b1", "b", prompt(tokens))
    history = history + list(a1.generated_ids) + prompt(turn)
    ttft, a2 = run("a2", "a", history)
    stats = engine.stats()
    return {"first_prefill_s": round(first, 4), "next_turn_ttft_s": round(ttft, 5), "prompt": len(history),
            "cached_tokens": a2.cached_tokens, "restores": stats.get("kv_restores", 0),
            "restore_seconds": round(stats.get("kv_restore_seconds", 0.0), 5),
            "host_hit_tokens": stats.get("kv_tier_hit_tokens_host", 0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768, help="the session's history in tokens")
    p.add_argument("--turn", type=int, default=32, help="new tokens of its next turn")
    p.add_argument("--repeats", type=int, default=1, help="scenarios per engine (fresh sessions each)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kv-restore-") as tmp:
        model = make_tiny(Path(tmp), preset="tiny", seed=0)
        figures = {}
        for label in ("host", "recompute"):
            probe = TorchExecutor(load_checkpoint(str(model)), device="cpu", dtype="float32", block_size=BLOCK)
            host = 0 if label == "recompute" else 3 * (-(-(args.tokens + 64) // BLOCK)) * probe.kv_bytes_per_block()
            del probe
            engine, executor, stamps, done = timed_engine(model, args.tokens, host)
            runs = []
            for r in range(args.repeats):
                runs.append(scenario(engine, stamps, done, args.tokens, args.turn, seed=r))
                for name in ("a", "b"):
                    if name in engine.sessions.named:
                        engine.sessions.close(name)
            figure = {"engine": label, "kv_offload_memory": host, "tokens": args.tokens, "turn": args.turn,
                      "runs": runs}
            print(json.dumps(figure), flush=True)
            figures[label] = figure
            executor.close()
    host_ttft = min(r["next_turn_ttft_s"] for r in figures["host"]["runs"])
    recompute_ttft = min(r["next_turn_ttft_s"] for r in figures["recompute"]["runs"])
    print(json.dumps({"restore_ttft_s": host_ttft, "reprefill_ttft_s": recompute_ttft,
                      "ratio": round(host_ttft / recompute_ttft, 4), "target": "<= 0.1"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
