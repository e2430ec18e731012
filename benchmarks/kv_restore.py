"""Restore, not recompute: a long session's next first token from the host tier vs a re-prefill.

Runs two engines one after the other (the torch executor, in this process), each with a device
pool that holds one ``--tokens`` session and a little more:

* **host**: ``--kv-offload-memory`` large enough for three such sessions (``--pushers`` + 2 with
  more pushers; pinned memory on CUDA, the copies on a side stream:
  ``plugins/cuda/musegl_cuda/host_kv.py``);
* **recompute**: no host tier (``--kv-offload-memory 0``), ``--evict-idle-sessions``.

On each, named session ``a`` runs a ``--tokens`` prompt (one generated token), then session
``b`` runs another ``--tokens`` prompt (``--pushers N``: N sessions, one after the other),
which pushes ``a`` off the device (host: into the host tier; recompute: evicted, its blocks
reused). Then ``a``'s next turn (its history plus
``--turn`` new tokens) is timed from submission to its first token: the host engine restores
``a``'s blocks and computes only the new tokens, the other re-prefills everything. Prints one
JSON line per engine and the ratio (host / recompute), all measured in the same run (``--out``:
the same lines appended to a JSON-lines file).

The model:

* ``--device cpu`` (default): the converter-written tiny model (``musegl_core.tiny.make_tiny``,
  preset ``tiny``), float32, blocks of 16, prefill chunks of 2,048;
* ``--device cuda``: a Muse Glimmer shape with dummy weights made on the device (seeded), as
  ``benchmarks/gpu_decode.py`` builds it: transformers' ``MuseGlimmerTextConfig()`` (the 30B
  shape; ``--config`` another), ``--layers N`` keeping the first N layers, bf16 weights
  (``--weights-kind``: random matrices as stored, e.g. fp8), the executor's default block size
  and prefill chunks (the engine's, as ``musegl serve`` runs them), no decode graphs (the turns
  generate one token). ``--kv-cache-dtype fp8`` and ``--sliding-window-kv`` as the server's
  flags. ``--tiny`` takes gpu_decode's 4-layer hidden-64 shape instead (a smoke run on either
  device: ``--device cpu --tiny``).

    python benchmarks/kv_restore.py --tokens 32768
    python benchmarks/kv_restore.py --device cuda --layers 26 --tokens 130816 --out kv_restore.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "cuda"), str(ROOT / "benchmarks")]

from musegl_core.checkpoint.loader import load_checkpoint  # noqa: E402
from musegl_core.engine import events as ev  # noqa: E402
from musegl_core.engine.engine import Engine, EngineConfig  # noqa: E402
from musegl_core.engine.executor import GREEDY  # noqa: E402
from musegl_core.engine.request import PreparedRequest  # noqa: E402
from musegl_core.tiny import demo_tokenizer_for, make_tiny  # noqa: E402
from musegl_core.tokenizer import MuseTokenizer  # noqa: E402
from musegl_cuda.executor import TorchExecutor  # noqa: E402

#: the tiny model's block size on the CPU (the CUDA runs take the executor's default)
CPU_BLOCK = 16
#: positions past the history a session's next turn takes (its generated token, ``--turn`` new ones)
TURN_MARGIN = 64
OUT: list[str] = []


def emit(fields: dict) -> None:
    line = json.dumps(fields)
    print(line, flush=True)
    for path in OUT:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


class Model:
    """What both engines of a run load: the checkpoint (or the config of dummy weights), the
    tokenizer, and how to build the executor."""

    def __init__(self, args, folder: Path) -> None:
        self.args = args
        self.cuda = args.device.startswith("cuda")
        if not self.cuda and not args.tiny and not args.config and not args.layers:
            self.path = make_tiny(folder, preset="tiny", seed=0)  # the converter-written model, on disk
            self.tokenizer = MuseTokenizer.load(str(self.path))
            self.checkpoint = None
            self.name = "tiny (make_tiny)"
            return
        from gpu_decode import raw_text_config, text_config  # the 30B shape at --layers, as gpu_decode builds it

        raw = raw_text_config(args)
        (folder / "config.json").write_text(json.dumps(raw))  # a bare config.json: the demo tokenizer
        self.path = folder
        self.tokenizer = demo_tokenizer_for(folder)
        self.checkpoint = text_config(args)
        self.name = self.checkpoint.name

    def executor(self) -> TorchExecutor:
        args = self.args
        if self.checkpoint is None:
            return TorchExecutor(load_checkpoint(str(self.path)), device="cpu", dtype="float32",
                                 block_size=CPU_BLOCK, kv_cache_dtype=args.kv_cache_dtype)
        more = {"block_size": args.block_size} if args.block_size else {}
        return TorchExecutor(self.checkpoint, device=args.device, dtype="bfloat16" if self.cuda else "float32",
                             dummy_seed=0, dummy_kind=args.weights_kind if self.cuda else None,
                             forward_sizes=(), kv_cache_dtype=args.kv_cache_dtype, **more)

    def prefill_chunks(self) -> dict:
        """The tiny model's CPU runs keep their 2,048-row chunks; otherwise the executor's."""
        if self.checkpoint is None:
            return {"max_prefill_chunk": 2048, "solo_prefill_chunk": 2048}
        return {}


def timed_engine(model: Model, tokens: int, label: str, pushers: int = 1):
    executor = model.executor()
    bs = executor.block_size
    session_blocks = -(-(tokens + TURN_MARGIN) // bs)
    # the host tier: every session that may go down (a and the pushers but the last), a little more
    host = 0 if label == "recompute" else max(3, pushers + 2) * session_blocks * executor.kv_bytes_per_block()
    blocks = session_blocks + 8  # one session and its next turn, a little more
    stamps: dict[str, float] = {}
    done: dict[str, ev.Done] = {}

    def emit_event(event) -> None:
        if isinstance(event, ev.Started):
            stamps[event.id] = time.perf_counter()
        elif isinstance(event, ev.Done):
            done[event.id] = event
        elif isinstance(event, ev.Failed):
            raise RuntimeError(f"{event.id} failed: {event.error}")

    config = EngineConfig(max_context=min(tokens + 256, executor.info.native_context),
                          max_sessions=pushers + 3,
                          max_inflight_requests=1, kv_blocks=blocks, kv_offload_memory=host,
                          evict_idle_sessions=True, sliding_window_kv=model.args.sliding_window_kv,
                          **model.prefill_chunks())
    started = time.perf_counter()
    engine = Engine(executor, model.tokenizer, config, emit_event)
    setup = {"engine_start_s": round(time.perf_counter() - started, 2), "kv_blocks": blocks, "block_size": bs,
             "kv_bytes_per_block": executor.kv_bytes_per_block(), "kv_offload_memory": host,
             "host_pinned": bool(getattr(getattr(executor, "host_pages", None), "host", None) is not None
                                 and executor.host_pages.host.is_pinned())}
    return engine, executor, stamps, done, setup


def scenario(engine: Engine, stamps: dict, done: dict, tokens: int, turn: int, seed: int, pushers: int = 1) -> dict:
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
    others = [run(f"{name}1", name, prompt(tokens))[0] for name in pusher_names(pushers)]
    history = history + list(a1.generated_ids) + prompt(turn)
    before = engine.stats()
    ttft, a2 = run("a2", "a", history)
    stats = engine.stats()

    def delta(key: str, digits: int | None = None):
        value = stats.get(key, 0) - before.get(key, 0)
        return round(value, digits) if digits is not None else value

    return {"first_prefill_s": round(first, 4), "pusher_prefill_s": [round(t, 4) for t in others],
            "next_turn_ttft_s": round(ttft, 5), "prompt": len(history), "cached_tokens": a2.cached_tokens,
            "restores": delta("kv_restores"), "restore_seconds": delta("kv_restore_seconds", 5),
            "restored_blocks": delta("kv_host_restored_blocks"), "host_hit_tokens": delta("kv_tier_hit_tokens_host"),
            "first_token": list(a2.generated_ids)[:1]}


def pusher_names(count: int) -> list[str]:
    """The sessions that push ``a`` off the device: ``b``, then ``b2``, ``b3``..."""
    return ["b"] + [f"b{i}" for i in range(2, count + 1)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768, help="the session's history in tokens")
    p.add_argument("--turn", type=int, default=32, help="new tokens of its next turn")
    p.add_argument("--repeats", type=int, default=1, help="scenarios per engine (fresh sessions each)")
    p.add_argument("--device", default="cpu", help="cpu (default; the tiny model) or cuda (dummy weights)")
    p.add_argument("--config", default=None, help="a Hugging Face directory or config.json (default: "
                   "MuseGlimmerTextConfig(), the 30B shape; with --device cuda, --layers or --tiny)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (reduced depth)")
    p.add_argument("--tiny", action="store_true", help="gpu_decode's 4-layer hidden-64 shape, dummy weights")
    p.add_argument("--weights-kind", default=None, help="CUDA: random matrices as stored instead of bf16 "
                   "(fp8, a GGUF type, q4_k_m; gpu_decode.py --weights-kind)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--sliding-window-kv", action="store_true", help="sliding layers keep only their window")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: the executor's; "
                   "the tiny model on the CPU: 16)")
    p.add_argument("--pushers", type=int, default=1, help="sessions of --tokens run after a's first turn "
                   "(default 1: the pool holds one session; with --sliding-window-kv a session holds its full "
                   "layers' pages and only the window of the sliding ones, so more sessions fit: e.g. 4 for the "
                   "30B shape, whose 39 sliding layers of 52 leave a session a quarter of its block pages)")
    p.add_argument("--engines", default="host,recompute", help="which engines run, in this order")
    p.add_argument("--out", default=None, help="also append every JSON line to this file")
    args = p.parse_args()
    if args.out:
        OUT.append(args.out)
    cuda = args.device.startswith("cuda")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            print("kv_restore.py: no CUDA GPU (use --device cpu)", file=sys.stderr)
            return 2
    labels = [x for x in args.engines.split(",") if x]
    if not labels or set(labels) - {"host", "recompute"}:
        p.error("--engines takes host and/or recompute")
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kv-restore-") as tmp:
        model = Model(args, Path(tmp))
        native = model.checkpoint.config.max_position_embeddings if model.checkpoint is not None else None
        if native is not None and args.tokens + args.turn + 2 > native:
            p.error(f"--tokens {args.tokens} + --turn {args.turn} pass the model's {native} positions "
                    f"(at most {native - args.turn - 2})")
        device = "cpu"
        if cuda:
            import torch

            device = torch.cuda.get_device_name()
        emit({"figure": "setup", "device": device, "model": model.name, "tokens": args.tokens, "turn": args.turn,
              "kv_cache_dtype": args.kv_cache_dtype, "sliding_window_kv": args.sliding_window_kv,
              "weights_kind": args.weights_kind if cuda else None, "engines": labels})
        for label in labels:
            engine, executor, stamps, done, setup = timed_engine(model, args.tokens, label, args.pushers)
            runs = []
            for r in range(args.repeats):
                runs.append(scenario(engine, stamps, done, args.tokens, args.turn, seed=r, pushers=args.pushers))
                for name in ["a", *pusher_names(args.pushers)]:
                    if name in engine.sessions.named:
                        engine.sessions.close(name)
            figure = {"figure": "engine", "engine": label, **setup, "tokens": args.tokens, "turn": args.turn,
                      "runs": runs}
            figures[label] = figure
            executor.close()
            del engine, executor
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            emit(figure)
    if {"host", "recompute"} <= set(figures):
        host_ttft = min(r["next_turn_ttft_s"] for r in figures["host"]["runs"])
        recompute_ttft = min(r["next_turn_ttft_s"] for r in figures["recompute"]["runs"])
        emit({"figure": "ratio", "restore_ttft_s": host_ttft, "reprefill_ttft_s": recompute_ttft,
              "ratio": round(host_ttft / recompute_ttft, 4), "target": "<= 0.1",
              "restored_all": all(r["cached_tokens"] >= args.tokens for r in figures["host"]["runs"]),
              # greedy: the restored session's first token is the re-prefilled one's
              "same_first_token": all(h["first_token"] == r["first_token"]
                                      for h, r in zip(figures["host"]["runs"], figures["recompute"]["runs"]))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
