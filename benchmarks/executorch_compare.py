"""The ExecuTorch executor vs the eager torch executor on the same checkpoint, same run.

Builds a tiny random checkpoint (``--preset``, F32) and its tiny projector,
exports both with ``musegl export``'s code (``--forward-sizes``,
``--activation-dtype``, ``--quantize``, ``--max-vision-patches``; a progress
bar with a step per method), then, for each executor and each of
``--batches``, prefills that many sequences of ``--prompt-tokens`` random ids
and times ``--decode-steps`` batched greedy decode steps (every sequence one
token per step, through the engine's step API, so the two executors run
exactly the same steps): tok/s and process CPU ms per token. Then an image
prefill (``--image-size``: the vision encoder and one prefill step with the
image rows) through each. Also reports the teacher-forced top-1 agreement of
the exported program with the torch executor (float32) over
``--agreement-tokens`` positions. Prints one JSON object per figure and a
summary object last. ``--threads 1`` pins both executors to one thread: on a
machine shared with other jobs, multi-threaded torch ops spin against the
other jobs and the wall-clock figures measure the load, not the executors.

    python benchmarks/executorch_compare.py                       # float32
    python benchmarks/executorch_compare.py --quantize int8        # int8 weight-only
    python benchmarks/executorch_compare.py --activation-dtype float16
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import tempfile
import time
from pathlib import Path

import attrs
import numpy as np
import torch
from PIL import Image

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.checkpoint.vision import load_vision
from musegl_core.engine.executor import EmbeddingSpan, SeqChunk, Step
from musegl_core.engine.request import ImageInput
from musegl_core.progress import loading_progress
from musegl_core.vision.preprocess import ImagePreprocessor
from musegl_core.tiny import PRESETS, make_tiny
from musegl_core.tokenizer import MuseTokenizer
from musegl_cuda.executor import TorchExecutor
from musegl_executorch.executor import ExecuTorchExecutor
from musegl_executorch.export.build import build_artifact
from musegl_executorch.export.command import QUANTIZATIONS, parse_sizes


def decode_rate(executor, vocab: int, batch: int, prompt_tokens: int, steps: int, seed: int = 0) -> dict:
    """Prefill ``batch`` sequences, then time ``steps`` greedy decode steps of all of them."""
    bs = executor.block_size
    per_seq = -(-(prompt_tokens + steps + 1) // bs)
    rng = np.random.default_rng(seed)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    last = []
    started = time.perf_counter()
    for seq, blocks in enumerate(tables):
        prompt = rng.integers(300, vocab - 300, size=prompt_tokens).tolist()
        out = executor.step(Step([SeqChunk(seq, prompt, list(range(prompt_tokens)), blocks, sample=1)]))
        last.append(out.tokens[seq][0])
    prefill = time.perf_counter() - started
    width = executor.limits.padded_width(batch)
    started, cpu = time.perf_counter(), time.process_time()
    generated = [[] for _ in range(batch)]
    for step in range(steps):
        pos = prompt_tokens + step
        chunks = [SeqChunk(seq, [last[seq]], [pos], tables[seq], sample=1) for seq in range(batch)]
        out = executor.step(Step(chunks, width=width))
        last = [out.tokens[seq][0] for seq in range(batch)]
        for seq in range(batch):
            generated[seq].append(last[seq])
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"batch": batch, "prefill_s": round(prefill, 3), "decode_s": round(seconds, 3),
            "decode_tok_s": round(batch * steps / seconds, 2),
            "cpu_ms_per_token": round(cpu * 1e3 / (batch * steps), 3), "generated": generated}


def picture(width: int, height: int) -> str:
    """A base64 PNG: a gradient with noise (so resizing and the tower do real work)."""
    rng = np.random.default_rng(5)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(base + rng.integers(-40, 41, base.shape), 0, 255).astype(np.uint8)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def image_prefill(executor, image, repeats: int = 3) -> dict:
    """The best of ``repeats`` image prefills: the vision encoder, then one prefill step
    of 8 text rows, the image rows and 8 more (``embed_image`` + ``step``)."""
    rows = image.rows
    tokens = list(range(1000, 1008)) + [1] * rows + list(range(2000, 2008))
    blocks = list(range(-(-len(tokens) // executor.block_size)))
    best, best_cpu, ids = float("inf"), float("inf"), None
    for _ in range(repeats):
        started, cpu = time.perf_counter(), time.process_time()
        embedding = executor.embed_image(image)
        chunk = SeqChunk(0, tokens, list(range(len(tokens))), blocks, sample=1,
                         embeds=[EmbeddingSpan(8, rows, embedding)])
        ids = executor.step(Step([chunk])).tokens[0]
        best, best_cpu = min(best, time.perf_counter() - started), min(best_cpu, time.process_time() - cpu)
    return {"seconds": round(best, 4), "cpu_s": round(best_cpu, 4), "ids": ids}


def agreement(mine, reference, vocab: int, tokens: int, seed: int = 1) -> float:
    """Teacher-forced top-1 agreement: both read the same ids (a prompt and the reference's
    own greedy continuation) and we compare their argmax at each of ``tokens`` positions."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(300, vocab - 300, size=16).tolist()
    bs = reference.block_size
    blocks = list(range(-(-(len(prompt) + tokens + 1) // bs)))
    ids = list(prompt)
    for _ in range(tokens):  # the reference's greedy continuation, one step at a time
        step = Step([SeqChunk(0, ids, list(range(len(ids))), blocks, sample=1)])
        ids.append(reference.step(step).tokens[0][0])
    rows = list(range(len(prompt) - 1, len(ids) - 1))
    chunk = SeqChunk(0, ids[:-1], list(range(len(ids) - 1)), blocks, sample=0, logit_rows=True)
    theirs = reference.step(Step([chunk])).logits[0][rows].argmax(-1)
    ours = mine.step(Step([chunk])).logits[0][rows].argmax(-1)
    return float((torch.as_tensor(ours) == torch.as_tensor(theirs)).float().mean())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--native-context", type=int, default=4096, help="the checkpoint's max_position_embeddings")
    p.add_argument("--forward-sizes", default="1,8")
    p.add_argument("--max-prefill-chunk", type=int, default=512,
                   help="as musegl export's default; the image prefill is one call up to this many rows")
    p.add_argument("--max-cells", type=int, default=4096)
    p.add_argument("--activation-dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--quantize", default="none", choices=tuple(QUANTIZATIONS))
    p.add_argument("--batches", default="1,8", help="decode batch sizes, timed one after the other")
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads of both executors (torch and the ExecuTorch threadpool); 0: their "
                        "defaults. 1 gives comparable CPU times on a machine shared with other jobs")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--agreement-tokens", type=int, default=64)
    p.add_argument("--workdir", default=None, help="keep the checkpoint and the export here")
    p.add_argument("--text-only", action="store_true", help="export without the tiny projector (no image figures)")
    p.add_argument("--max-vision-patches", type=int, default=1024, help="the exported patch capacity")
    p.add_argument("--image-size", default="448x448", metavar="WxH", help="the image prefill's picture")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.threads:
        import executorch.extension.pybindings.portable_lib as portable

        torch.set_num_threads(args.threads)
        portable._unsafe_reset_threadpool(args.threads)  # before any program loads
    base = PRESETS[args.preset]
    preset = attrs.evolve(base, max_position_embeddings=args.native_context,
                          num_layers=args.layers or base.num_layers)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="musegl-et-bench-"))
    gguf = make_tiny(work / "checkpoint", preset=preset, file_type="f32", mmproj=not args.text_only)
    checkpoint = load_checkpoint(gguf)
    vision = None if args.text_only else load_vision(gguf, gguf.parent / "mmproj.gguf", checkpoint.config.hidden_size)
    out = work / "export"
    started, export_cpu = time.perf_counter(), time.process_time()
    with loading_progress("exporting") as progress:  # a step per method, then the lowering
        build_artifact(checkpoint, MuseTokenizer.load(gguf), out, forward_sizes=parse_sizes(args.forward_sizes),
                       max_prefill_chunk=args.max_prefill_chunk, max_cells=args.max_cells,
                       activation_dtype=args.activation_dtype, quantization=QUANTIZATIONS[args.quantize],
                       progress=progress, vision_weights=vision, vision_patches=args.max_vision_patches)
    export_s, export_cpu = time.perf_counter() - started, time.process_time() - export_cpu
    sizes = {name: (out / name).stat().st_size for name in ("model.pte", "model.ptd")}
    print(json.dumps({"figure": "export", "seconds": round(export_s, 2), "cpu_s": round(export_cpu, 2),
                      "bytes": sizes, "preset": preset.name,
                      "layers": preset.num_layers, "projector": vision is not None}), flush=True)

    vocab = checkpoint.config.vocab_size
    blocks = max(batches) * -(-(args.prompt_tokens + args.decode_steps + 1) // 16) + 8
    torch_exec = TorchExecutor(checkpoint, device="cpu", dtype="float32", vision=vision)
    torch_exec.allocate_kv(max(blocks, -(-(16 + args.agreement_tokens + 1) // 16)))
    et_exec = ExecuTorchExecutor(str(out))
    et_exec.allocate_kv(max(blocks, -(-(16 + args.agreement_tokens + 1) // 16)))
    results: dict[tuple[str, int], dict] = {}
    for name, executor in (("torch-cpu", torch_exec), ("executorch", et_exec)):
        decode_rate(executor, vocab, 1, 8, 2)  # warm-up
        for batch in batches:
            results[name, batch] = decode_rate(executor, vocab, batch, args.prompt_tokens, args.decode_steps)
            print(json.dumps({"figure": "decode", "executor": name,
                              **{k: v for k, v in results[name, batch].items() if k != "generated"}}), flush=True)
    same = all(results["torch-cpu", b]["generated"] == results["executorch", b]["generated"] for b in batches)
    agree = agreement(et_exec, torch_exec, vocab, args.agreement_tokens)
    summary = {"figure": "summary", "activation_dtype": args.activation_dtype, "quantize": args.quantize,
               "threads": args.threads or torch.get_num_threads(), "export_s": round(export_s, 2),
               "export_cpu_s": round(export_cpu, 2),
               "pte_bytes": sizes["model.pte"], "ptd_bytes": sizes["model.ptd"]}
    for b in batches:
        mine, theirs = results["executorch", b], results["torch-cpu", b]
        summary[f"batch{b}"] = {
            "torch_tok_s": theirs["decode_tok_s"], "executorch_tok_s": mine["decode_tok_s"],
            "wall_ratio": round(mine["decode_tok_s"] / theirs["decode_tok_s"], 3),
            "torch_cpu_ms_per_token": theirs["cpu_ms_per_token"],
            "executorch_cpu_ms_per_token": mine["cpu_ms_per_token"],
            "cpu_ratio": round(theirs["cpu_ms_per_token"] / mine["cpu_ms_per_token"], 3)}
    if vision is not None:
        width, height = (int(v) for v in args.image_size.split("x"))
        image = ImagePreprocessor(args.max_vision_patches).preprocess(ImageInput("image/png", picture(width, height)))
        prefill = {name: image_prefill(executor, image) for name, executor in
                   (("torch-cpu", torch_exec), ("executorch", et_exec))}
        same = same and prefill["torch-cpu"].pop("ids") == prefill["executorch"].pop("ids")
        for name, figures in prefill.items():
            print(json.dumps({"figure": "image_prefill", "executor": name, "grid": list(image.grid),
                              "rows": image.rows, **figures}), flush=True)
        summary["image_prefill"] = {
            "grid": list(image.grid), "rows": image.rows,
            "torch_s": prefill["torch-cpu"]["seconds"], "executorch_s": prefill["executorch"]["seconds"],
            "wall_ratio": round(prefill["executorch"]["seconds"] / prefill["torch-cpu"]["seconds"], 3),
            "cpu_ratio": round(prefill["executorch"]["cpu_s"] / prefill["torch-cpu"]["cpu_s"], 3)}
    summary.update({"greedy_identical": same, "top1_agreement": round(agree, 4),
                    "agreement_tokens": args.agreement_tokens, "decode_steps": args.decode_steps})
    print(json.dumps(summary), flush=True)
    et_exec.close()
    torch_exec.close()
    checkpoint.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
