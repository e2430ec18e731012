"""mlx-lm's converter, for tests of MLX quantized safetensors (``pip install mlx-lm``).

:func:`mlx_lm_quantize` runs ``mlx_lm.convert`` (the converter users run:
``mlx_lm.convert --hf-path DIR -q --q-bits 4 --q-group-size 64``) on a Hugging Face
directory. mlx-lm's ``muse_glimmer`` port is text-only and drops the vision tower
only under unprefixed names, while transformers saves it as ``model.vision_*``; the
directory handed to the converter is therefore a text-only copy (the same
config.json and the text tensors, byte for byte). The converter also loads a
tokenizer; a directory without ``tokenizer.json`` (the tests' transformers models)
gets a byte-level BPE one over the tiny test vocabulary, which the weights do not
depend on (and which musegl reads too).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from musegl_core.checkpoint.hf_reader import open_safetensors


def text_only_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """``src`` (a Hugging Face directory) without its vision tensors, written to ``dst``."""
    import safetensors.numpy

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for extra in src.iterdir():
        if extra.suffix == ".json" and extra.name != "model.safetensors.index.json":
            shutil.copy2(extra, dst / extra.name)
    files, names = open_safetensors(src)
    tensors = {}
    for name, fname in names:
        if ".vision_" in name or name.startswith(("vision_", "model.multi_modal")):
            continue
        tensors[name] = files[fname]._raw(name, _numpy_dtype(files[fname].entries[name]["dtype"])).copy()
    safetensors.numpy.save_file(tensors, str(dst / "model.safetensors"))
    for f in files.values():
        f.close()
    if not (dst / "tokenizer.json").exists():
        _write_id_tokenizer(dst)
    return dst


def _write_id_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer over the tiny test vocabulary
    (:func:`~musegl_core.testing.reference_models.tiny_tokenizer_data`) for a directory that has none."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from musegl_core.checkpoint.hf_reader import text_config_dict
    from musegl_core.checkpoint.tokenizer_data import CONTROL
    from musegl_core.testing.reference_models import tiny_tokenizer_data

    raw = json.loads((directory / "config.json").read_text())
    data = tiny_tokenizer_data(int(text_config_dict(raw, str(directory))["vocab_size"]))
    vocab = {token: i for i, token in enumerate(data.tokens)}
    merges = [tuple(m.split(" ")) for m in data.merges]
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(data.tokens, data.token_types) if kind == CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def _numpy_dtype(kind: str):
    import numpy as np

    return {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[kind]


def mlx_lm_quantize(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, bits: int = 4,
                    group_size: int = 64, dtype: str | None = None) -> Path:
    """mlx-lm's converter on a text-only copy of ``hf_dir``: affine ``bits``-bit codes in
    groups of ``group_size``, written to ``out_dir`` (which must not exist). ``dtype``:
    the converter's ``--dtype`` for the unquantized tensors and the scales (default: the
    checkpoint's)."""
    from mlx_lm import convert

    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".text-only")
    text_only_copy(hf_dir, staging)
    if dtype is None:
        config = json.loads((staging / "config.json").read_text())
        dtype = config.get("torch_dtype") or config.get("dtype") or (config.get("text_config") or {}).get("dtype")
    try:
        convert(str(staging), mlx_path=str(out_dir), quantize=True, q_group_size=group_size, q_bits=bits,
                dtype=dtype)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
