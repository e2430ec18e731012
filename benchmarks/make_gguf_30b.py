"""Write a GGUF of the 30B Muse Glimmer shape with random weights, for llama.cpp's server.

The shape is transformers' ``MuseGlimmerTextConfig()`` (hidden 6656, 52 layers, 32/2 heads,
head_dim 128, ffn 19968, vocabulary 202048); ``--layers N`` keeps the first N layers (the full
depth is ~53 GB in bf16; the H200 machine's disk is 64 GiB), ``--tiny`` the 4-layer hidden-64
shape of ``benchmarks/gpu_decode.py --tiny`` (local checks). The layout is the one
``musegl_core/checkpoint/gguf_writer.py`` writes and llama.cpp's ``muse-glimmer`` architecture
loads (the file ``musegl export`` and ``benchmarks/make_bench_model.py`` produce): the same
metadata, tensor names and types (matrices ``--file-type``, norms F32), and the demo tokenizer
that ``musegl serve --load-format dummy`` uses for a bare config.json of the same vocabulary, so
both servers tokenize the bench's text alike. Written with the ``gguf`` package's writer.

Matrices are N(0, 0.02) values: a seeded pool of 2^24 draws, each matrix reading it from its own
offset, repeated to its size. Only the shape matters for the timing; drawing (and the generic
writer's float32 round trip over) 15-30 billion values would take many minutes, the copies run at
disk speed.

    python benchmarks/make_gguf_30b.py OUT.gguf [--layers 26] [--file-type bf16|f16] [--seed 0] [--tiny]

Prints the path and size; ``--config-out DIR`` also writes the matching bare ``config.json``
(for ``musegl serve DIR --load-format dummy``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

import gguf
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

# The writer's own plan (names, shapes, per-tensor types, metadata): private helpers of the module
# that writes musegl's GGUF files, so that this file's layout cannot drift from theirs.
from musegl_core.checkpoint.gguf_writer import (  # noqa: E402
    FILE_TYPES,
    _add_metadata,
    _gguf_tensors,
    _nbytes,
    _tensor_type,
    add_tokenizer_metadata,
)

#: Values in the pool the matrices repeat.
POOL = 1 << 24

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=64)


def raw_config(layers: int | None, tiny: bool) -> dict:
    from transformers import MuseGlimmerTextConfig

    raw = MuseGlimmerTextConfig(**(TINY if tiny else {})).to_dict()
    if layers:
        if not 1 <= layers <= raw["num_hidden_layers"]:
            raise SystemExit(f"--layers must be in 1..{raw['num_hidden_layers']}")
        full = raw["num_hidden_layers"]
        raw["num_hidden_layers"] = layers
        for key, value in raw.items():  # the per-layer lists (layer_types, layer_rope_theta)
            if isinstance(value, list) and len(value) == full:
                raw[key] = value[:layers]
    return raw


class SmallWeights(dict):
    """The vectors (norms) the writer's plan asks for by name: N(0, 0.02) float32, seeded by name."""

    def __init__(self, config, seed: int) -> None:
        from musegl_core.checkpoint.hf_reader import expected_shape, text_weight_names

        super().__init__((name, None) for name in text_weight_names(config))
        self.config, self.seed, self.shape = config, seed, expected_shape

    def __getitem__(self, name: str) -> np.ndarray:
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        return (rng.standard_normal(self.shape(self.config, name)) * 0.02).astype(np.float32)


def write(path: Path, raw: dict, file_type: str, seed: int) -> None:
    from musegl_core.checkpoint.hf_reader import text_config_dict, text_config_from_dict
    from musegl_core.tiny import build_tiny_tokenizer

    if file_type not in ("bf16", "f16"):
        raise SystemExit("--file-type must be bf16 or f16")
    tokenizer = build_tiny_tokenizer(vocab_size=raw["vocab_size"])  # musegl's demo tokenizer
    config = text_config_from_dict(text_config_dict(raw, "MuseGlimmerTextConfig()"))
    ftype, matrix_type = FILE_TYPES[file_type]
    torch_dtype = torch.bfloat16 if file_type == "bf16" else torch.float16
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(POOL, generator=generator, dtype=torch.float32).mul_(0.02).to(torch_dtype)
    pool = pool.view(torch.int16).numpy()
    writer = gguf.GGUFWriter(os.fspath(path), "muse-glimmer")
    try:
        _add_metadata(writer, config, ftype, f"Muse Glimmer 30B shape, {config.num_layers} layers, random")
        add_tokenizer_metadata(writer, tokenizer.to_gguf_data(config.vocab_size), config.vocab_size)
        plan = []
        for name, make, shape in _gguf_tensors(config, SmallWeights(config, seed), False):
            qtype = _tensor_type(name, shape, matrix_type)
            stored_shape, nbytes = _nbytes(shape, qtype)
            if qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor_info(name, stored_shape, np.dtype(np.float32), nbytes)
            elif qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor_info(name, stored_shape, np.dtype(np.float16), nbytes)
            else:
                writer.add_tensor_info(name, stored_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
            plan.append((name, make, shape, qtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        started, written = time.perf_counter(), 0
        for done, (name, make, shape, qtype) in enumerate(plan, start=1):
            if qtype == gguf.GGMLQuantizationType.F32:
                data = np.ascontiguousarray(make(), dtype=np.float32)
            else:
                count = int(np.prod(shape))
                offset = zlib.crc32(name.encode()) % POOL
                data = np.resize(np.roll(pool, -offset), count).reshape(shape)  # the pool, repeated
                data = data.view(np.float16) if qtype == gguf.GGMLQuantizationType.F16 else data.view(np.uint8)
            writer.write_tensor_data(data)
            written += data.nbytes
            if done % 20 == 0 or done == len(plan):
                rate = written / 2**30 / max(time.perf_counter() - started, 1e-9)
                print(f"  {done}/{len(plan)} tensors, {written / 2**30:.1f} GiB ({rate:.2f} GiB/s)", file=sys.stderr,
                      flush=True)
    finally:
        writer.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, nargs="?", help="the GGUF to write (not with --config-only)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N of the 52 layers")
    p.add_argument("--file-type", default="bf16", choices=["bf16", "f16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the 4-layer hidden-64 shape (local checks)")
    p.add_argument("--config-out", type=Path, default=None,
                   help="also write the same shape's bare config.json into this directory")
    p.add_argument("--config-only", action="store_true", help="write only --config-out's config.json")
    args = p.parse_args()
    raw = raw_config(args.layers, args.tiny)
    if args.config_only or args.out is None:
        if args.config_out is None:
            p.error("give OUT.gguf, or --config-only with --config-out DIR")
        args.config_out.mkdir(parents=True, exist_ok=True)
        (args.config_out / "config.json").write_text(json.dumps(raw))
        print(args.config_out / "config.json")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".partial")
    write(tmp, raw, args.file_type, args.seed)
    os.replace(tmp, args.out)
    if args.config_out is not None:
        args.config_out.mkdir(parents=True, exist_ok=True)
        (args.config_out / "config.json").write_text(json.dumps(raw))
    print(f"{args.out} ({args.out.stat().st_size / 2**30:.2f} GiB, {raw['num_hidden_layers']} layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
