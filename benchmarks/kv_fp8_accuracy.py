"""FP8 KV (``--kv-cache-dtype fp8``) against bf16 KV: top-1 agreement and logit error at 8k+
positions, on the CPU reference path (issue 45 item 4).

The torch executor runs on the CPU in bfloat16 (activations and weights, K/V in bf16 with
``auto``: what the cuda executor computes) with ``auto`` and with ``fp8``; the figures of
``fp8`` are against ``auto`` there. For context the same is measured in float32, and bf16
``auto`` against float32 ``auto`` (the activation dtype's own distance from exact).

For each seed a random checkpoint (``musegl_core.tiny.make_tiny``, float32 matrices, rounded
to the activation dtype at load) gets a random prompt of
``--positions`` tokens, as the parity tests draw theirs (uniform ids, seeded). Both executors
prefill it in 512-row chunks; then the next ``--scored`` tokens of the same random stream are
fed in one chunk with every row's logits (teacher forcing: both runs see the same tokens) and
compared row by row; then each run decodes ``--greedy`` tokens greedily on its own and the
shared prefix of the two continuations is counted.

    python benchmarks/kv_fp8_accuracy.py --preset small --positions 8192 --seeds 0 1 \\
        --out benchmarks/results/kv_fp8_accuracy_2026-12-07

Prints one JSON line per (preset, seed) and writes them to ``--out``/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_core.tiny import PRESETS, TinyPreset, make_tiny
from musegl_cuda.executor import TorchExecutor

BLOCK = 16
CHUNK = 512
#: The 30B's attention shape scaled down: head_dim 128 and 2 KV heads as in the 30B, one full
#: layer in four (the released layout), a 256-position window.
SMALL = TinyPreset(name="small", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=128,
                   intermediate_size=1536, sliding_window=256)
PRESET_CHOICES = {**PRESETS, "small": SMALL}


def run(path: Path, dtype: str, kv: str, ids: list[int], scored: int,
        greedy: int) -> tuple[torch.Tensor, list[int], float]:
    """``(logits of the scored rows, greedy continuation, seconds)`` of one executor."""
    started = time.perf_counter()
    total = len(ids) + greedy
    ex = TorchExecutor(load_checkpoint(path), device="cpu", dtype=dtype, block_size=BLOCK, weights="upcast",
                       kv_cache_dtype=kv)
    blocks = list(range(-(-total // BLOCK)))
    ex.allocate_kv(len(blocks))
    prefill = len(ids) - scored
    for start in range(0, prefill, CHUNK):
        part = ids[start:min(prefill, start + CHUNK)]
        ex.step(Step([SeqChunk(seq=1, tokens=part, positions=list(range(start, start + len(part))),
                               blocks=blocks)]))
    out = ex.step(Step([SeqChunk(seq=1, tokens=ids[prefill:], positions=list(range(prefill, len(ids))),
                                 blocks=blocks, sample=True, logit_rows=True)]))
    logits = torch.as_tensor(out.logits[1]).float().clone()
    tokens = [out.tokens[1][-1]]
    while len(tokens) < greedy:
        pos = len(ids) + len(tokens) - 1
        out = ex.step(Step([SeqChunk(seq=1, tokens=[tokens[-1]], positions=[pos], blocks=blocks, sample=True)]))
        tokens.append(out.tokens[1][-1])
    ex.close()
    return logits, tokens, time.perf_counter() - started


def compare(ref: torch.Tensor, fp8: torch.Tensor, ref_tokens: list[int], fp8_tokens: list[int]) -> dict:
    """The figures of one pair of runs (rows: scored positions)."""
    diff = (fp8 - ref).abs()
    top1 = (fp8.argmax(-1) == ref.argmax(-1)).float()
    rel = (fp8 - ref).norm(dim=-1) / ref.norm(dim=-1)
    spread = ref.std(dim=-1)
    shared = next((i for i, (a, b) in enumerate(zip(ref_tokens, fp8_tokens)) if a != b), len(ref_tokens))
    return {
        "top1_agreement": round(float(top1.mean()), 4),
        "max_abs_logit_error": float(diff.max()),
        "mean_abs_logit_error": float(diff.mean()),
        "mean_relative_l2": float(rel.mean()),
        "max_error_over_logit_std": float((diff.amax(-1) / spread).max()),
        "logit_std": float(spread.mean()),
        "greedy_shared_prefix": shared,
        "greedy_tokens": len(ref_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESET_CHOICES), default="small")
    parser.add_argument("--positions", type=int, default=8192, help="prompt positions before the scored rows")
    parser.add_argument("--scored", type=int, default=256, help="teacher-forced rows compared after them")
    parser.add_argument("--greedy", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"),
                        help="activation dtypes run with auto and fp8 KV (the first is the headline)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    preset = PRESET_CHOICES[args.preset]
    lines = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            path = make_tiny(tmp, preset=preset, seed=seed, file_type="f32")
            ids = torch.randint(0, preset.vocab_size, (args.positions + args.scored,),
                                generator=torch.Generator().manual_seed(seed)).tolist()
            runs = {(dtype, kv): run(path, dtype, kv, ids, args.scored, args.greedy)
                    for dtype in args.dtypes for kv in ("auto", "fp8")}
        pairs = [(f"fp8_vs_auto_{d}", (d, "fp8"), (d, "auto")) for d in args.dtypes]
        if {"bfloat16", "float32"} <= set(args.dtypes):
            pairs.append(("bf16_auto_vs_float32_auto", ("bfloat16", "auto"), ("float32", "auto")))
        for name, test, ref in pairs:
            line = {"preset": preset.name, "seed": seed, "positions": args.positions, "scored": args.scored,
                    "comparison": name, **compare(runs[ref][0], runs[test][0], runs[ref][1], runs[test][1]),
                    "seconds": {f"{d}/{k}": round(r[2], 1) for (d, k), r in runs.items()}}
            print(json.dumps(line), flush=True)
            lines.append(line)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "results.jsonl", "a", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
