"""Greedy top-1 agreement of stored weight formats with float32 (issue 17), musegl and llama.cpp.

For a random checkpoint written in every file type by ``make_tiny`` (same seed: the same
float32 weights, rounded or quantized by the writer), the float32 file gives 64 greedy
tokens after a random prompt. Each other file is then fed exactly those tokens
(teacher forcing) and scores the share of positions where its top-1 token equals the
float32 one. musegl runs the torch-cpu executor with ``--weights stored`` (the kernels
that read f16/bf16/Q8_0 directly). With ``--llama-server`` the same files are served by
llama.cpp and scored the same way against musegl's float32 tokens (one ``/completion``
call per position, ``n_predict`` 1, greedy; the prompt cache keeps it incremental), so
the figure of the format can be told apart from the figure of an implementation.
``musegl-same-file`` scores the other reading of "agreement with float32": each file run
with its stored-form kernels against the same file decoded to float32 at load
(``--weights upcast``), i.e. the kernels' own error without the format's.

    python benchmarks/quant_agreement.py --preset tiny --seeds 0 1 2
    python benchmarks/quant_agreement.py --preset bench --seeds 0 --llama-server /path/to/llama-server

Prints one JSON line per (preset, seed, prompt, engine, file type) and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_core.tiny import PRESETS, make_tiny
from musegl_cuda.executor import TorchExecutor

BLOCK = 16
FILE_TYPES = ("f16", "bf16", "q8_0")


def open_executor(path: Path, tokens: int, weights: str = "stored") -> TorchExecutor:
    ex = TorchExecutor(load_checkpoint(path), device="cpu", block_size=BLOCK, weights=weights)
    ex.allocate_kv(-(-tokens // BLOCK) + 1)
    return ex


def greedy(ex: TorchExecutor, ids: list[int], n: int) -> list[int]:
    blocks = list(range(-(-(len(ids) + n) // BLOCK)))
    out = ex.step(Step([SeqChunk(seq=1, tokens=ids, positions=list(range(len(ids))), blocks=blocks, sample=True)]))
    tokens = [out.tokens[1][-1]]
    while len(tokens) < n:
        out = ex.step(Step([SeqChunk(seq=1, tokens=[tokens[-1]], positions=[len(ids) + len(tokens) - 1],
                                     blocks=blocks, sample=True)]))
        tokens.append(out.tokens[1][-1])
    return tokens


def forced_picks(ex: TorchExecutor, ids: list[int], follow: list[int]) -> list[int]:
    """Top-1 after the prompt, then after each of ``follow[:-1]`` fed one per decode step."""
    blocks = list(range(-(-(len(ids) + len(follow)) // BLOCK)))
    out = ex.step(Step([SeqChunk(seq=1, tokens=ids, positions=list(range(len(ids))), blocks=blocks,
                                 sample=True, want_logits=True)]))
    picks = [int(out.logits[1].argmax())]
    for i, token in enumerate(follow[:-1]):
        out = ex.step(Step([SeqChunk(seq=1, tokens=[token], positions=[len(ids) + i], blocks=blocks,
                                     sample=True, want_logits=True)]))
        picks.append(int(out.logits[1].argmax()))
    return picks


class LlamaServer:
    """llama.cpp's server on one file, one slot, greedy."""

    def __init__(self, binary: str, model: Path, threads: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [binary, "-m", str(model), "--port", str(self.port), "-np", "1", "-t", str(threads), "-c", "4096",
             "--no-warmup"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} on {model}")
            time.sleep(0.5)
        raise RuntimeError("llama-server did not become healthy in 300 s")

    def next_token(self, ids: list[int]) -> int:
        body = json.dumps({"prompt": ids, "n_predict": 1, "temperature": 0, "top_k": 1, "cache_prompt": True,
                           "return_tokens": True, "special": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return int(json.load(r)["tokens"][0])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def llama_picks(server: LlamaServer, ids: list[int], follow: list[int]) -> list[int]:
    return [server.next_token(ids + follow[:i]) for i in range(len(follow))]


def agreement(picks: list[int], reference: list[int]) -> float:
    return sum(p == r for p, r in zip(picks, reference)) / len(reference)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="checkpoint seeds")
    parser.add_argument("--prompts", type=int, default=2, help="random prompts per checkpoint")
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens scored per prompt")
    parser.add_argument("--file-types", nargs="+", default=list(FILE_TYPES), choices=FILE_TYPES)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="also score llama.cpp's server on the same files (default $LLAMA_SERVER)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", help="keep the checkpoints here (default: a temporary folder)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    vocab = PRESETS[args.preset].vocab_size
    scores: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        for seed in args.seeds:
            files = {ft: make_tiny(root / f"{args.preset}-{seed}-{ft}", preset=args.preset, seed=seed, file_type=ft)
                     for ft in ("f32", *args.file_types)}
            reference_ex = open_executor(files["f32"], args.prompt_tokens + args.tokens)
            # ordinary ids only (the first 1,000 hold the special tokens)
            prompts = [torch.randint(1000, vocab, (args.prompt_tokens,),
                                     generator=torch.Generator().manual_seed(100 * seed + k)).tolist()
                       for k in range(args.prompts)]
            references = [greedy(reference_ex, ids, args.tokens) for ids in prompts]
            del reference_ex
            for ft in args.file_types:  # the kernels against float32 copies of the same file's weights
                upcast = open_executor(files[ft], args.prompt_tokens + args.tokens, weights="upcast")
                same = [greedy(upcast, ids, args.tokens) for ids in prompts]
                del upcast
                stored = open_executor(files[ft], args.prompt_tokens + args.tokens)
                for k, (ids, ref) in enumerate(zip(prompts, same)):
                    score = agreement(forced_picks(stored, ids, ref), ref)
                    scores.setdefault(("musegl-same-file", ft), []).append(score)
                    print(json.dumps({"preset": args.preset, "seed": seed, "prompt": k, "engine": "musegl-same-file",
                                      "file_type": ft, "tokens": args.tokens, "agreement": round(score, 4)}),
                          flush=True)
                del stored
            engines = [("musegl", ft) for ft in args.file_types]
            if args.llama_server:
                engines = [("llama.cpp", "f32")] + engines + [("llama.cpp", ft) for ft in args.file_types]
            for engine, ft in engines:
                if engine == "musegl":
                    ex = open_executor(files[ft], args.prompt_tokens + args.tokens)
                    run = lambda ids, ref: forced_picks(ex, ids, ref)  # noqa: E731
                    close = lambda: None  # noqa: E731
                else:
                    server = LlamaServer(args.llama_server, files[ft], args.threads)
                    run = lambda ids, ref: llama_picks(server, ids, ref)  # noqa: E731
                    close = server.close
                try:
                    for k, (ids, ref) in enumerate(zip(prompts, references)):
                        score = agreement(run(ids, ref), ref)
                        scores.setdefault((engine, ft), []).append(score)
                        print(json.dumps({"preset": args.preset, "seed": seed, "prompt": k, "engine": engine,
                                          "file_type": ft, "tokens": args.tokens, "agreement": round(score, 4)}),
                              flush=True)
                finally:
                    close()
    summary = {f"{engine}/{ft}": {"mean": round(sum(v) / len(v), 4), "min": round(min(v), 4), "runs": len(v)}
               for (engine, ft), v in scores.items()}
    print(json.dumps({"preset": args.preset, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
