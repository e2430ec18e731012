"""The DFlash draft checkpoint: its configuration and weights, from a Hugging Face
directory or a DFlash GGUF, numpy only.

Both sources give the same float32 weights under transformers'
``MuseGlimmerAssistantModel`` names (``encoder.fc.weight``,
``layers.N.self_attn.q_proj.weight``, ``norm.weight`` ...). The GGUF form needs
no transformation (no +1, no Q/K permutation): only names change, and the
tapped layers are stored as layer *inputs* (``target_layer_ids + 1``).

:func:`write_draft_gguf` writes the GGUF form the way llama.cpp's converter
does; tests and the benchmark use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import attrs
import numpy as np

ARCH = "dflash"
DEFAULT_THETA = 500000.0  # MuseGlimmerAssistantConfig.default_theta

# transformers' MuseGlimmerAssistantConfig class defaults.
CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_size": 6656,
    "intermediate_size": 19968,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "sliding_window": 2048,
    "block_size": 16,
    "mask_token_id": 201818,
    "target_layer_ids": [1, 13, 25, 37, 49],
}

LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
# transformers name (global, or per-layer suffix) -> GGUF name (suffix after ``blk.N.``)
GGUF_NAMES = {
    "encoder.fc.weight": "fc.weight",
    "encoder.output_norm_enc.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",  # the pre-FFN norm
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


@attrs.frozen
class DraftConfig:
    """The assistant model's hyper-parameters (transformers' ``MuseGlimmerAssistantConfig``).

    ``target_layer_ids`` follow transformers: the target layers whose
    *outputs* are tapped. :attr:`taps` gives the same tensors in the engine's
    convention (layer inputs, ``id + 1``). ``sliding[i]`` marks sliding-window
    layers; ``sliding_window`` is None when no layer has a window.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    sliding: tuple[bool, ...]
    sliding_window: int | None = 2048
    block_size: int = 16
    mask_token_id: int = 201818
    rope_theta: float = DEFAULT_THETA
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    #: The vocabulary size the file declares (a GGUF's token list), None when unknown (HF).
    vocab_size: int | None = None

    def __attrs_post_init__(self) -> None:
        if len(self.sliding) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.sliding)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose *input* residual the draft reads (``target_layer_ids + 1``)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def weight_names(self) -> tuple[str, ...]:
        names = ["encoder.fc.weight", "encoder.output_norm_enc.weight"]
        for i in range(self.num_layers):
            names.extend(f"layers.{i}.{suffix}" for suffix in LAYER_WEIGHTS)
        names.append("norm.weight")
        return tuple(names)

    def expected_shape(self, name: str) -> tuple[int, ...]:
        h, hd, f = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
        return {
            "encoder.fc.weight": (h, len(self.target_layer_ids) * h),
            "encoder.output_norm_enc.weight": (h,),
            "norm.weight": (h,),
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "self_attn.q_norm.weight": (hd,),
            "self_attn.k_norm.weight": (hd,),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }[suffix]

    def kv_bytes_per_position(self, element_size: int) -> int:
        """Bytes of draft context K/V one position takes over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element_size


def config_from_dict(raw: Mapping[str, Any], where: str = "config.json") -> DraftConfig:
    """A :class:`DraftConfig` from an assistant ``config.json`` dict."""
    if raw.get("model_type") != "muse_glimmer_assistant":
        raise ValueError(f"{where}: model_type is {raw.get('model_type')!r}, expected 'muse_glimmer_assistant'")

    def get(key: str) -> Any:
        return raw[key] if raw.get(key) is not None else CONFIG_DEFAULTS[key]

    n = int(get("num_hidden_layers"))
    layer_types = raw.get("layer_types") or ["sliding_attention"] * n
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"{where}: unknown layer_types {sorted(unknown)}")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{where}: rope_type {rope.get('rope_type')!r} is not supported (the assistant uses 'default')")
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    window = raw["sliding_window"] if "sliding_window" in raw else CONFIG_DEFAULTS["sliding_window"]
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    if window is None:
        sliding = tuple(False for _ in sliding)
    return DraftConfig(
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads")),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        target_layer_ids=tuple(int(i) for i in get("target_layer_ids")),
        sliding=sliding,
        sliding_window=None if window is None else int(window),
        block_size=int(get("block_size")),
        mask_token_id=int(get("mask_token_id")),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", DEFAULT_THETA))),
        rms_norm_eps=float(get("rms_norm_eps")),
        max_position_embeddings=int(get("max_position_embeddings")),
    )


# ---------------------------------------------------------------------------
# readers


class HFDraftReader:
    """An assistant model saved by transformers: ``config.json`` + safetensors."""

    source = "hf"

    def __init__(self, path: Path) -> None:
        from musegl_core.checkpoint.hf_reader import open_safetensors

        self.path = path
        config_path = path / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
        self.config = config_from_dict(json.loads(config_path.read_text()), str(config_path))
        self._files, stored = open_safetensors(path)
        self._located = {name.removeprefix("model."): (fname, name) for name, fname in stored}
        missing = [n for n in self.config.weight_names() if n not in self._located]
        if missing:
            raise ValueError(f"{path}: the draft checkpoint lacks {', '.join(missing[:3])}"
                             + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))

    def read(self, name: str) -> np.ndarray:
        fname, stored = self._located[name]
        return self._files[fname].read(stored)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def gguf_name(name: str) -> str:
    if name.startswith("layers."):
        _, index, suffix = name.split(".", 2)
        return f"blk.{index}.{GGUF_NAMES[suffix]}"
    return GGUF_NAMES[name]


class GGUFDraftReader:
    """A DFlash GGUF (``general.architecture = "dflash"``), tensors taken as stored."""

    source = "gguf"

    def __init__(self, path: Path, *, tensors: bool = True) -> None:
        from musegl_core.checkpoint.gguf_file import GGUFFile

        self.path = path
        self._file = GGUFFile(path, wanted=("general.", f"{ARCH}.", "tokenizer.ggml.mask_token_id",
                                            "tokenizer.ggml.tokens"), tensors=tensors)
        fields = self._file.fields
        arch = fields.get("general.architecture")
        if arch != ARCH:
            raise ValueError(f"{path}: general.architecture is {arch!r}, expected {ARCH!r} (a DFlash draft GGUF)")

        def key(suffix: str, default: Any = None) -> Any:
            value = fields.get(f"{ARCH}.{suffix}", default)
            if value is None:
                raise ValueError(f"{path}: missing {ARCH}.{suffix}")
            return value

        n = int(key("block_count"))
        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        window = fields.get(f"{ARCH}.attention.sliding_window")
        pattern = fields.get(f"{ARCH}.attention.sliding_window_pattern")
        if window is None:
            sliding = tuple(False for _ in range(n))
        elif pattern is None:
            sliding = tuple(True for _ in range(n))
        else:
            sliding = tuple(bool(s) for s in pattern)
        mask = fields.get("tokenizer.ggml.mask_token_id")
        tokens = fields.get("tokenizer.ggml.tokens")
        self.config = DraftConfig(
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv")),
            head_dim=int(fields.get(f"{ARCH}.attention.key_length") or hidden // heads),
            target_layer_ids=tuple(int(i) - 1 for i in key("target_layers")),  # stored as layer inputs
            sliding=sliding,
            sliding_window=None if window is None else int(window),
            block_size=int(key("block_size")),
            mask_token_id=int(CONFIG_DEFAULTS["mask_token_id"] if mask is None else mask),
            rope_theta=float(fields.get(f"{ARCH}.rope.freq_base", DEFAULT_THETA)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(key("context_length", 131072)),
            vocab_size=None if tokens is None else len(tokens),
        )
        if tensors:
            missing = [n for n in self.config.weight_names() if gguf_name(n) not in self._file.tensors]
            if missing:
                raise ValueError(f"{path}: the draft GGUF lacks {', '.join(gguf_name(n) for n in missing[:3])}")

    def read(self, name: str) -> np.ndarray:
        from musegl_core.checkpoint.gguf_reader import dequantize_rows

        return dequantize_rows(self._file.tensors[gguf_name(name)])

    def close(self) -> None:
        self._file.close()


class DraftCheckpoint:
    """A draft checkpoint, opened: ``config``, and :meth:`iter_weights` (float32, checked shapes)."""

    def __init__(self, path: str | os.PathLike[str], *, tensors: bool = True) -> None:
        p = Path(path)
        if p.is_dir():
            self.reader: HFDraftReader | GGUFDraftReader = HFDraftReader(p)
        elif p.is_file():
            with open(p, "rb") as f:
                magic = f.read(4)
            if magic != b"GGUF":
                raise ValueError(f"{p}: not a GGUF file and not a Hugging Face model directory")
            self.reader = GGUFDraftReader(p, tensors=tensors)
        else:
            raise FileNotFoundError(f"{p}: no such draft checkpoint")
        self.path = p
        self.config = self.reader.config
        self.source = self.reader.source

    def iter_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.config.weight_names():
            array = self.reader.read(name)
            want = self.config.expected_shape(name)
            if array.shape != want:
                raise ValueError(f"{self.path}: {name} has shape {array.shape}, expected {want}")
            yield name, array

    def close(self) -> None:
        self.reader.close()


def read_draft_config(path: str | os.PathLike[str]) -> DraftConfig:
    """The draft's configuration alone (no tensor is read)."""
    checkpoint = DraftCheckpoint(path, tensors=False)
    try:
        return checkpoint.config
    finally:
        checkpoint.close()


# ---------------------------------------------------------------------------
# writer


def write_draft_gguf(path: str | os.PathLike[str], config: DraftConfig, weights: Mapping[str, np.ndarray],
                     tokenizer=None, *, file_type: str = "f32", name: str = "DFlash draft") -> None:
    """Write a draft as llama.cpp's converter lays out a DFlash GGUF.

    ``weights`` uses transformers names; ``tokenizer`` (a
    :class:`~musegl_core.checkpoint.tokenizer_data.GGUFTokenizerData` of the
    *target*) is copied into the metadata with ``mask_token_id`` set, as the
    converter does. ``file_type`` is ``f32`` or ``f16`` for the matrices; norms stay F32.
    """
    import gguf

    from musegl_core.checkpoint.gguf_writer import add_decoder_metadata, add_tokenizer_metadata

    if file_type not in ("f32", "f16"):
        raise ValueError(f"file_type {file_type!r} is not f32 or f16")
    writer = gguf.GGUFWriter(os.fspath(path), ARCH)
    try:
        add_decoder_metadata(writer, config, gguf.LlamaFileType.ALL_F32 if file_type == "f32"
                             else gguf.LlamaFileType.MOSTLY_F16, name)
        writer.add_uint32(f"{ARCH}.block_size", config.block_size)
        writer.add_array(f"{ARCH}.target_layers", [int(i) for i in config.taps])
        if config.sliding_window is not None:
            writer.add_sliding_window(config.sliding_window)
            writer.add_sliding_window_pattern([bool(s) for s in config.sliding])
        if tokenizer is not None:
            add_tokenizer_metadata(writer, attrs.evolve(tokenizer, mask_token_id=config.mask_token_id))
        else:
            writer.add_mask_token_id(config.mask_token_id)
        for weight in config.weight_names():
            array = np.asarray(weights[weight], dtype=np.float32)
            if array.shape != config.expected_shape(weight):
                raise ValueError(f"{weight} has shape {array.shape}, expected {config.expected_shape(weight)}")
            if array.ndim == 1 or file_type == "f32":
                writer.add_tensor(gguf_name(weight), np.ascontiguousarray(array))
            else:
                writer.add_tensor(gguf_name(weight), np.ascontiguousarray(array, dtype=np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
