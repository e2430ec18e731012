"""Write the issue-17 benchmark model: a 513M-parameter Muse Glimmer text model with random weights.

The shape is the ``bench`` preset of :mod:`musegl_core.tiny` (hidden 1024, 8 layers, 8 heads / 2 KV
heads, head_dim 128, ffn 2816, vocabulary 202048), written by ``musegl_core/checkpoint/gguf_writer.py``
in llama.cpp's converter layout (arch ``muse-glimmer``, tokenizer in the metadata), so both musegl and
llama.cpp's server load the same file. Same seed and file type give byte-identical files.

    python benchmarks/make_bench_model.py OUTDIR [--file-type f16|bf16|q8_0|f32] [--seed 0]

Prints the path of the written ``model.gguf`` (``OUTDIR/model.gguf``; ``tokenizer.json`` beside it).
"""

from __future__ import annotations

import argparse
import sys

from musegl_core.tiny import PRESETS, make_tiny


def parameter_count() -> int:
    p = PRESETS["bench"]
    q, kv = p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim
    per_layer = p.hidden_size * (2 * q + 2 * kv) + 3 * p.hidden_size * p.intermediate_size
    return 2 * p.vocab_size * p.hidden_size + p.num_layers * per_layer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir")
    parser.add_argument("--file-type", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = make_tiny(args.outdir, preset="bench", seed=args.seed, file_type=args.file_type, progress=True)
    print(f"{parameter_count() / 1e6:.0f}M parameters", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
