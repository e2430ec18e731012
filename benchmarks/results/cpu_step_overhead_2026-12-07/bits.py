"""The bits a tree's torch-cpu executor gives on ``--model``: prefill of three prompts (one
chunked), then ``--steps`` decode steps of the three sequences together, with logits
(``want_logits``) and plain greedy, on ``--threads`` threads. Prints a sha256 of every logits
row and id, and the ids; two trees that print the same digest gave the same bits.

    PYTHONPATH=TREE:TREE/plugins/cuda python bits.py --model FILE [--steps 12] [--threads 2]
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.executor import TorchExecutor

    ex = TorchExecutor(load_checkpoint(args.model), device="cpu", block_size=16)
    ex.allocate_kv(48)
    g = torch.Generator().manual_seed(1)
    tables = {s: list(range(16 * s, 16 * s + 16)) for s in range(3)}
    seqs = {s: torch.randint(0, ex.config.vocab_size, (40 + 23 * s,), generator=g).tolist() for s in range(3)}
    digest = hashlib.sha256()
    ids = []

    def eat(out):
        for s in sorted(out.tokens):
            ids.append(out.tokens[s][-1])
            digest.update(repr(out.tokens[s]).encode())
        for s in sorted(out.logits):
            digest.update(out.logits[s].float().contiguous().numpy().tobytes())

    # sequence 2's prompt in two chunks, the second beside the others' whole prompts
    eat(ex.step(Step([SeqChunk(seq=2, tokens=seqs[2][:30], positions=list(range(30)), blocks=tables[2])])))
    eat(ex.step(Step([SeqChunk(seq=s, tokens=seqs[s][30 if s == 2 else 0:],
                               positions=list(range(30 if s == 2 else 0, len(seqs[s]))), blocks=tables[s],
                               sample=True, want_logits=True) for s in range(3)])))
    for i in range(args.steps):
        want = i % 2 == 0
        out = ex.step(Step([SeqChunk(seq=s, tokens=[seqs[s][-1]], positions=[len(seqs[s])], blocks=tables[s],
                                     sample=True, want_logits=want) for s in range(3)]))
        eat(out)
        for s in range(3):
            seqs[s].append(out.tokens[s][-1])
    print(json.dumps({"model": args.model.name, "threads": args.threads, "sha256": digest.hexdigest(),
                      "ids": ids}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
