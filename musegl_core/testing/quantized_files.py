"""Quantized checkpoints made by the real tools, for the exactness and memory tests.

:func:`llama_quantized` writes a transformers model as a GGUF with musegl's converter
(:func:`~musegl_core.checkpoint.gguf_writer.write_text_gguf`, float32) and quantizes it
with llama.cpp's ``llama-quantize`` (:mod:`musegl_core.testing.llamacpp`);
:func:`greedy_cli` runs ``musegl generate`` on a checkpoint (the whole engine, one
executor) and returns its token ids; :func:`reference_greedy` is transformers' greedy
continuation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: A tiny model whose every matrix fills llama.cpp's 256-value k-quant super-blocks
#: (hidden 256, 4 heads of 64, MLP 512), so a Q4_K_M file is all Q4_K and Q6_K.
WIDE_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64)


def llama_quantized(model_dir: str | Path, out_dir: str | Path, kinds: tuple[str, ...]) -> dict[str, Path]:
    """``{kind: path}``: the Hugging Face model at ``model_dir`` converted to a float32
    GGUF, then quantized by llama-quantize to each kind (``Q4_K_M``, ``Q6_K``, ``Q8_0`` ...)."""
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.testing.llamacpp import quantize
    from musegl_core.testing.reference_models import tiny_tokenizer_data

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = load_checkpoint(model_dir)
    source = out_dir / "model-f32.gguf"
    write_text_gguf(source, checkpoint.config, dict(checkpoint.iter_weights()),
                    tiny_tokenizer_data(checkpoint.config.vocab_size), file_type="f32")
    checkpoint.close()
    return {kind: quantize(source, out_dir / f"model-{kind}.gguf", kind) for kind in kinds}


def greedy_cli(model: str | Path, executor: str, ids: list[int], n: int, *extra: str) -> list[int]:
    """``musegl generate --executor EXECUTOR --dtype float32`` greedy token ids after ``ids``."""
    out = subprocess.run(
        [sys.executable, "-m", "musegl_core.cli.main", "generate", "--model", str(model), "--executor", executor,
         "--dtype", "float32", "--token-ids", ",".join(map(str, ids)), "--max-tokens", str(n), "--ignore-eos",
         "--json", *extra],
        capture_output=True, text=True, timeout=600,
    )
    if out.returncode:
        raise RuntimeError(f"musegl generate failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)["token_ids"]


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


_RESIDENT = r"""
import gc, json, sys
def anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
executor, path = sys.argv[1], sys.argv[2]
from musegl_core.allocator import fix_mmap_threshold
fix_mmap_threshold()  # as the worker does
from musegl_core.checkpoint.loader import load_checkpoint
if executor == "torch-cpu":
    import torch
    from musegl_cuda.cpu import native
    from musegl_cuda.executor import TorchExecutor
    native.load()  # the kernels built and loaded before the baseline
    torch.empty(1)
    checkpoint = load_checkpoint(path)  # its metadata (the tokenizer's 200k strings) too
    gc.collect(); before = anon()
    ex = TorchExecutor(checkpoint, device="cpu", block_size=16)
    checkpoint.close()
else:
    import mlx.core as mx
    from musegl_mlx.executor import MLXExecutor
    from musegl_mlx.loader import checkpoint_weights
    mx.eval(mx.zeros(1))
    checkpoint = load_checkpoint(path)
    gc.collect(); before = anon()
    ex = MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype="float32",
                     block_size=16, stored_dtype=checkpoint.file_type)
    checkpoint.close()
gc.collect()
print(json.dumps({"resident": anon() - before}))
"""


def resident_weight_bytes(executor: str, path: str | Path) -> int:
    """Anonymous resident memory (``RssAnon``) an executor (``torch-cpu`` or ``mlx``) adds
    by loading the weights of the checkpoint at ``path``, in a fresh process set up as the
    worker is (glibc's mmap threshold fixed). The checkpoint is opened before the
    baseline (its metadata, a GGUF's tokenizer strings, is not weights), and the file's
    mapped pages, page cache, are not counted: they are the file's, not the executor's."""
    out = subprocess.run([sys.executable, "-c", _RESIDENT, executor, str(path)], capture_output=True, text=True,
                         timeout=600)
    if out.returncode:
        raise RuntimeError(f"loading {path} on {executor} failed: {out.stderr[-2000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["resident"])
