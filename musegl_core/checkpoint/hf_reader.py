"""Hugging Face checkpoint directories: ``config.json`` plus safetensors.

Reads the text decoder of ``MuseGlimmerForConditionalGeneration`` (or a bare
``muse_glimmer_text`` model) with numpy only. safetensors files are parsed
here (an 8-byte header length, a JSON header, then raw little-endian data),
because numpy has no bfloat16 and the core must not import torch: bf16 words
are widened to float32 by a 16-bit shift, which is exact.

Weight names are transformers names with the ``model.language_model.``
prefix stripped (see :func:`text_weight_names`). Vision tensors are ignored.

MLX quantized directories as mlx-lm's converter writes them (``config.json``
``"quantization": {"group_size", "bits", "mode": "affine"}``, optionally with
per-module overrides; each quantized matrix ``X.weight`` packed uint32 beside
``X.scales`` and ``X.biases``) are read too: :meth:`HFTextReader.read_stored`
gives such a matrix as an ``mlx_q{bits}_g{group}`` :class:`StoredTensor`,
:meth:`HFTextReader.read` its float32 values (``scale·code + bias``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.stored import FP8, StoredTensor, mlx_dtype

# transformers' MuseGlimmerTextConfig class defaults, used
# for every field a config.json leaves out.
TEXT_CONFIG_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048,
    "hidden_size": 6656,
    "intermediate_size": 19968,
    "num_hidden_layers": 52,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "post_norm_eps": 1e-8,
    "sliding_window": 2048,
    "final_logit_softcapping": 20.0,
    "qk_scale_factor": 3.87,
    "output_multiplier": 0.19611613513818404,
    "bos_token_id": 200000,
    "eos_token_id": 200001,
    "tie_word_embeddings": False,
}
DEFAULT_ROPE_THETA = 10000.0

# Per-layer weights, in transformers naming, in the order a layer uses them.
LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.gate_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_feedforward_layernorm.weight",
)
# The four centered norms, stored as ``w`` and used as ``1 + w``.
CENTERED_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight",
)
# Prefixes that wrap the text decoder's names in the checkpoints we accept.
_NAME_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def text_weight_names(config: TextConfig) -> tuple[str, ...]:
    """Every text-decoder weight name, in load order (embedding, layers, head)."""
    names = ["embed_tokens.weight"]
    for i in range(config.num_layers):
        names.extend(f"layers.{i}.{suffix}" for suffix in LAYER_WEIGHTS)
    names.extend(("norm.weight", "lm_head.weight"))
    return tuple(names)


def expected_shape(config: TextConfig, name: str) -> tuple[int, ...]:
    """The transformers shape ``(out, in)`` (or ``(n,)``) of the weight ``name``."""
    h, hd = config.hidden_size, config.head_dim
    q, kv, ffn = config.num_heads * hd, config.num_kv_heads * hd, config.intermediate_size
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
    shapes = {
        "embed_tokens.weight": (config.vocab_size, h),
        "lm_head.weight": (config.vocab_size, h),
        "norm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.gate_proj.weight": (q, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (ffn, h),
        "mlp.up_proj.weight": (ffn, h),
        "mlp.down_proj.weight": (h, ffn),
    }
    if suffix in CENTERED_NORMS:
        return (h,)
    return shapes[suffix]


# ---------------------------------------------------------------------------
# config.json


def text_config_dict(raw: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The text-decoder part of a ``config.json``: ``text_config`` of a
    ``muse_glimmer`` config, or the whole dict for ``muse_glimmer_text``."""
    model_type = raw.get("model_type")
    if model_type == "muse_glimmer":
        text = raw.get("text_config") or {}
        if text.get("model_type", "muse_glimmer_text") != "muse_glimmer_text":
            raise ValueError(f"{where}: text_config.model_type is {text.get('model_type')!r}, "
                             "expected 'muse_glimmer_text'")
        return text
    if model_type == "muse_glimmer_text":
        return raw
    raise ValueError(f"{where}: model_type is {model_type!r}; expected 'muse_glimmer' "
                     "(with text_config) or 'muse_glimmer_text'")


def text_config_from_dict(text: dict[str, Any]) -> TextConfig:
    """Build a :class:`TextConfig` from a transformers text-config dict.

    Layer kinds: ``sliding[i]`` from
    ``layer_types`` (default: full on every 4th layer counted back from the
    last), ``rope[i]`` from ``layer_rope_theta[i] != 0`` (same default pattern,
    independent of ``layer_types``, as transformers does). One global θ comes
    from ``rope_parameters.rope_theta`` (default 10000).
    """
    def get(key: str) -> Any:  # an explicit null stays null; an absent key takes the default
        return text[key] if key in text else TEXT_CONFIG_DEFAULTS.get(key)

    n = int(get("num_hidden_layers"))
    default = TextConfig.default_layout(n)
    layer_types = text.get("layer_types")
    if layer_types is None:
        sliding = default
    else:
        if len(layer_types) != n:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
        unknown = set(layer_types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unknown layer_types {sorted(unknown)}")
        sliding = tuple(t == "sliding_attention" for t in layer_types)
    layer_theta = text.get("layer_rope_theta")
    if layer_theta is None:
        rope = default
    else:
        if len(layer_theta) != n:
            raise ValueError(f"layer_rope_theta has {len(layer_theta)} entries for {n} layers")
        rope = tuple(float(t) != 0.0 for t in layer_theta)

    rope_parameters = text.get("rope_parameters") or {}
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (Muse Glimmer uses 'default')")
    theta = rope_parameters.get("rope_theta", text.get("rope_theta", DEFAULT_ROPE_THETA))

    window = get("sliding_window")
    max_pos = int(get("max_position_embeddings"))
    if window is None:  # no window at all: every layer attends to everything
        window, sliding = max_pos, tuple(False for _ in range(n))

    eos = get("eos_token_id")
    eos_ids = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),))
    bos = get("bos_token_id")
    softcap = get("final_logit_softcapping")
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    return TextConfig(
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads")),
        head_dim=int(text.get("head_dim") or hidden // heads),
        sliding_window=int(window),
        sliding=sliding,
        rope=rope,
        rope_theta=float(theta),
        rms_norm_eps=float(get("rms_norm_eps")),
        post_norm_eps=float(get("post_norm_eps")),
        qk_scale_factor=float(get("qk_scale_factor")),
        output_multiplier=float(get("output_multiplier")),
        final_logit_softcapping=None if softcap is None else float(softcap),
        max_position_embeddings=max_pos,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


# ---------------------------------------------------------------------------
# safetensors


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped; tensors are read on demand."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or header_len > 100 * 2**20:
                raise ValueError(f"{self.path}: not a safetensors file (header length {header_len})")
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self.entries: dict[str, dict[str, Any]] = header
        self._data_start = 8 + header_len
        self._map: np.memmap | None = None

    def names(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a new float32 array (bf16/f16/f64 widened or narrowed)."""
        entry = self.entries[name]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name} has dtype {entry['dtype']}; "
                             f"supported: {', '.join(_SAFETENSORS_DTYPES)}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        raw = self._map[self._data_start + begin:self._data_start + end]
        shape = tuple(entry["shape"])
        values = raw.view(np.dtype(dtype).newbyteorder("<")).reshape(shape)
        if entry["dtype"] == "BF16":
            return (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float32)  # astype copies: nothing points into the map

    def read_stored(self, name: str) -> tuple[str, np.ndarray]:
        """``(dtype tag, array)`` without widening: ``f16`` as float16, ``bf16`` as the
        uint16 bit patterns, ``f32`` as float32 (F64 narrowed to float32). Copies."""
        entry = self.entries[name]
        kind = entry["dtype"]
        if kind == "F16":
            return "f16", self._raw(name, np.float16).copy()
        if kind == "BF16":
            return "bf16", self._raw(name, np.uint16).copy()
        return "f32", self.read(name)

    def read_words(self, name: str) -> np.ndarray:
        """A U32 tensor (MLX packed codes) as a new uint32 array."""
        entry = self.entries[name]
        if entry["dtype"] != "U32":
            raise ValueError(f"{self.path}: tensor {name} has dtype {entry['dtype']}, expected U32 (MLX codes)")
        return self._raw(name, np.uint32).copy()

    def _raw(self, name: str, dtype: Any) -> np.ndarray:
        entry = self.entries[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        raw = self._map[self._data_start + begin:self._data_start + end]
        return raw.view(np.dtype(dtype).newbyteorder("<")).reshape(tuple(entry["shape"]))

    def close(self) -> None:
        self._map = None


def safetensors_files(directory: Path) -> tuple[dict[str, str], list[Path]]:
    """``(weight_map, files)`` of a Hugging Face directory: the safetensors files and, from
    ``model.safetensors.index.json`` when there is one, which file holds each tensor name
    (empty without an index)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / f for f in weight_map.values()})
        return weight_map, files
    single = directory / "model.safetensors"
    files = [single] if single.exists() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no model.safetensors, model.safetensors.index.json "
                                "or *.safetensors file")
    return {}, files


def open_safetensors(directory: Path) -> tuple[dict[str, SafetensorsFile], list[tuple[str, str]]]:
    """The directory's safetensors files, opened (by file name), and ``(stored name, file
    name)`` of every tensor they hold (as the index maps them when there is one)."""
    weight_map, files = safetensors_files(directory)
    opened = {p.name: SafetensorsFile(p) for p in files}
    if weight_map:
        return opened, [(n, Path(f).name) for n, f in weight_map.items()]
    return opened, [(n, fname) for fname, f in opened.items() for n in f.names()]


def canonical_name(name: str) -> str:
    """Strip the wrapper prefix of a checkpoint name (``model.language_model.`` ...)."""
    for prefix in _NAME_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def fp8_scales(stored: list[tuple[str, str]], wanted: set[str]) -> dict[str, tuple[str, str]]:
    """``weight name -> (file, stored name)`` of the FP8 scale tensors (``<x>.weight_scale``,
    compressed-tensors; ``<x>.weight_scale_inv``, HF ``quant_method: fp8``) of wanted weights."""
    found = {}
    for stored_name, fname in stored:
        for suffix in (".weight_scale", ".weight_scale_inv"):
            if stored_name.endswith(suffix):
                weight = canonical_name(stored_name[:-len(suffix)] + ".weight")
                if weight in wanted:
                    found[weight] = (fname, stored_name)
    return found


def fp8_weight_block(quant: dict[str, Any] | None) -> tuple[int, int] | None:
    """The 2-D scale block of an FP8 ``quantization_config``: HF's ``weight_block_size``, or
    the ``block_structure`` of a compressed-tensors weights scheme; None when it names none."""
    if not quant:
        return None
    if quant.get("weight_block_size"):
        bn, bk = quant["weight_block_size"]
        return int(bn), int(bk)
    for group in (quant.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") or {}
        if weights.get("block_structure"):
            bn, bk = weights["block_structure"]
            return int(bn), int(bk)
    return None


class HFTextReader:
    """The text decoder of a Hugging Face Muse Glimmer directory.

    ``read(name)`` returns one float32 weight in transformers layout; nothing
    is loaded before it is asked for.
    """

    source = "hf"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{self.path}: no config.json (not a Hugging Face model directory)")
        raw = json.loads(config_path.read_text())
        text = text_config_dict(raw, str(config_path))
        self.config = text_config_from_dict(text)
        self.name = self.path.name
        self.tokenizer = None
        tied = bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)))

        self._files, stored = open_safetensors(self.path)
        located: dict[str, tuple[str, str]] = {}  # canonical -> (file, stored name)
        wanted = set(text_weight_names(self.config))
        for stored_name, fname in stored:
            canon = canonical_name(stored_name)
            if canon in wanted:
                located[canon] = (fname, stored_name)
        if "lm_head.weight" not in located and tied and "embed_tokens.weight" in located:
            located["lm_head.weight"] = located["embed_tokens.weight"]
        missing = [n for n in text_weight_names(self.config) if n not in located]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"{self.path}: checkpoint lacks text weights {shown}")
        self._located = located
        self._scales = fp8_scales(stored, wanted)
        self._fp8_block = fp8_weight_block(raw.get("quantization_config") or text.get("quantization_config"))
        self.tensor_names = text_weight_names(self.config)
        quantization = raw.get("quantization")  # mlx-lm's converter's key
        self._mlx_quantization = quantization if isinstance(quantization, dict) else None
        self.file_type = self._file_type()

    def _mlx_layout(self, name: str) -> tuple[int, int] | None:
        """``(bits, group_size)`` of an MLX-quantized matrix (its ``.scales`` beside it), else None."""
        fname, stored = self._located[name]
        if not stored.endswith(".weight") or self._mlx_quantization is None:
            return None
        base = stored.removesuffix(".weight")
        if base + ".scales" not in self._files[fname].entries:
            return None
        q = self._mlx_quantization
        own = q.get(base)
        if own is None:  # mlx-lm keys per-module overrides by the module path it saw
            own = next((v for k, v in q.items() if isinstance(v, dict) and canonical_name(k + ".weight") == name),
                       None)
        layout = own if isinstance(own, dict) else q
        mode = layout.get("mode", "affine")
        if mode != "affine":
            raise ValueError(f"{self.path}: {stored} is MLX-quantized in mode {mode!r}; only 'affine' is supported")
        return int(layout["bits"]), int(layout["group_size"])

    def _file_type(self) -> str:
        if self._mlx_quantization is not None:
            bits, group = self._mlx_quantization.get("bits"), self._mlx_quantization.get("group_size")
            return mlx_dtype(int(bits), int(group)) if bits and group else "mlx"
        dtypes = set()
        for fname, stored in self._located.values():
            dtypes.add(self._files[fname].entries[stored]["dtype"].lower())
        if "f8_e4m3" in dtypes:
            return FP8
        return dtypes.pop() if len(dtypes) == 1 else "mixed"

    def _fp8(self, name: str) -> StoredTensor | None:
        """The weight ``name`` as an ``f8_e4m3`` :class:`StoredTensor` when the checkpoint
        stores it in FP8 (e4m3 with a ``weight_scale`` / ``weight_scale_inv`` beside it),
        else None. The scales' layout follows their shape: one value (per tensor),
        ``(rows, 1)`` (per output row) or 2-D blocks of the config's ``weight_block_size``
        (HF ``quant_method: fp8``) / ``block_structure`` (compressed-tensors)."""
        fname, stored = self._located[name]
        entry = self._files[fname].entries[stored]
        if entry["dtype"] != "F8_E4M3":
            return None
        if name not in self._scales:
            raise ValueError(f"{self.path}: {stored} is FP8 but has no weight_scale or weight_scale_inv")
        rows, cols = want = expected_shape(self.config, name)
        bits = self._files[fname]._raw(stored, np.uint8).copy()
        if bits.shape != want:
            raise ValueError(f"{self.path}: {stored} has shape {bits.shape}, expected {want}")
        sfile, sname = self._scales[name]
        scales = self._files[sfile].read(sname)
        if scales.size == 1:
            block, scales = (rows, cols), scales.reshape(1, 1)
        elif scales.reshape(-1).shape[0] == rows and scales.ndim <= 2 and (scales.ndim == 1 or scales.shape[1] == 1):
            block, scales = (1, cols), scales.reshape(rows, 1)
        else:
            if self._fp8_block is None:
                raise ValueError(f"{self.path}: {sname} has shape {scales.shape} but the config names no "
                                 "weight block size")
            block = self._fp8_block
            expect = (-(-rows // block[0]), -(-cols // block[1]))
            if scales.shape != expect:
                raise ValueError(f"{self.path}: {sname} has shape {scales.shape}, expected {expect} for blocks "
                                 f"of {block[0]} x {block[1]}")
        return StoredTensor(name, FP8, want, bits, scales=np.ascontiguousarray(scales, dtype=np.float32),
                            scale_block=block)

    def read(self, name: str) -> np.ndarray:
        fp8 = self._fp8(name)
        if fp8 is not None:
            return fp8.to_float32()
        if len(expected_shape(self.config, name)) == 2 and self._mlx_layout(name) is not None:
            return self.read_stored(name).to_float32()
        fname, stored = self._located[name]
        array = self._files[fname].read(stored)
        want = expected_shape(self.config, name)
        if array.shape != want:
            raise ValueError(f"{self.path}: {stored} has shape {array.shape}, expected {want}")
        return array

    def read_stored(self, name: str) -> StoredTensor:
        """One weight as stored (``f16``, ``bf16`` or ``f32``); 1-D tensors always ``f32``."""
        want = expected_shape(self.config, name)
        if len(want) == 1:
            return StoredTensor(name, "f32", want, self.read(name))
        fp8 = self._fp8(name)
        if fp8 is not None:
            return fp8
        fname, stored = self._located[name]
        layout = self._mlx_layout(name)
        if layout is not None:
            return self._read_mlx(name, want, layout)
        dtype, array = self._files[fname].read_stored(stored)
        if array.shape != want:
            raise ValueError(f"{self.path}: {stored} has shape {array.shape}, expected {want}")
        return StoredTensor(name, dtype, want, array)

    def _read_mlx(self, name: str, want: tuple[int, ...], layout: tuple[int, int]) -> StoredTensor:
        bits, group = layout
        fname, stored = self._located[name]
        f, base = self._files[fname], stored.removesuffix(".weight")
        words = f.read_words(stored)
        scales, biases = f.read(base + ".scales"), f.read(base + ".biases")
        rows, cols = want
        if words.shape != (rows, cols * bits // 32) or scales.shape != (rows, cols // group) \
                or biases.shape != scales.shape:
            raise ValueError(f"{self.path}: {stored} is not a {bits}-bit, group {group} MLX matrix of shape "
                             f"{want} (words {words.shape}, scales {scales.shape}, biases {biases.shape})")
        return StoredTensor(name, mlx_dtype(bits, group), want, words, scales=scales, biases=biases)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

