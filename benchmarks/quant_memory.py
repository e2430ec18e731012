"""Resident weight bytes of quantized files on each CPU-side executor, against the file's tensor bytes.

Builds one random transformers model (hidden 256, 4 heads of 64, MLP 512, 2 layers, the real
202048 vocabulary, so the embedding and head are most of the file), writes it with musegl's
converter as a float32 GGUF, quantizes that with llama.cpp's own ``llama-quantize`` (Q4_K_M,
Q6_K, Q8_0) and the Hugging Face directory with mlx-lm's converter (4-bit, groups of 64; the
scales in float32 as the model, and in bfloat16 as published mlx-lm files have them), then
loads each file on ``torch-cpu`` and ``mlx`` in a fresh process and measures the anonymous
resident memory (``RssAnon``) the executor adds
(:func:`musegl_core.testing.quantized_files.resident_weight_bytes`; the file's mapped pages
are page cache, not counted). The issue's bound: resident <= 1.1x the file's tensor bytes.

    python benchmarks/quant_memory.py --out benchmarks/results/<folder>

writes ``table.md`` and ``results.json`` into ``--out`` (and prints the table).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
from pathlib import Path

BOUND = 1.1


def build_files(work: Path) -> dict[str, Path]:
    from musegl_core.testing.mlx_lm_tools import mlx_lm_quantize
    from musegl_core.testing.quantized_files import WIDE_SHAPE, llama_quantized
    from musegl_core.testing.reference_models import build_tiny_model

    model = build_tiny_model(seed=3, vocab_size=202048, num_hidden_layers=2, **WIDE_SHAPE)
    hf = work / "hf"
    model.save_pretrained(hf)
    del model
    files = {f"GGUF {kind}": path for kind, path in llama_quantized(hf, work / "llama", ("Q4_K_M", "Q6_K", "Q8_0")).items()}
    files["mlx-lm 4-bit g64 (f32 scales)"] = mlx_lm_quantize(hf, work / "mlx-f32", bits=4, group_size=64)
    files["mlx-lm 4-bit g64 (bf16 scales)"] = mlx_lm_quantize(hf, work / "mlx-bf16", bits=4, group_size=64,
                                                              dtype="bfloat16")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder (created)")
    parser.add_argument("--executors", default="torch-cpu,mlx")
    args = parser.parse_args()
    from musegl_core.engine.fit import checkpoint_tensor_bytes
    from musegl_core.testing.quantized_files import resident_weight_bytes

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="quant-memory-") as tmp:
        files = build_files(Path(tmp))
        for label, path in files.items():
            kinds = checkpoint_tensor_bytes(path)
            file_bytes = sum(kinds.values())
            for executor in args.executors.split(","):
                resident = resident_weight_bytes(executor, path)
                rows.append({"file": label, "executor": executor, "file_tensor_bytes": file_bytes,
                             "stored_kinds": kinds, "resident_bytes": resident,
                             "ratio": round(resident / file_bytes, 3), "within_bound": resident <= BOUND * file_bytes})
                print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                      text=True).stdout.strip():
        commit += "-dirty"
    lines = ["| file | executor | file tensor bytes | resident (RssAnon) | ratio | <= 1.1x |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['file']} | {r['executor']} | {r['file_tensor_bytes']:,} | {r['resident_bytes']:,} | "
                     f"{r['ratio']:.3f} | {'yes' if r['within_bound'] else 'NO'} |")
    table = "\n".join(lines)
    print(table)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "results.json").write_text(json.dumps({"commit": commit, "machine": platform.platform(),
                                                       "bound": BOUND, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
