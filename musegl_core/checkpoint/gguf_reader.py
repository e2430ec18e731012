"""GGUF text checkpoints in llama.cpp's Muse Glimmer layout.

The converter stores Q/K rows permuted for interleaved RoPE, bakes ``+1`` into
the four per-layer norms and synthesizes ``attn_q_norm`` (all
``qk_scale_factor``) and ``attn_k_norm`` (ones). :class:`GGUFTextReader`
undoes all of it, so weights come out exactly as transformers names and lays
them out. The layout helpers (:data:`GGUF_NAMES`, :func:`permute_rope_rows`,
:func:`unpermute_rope_rows`) are shared with the writer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.gguf_file import GGUFFile
from musegl_core.checkpoint.hf_reader import CENTERED_NORMS, expected_shape, text_weight_names
from musegl_core.checkpoint.stored import StoredTensor, stored_from_gguf, unpermute_stored_rows
from musegl_core.checkpoint.tokenizer_data import GGUFTokenizerData

ARCH = "muse-glimmer"

# transformers name (per-layer suffix or global name) -> GGUF name (suffix after ``blk.N.``).
GGUF_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.gate_proj.weight": "attn_gate.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
FUSED_QKV = "attn_qkv.weight"


def gguf_name(name: str) -> str:
    """The GGUF tensor name of a transformers weight name."""
    if name.startswith("layers."):
        _, index, suffix = name.split(".", 2)
        return f"blk.{index}.{GGUF_NAMES[suffix]}"
    return GGUF_NAMES[name]


def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """transformers → GGUF: per head, new row ``2j+s`` takes old row ``s·half+j``."""
    out, inp = weight.shape
    hd = out // n_heads
    return weight.reshape(n_heads, 2, hd // 2, inp).swapaxes(1, 2).reshape(out, inp)


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """GGUF → transformers: the inverse of :func:`permute_rope_rows`."""
    out, inp = weight.shape
    hd = out // n_heads
    return weight.reshape(n_heads, hd // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def file_type_name(ftype: int) -> str:
    """``general.file_type`` as a short name (``f32``, ``q8_0``, ``q4_k_m`` ...)."""
    try:
        name = gguf.LlamaFileType(ftype).name
    except ValueError:
        return f"type{ftype}"
    return name.removeprefix("ALL_").removeprefix("MOSTLY_").lower()


def dequantize_rows(tensor: Any, rows: slice | None = None) -> np.ndarray:
    """A GGUF tensor (optionally a slice of its rows) as float32 in torch order.

    Rows can be sliced before decoding because quantization blocks run along
    the input dimension, one row at a time.
    """
    qtype = tensor.tensor_type
    data = tensor.data if rows is None else tensor.data[rows]
    try:
        values = gguf.quants.dequantize(data, qtype)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {tensor.name}: type {qtype.name} cannot be decoded "
                         "(gguf.quants has no dequantizer for it)") from None
    ne = [int(n) for n in tensor.shape]
    shape = tuple(reversed(ne))
    if rows is not None:
        shape = (data.shape[0],) + shape[1:]
    return np.array(values, dtype=np.float32, copy=True).reshape(shape)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None else value


def _require(reader: GGUFFile, key: str, path: Path) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"{path}: GGUF lacks required metadata key {key!r}")
    return value


def read_tokenizer(reader: GGUFFile, path: Path) -> GGUFTokenizerData | None:
    """The ``tokenizer.ggml.*`` metadata, or None if the file has no token list."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        return None
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    opt = lambda key: _field(reader, key)  # noqa: E731
    return GGUFTokenizerData(
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in types),
        merges=tuple(_field(reader, "tokenizer.ggml.merges") or ()),
        bos_token_id=int(_require(reader, "tokenizer.ggml.bos_token_id", path)),
        eos_token_id=int(_require(reader, "tokenizer.ggml.eos_token_id", path)),
        eot_token_id=None if opt("tokenizer.ggml.eot_token_id") is None else int(opt("tokenizer.ggml.eot_token_id")),
        padding_token_id=(None if opt("tokenizer.ggml.padding_token_id") is None
                          else int(opt("tokenizer.ggml.padding_token_id"))),
        mask_token_id=(None if opt("tokenizer.ggml.mask_token_id") is None
                       else int(opt("tokenizer.ggml.mask_token_id"))),
        model=opt("tokenizer.ggml.model") or "gpt2",
        pre=opt("tokenizer.ggml.pre") or "default",
        add_bos_token=bool(opt("tokenizer.ggml.add_bos_token") or False),
        add_eos_token=bool(opt("tokenizer.ggml.add_eos_token") or False),
        chat_template=opt("tokenizer.chat_template"),
    )


def sliding_layout(pattern: Any, num_layers: int) -> tuple[bool, ...]:
    """``attention.sliding_window_pattern`` as one flag per layer (True = sliding).

    An array is taken as is; an integer ``n`` (or an absent key, ``n = 4``)
    follows llama.cpp: layer ``i`` is sliding when ``n == 0`` or ``i % n < n - 1``.
    """
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return tuple(bool(p) for p in pattern)
    n = 4 if pattern is None else int(pattern)
    return tuple(n == 0 or i % n < n - 1 for i in range(num_layers))


class GGUFTextReader:
    """A ``muse-glimmer`` GGUF text model, read one tensor at a time.

    ``read(name)`` takes a transformers name and returns float32 weights in
    transformers layout (Q/K un-permuted, centered norms without the +1).
    """

    source = "gguf"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        reader = GGUFFile(self.path)
        self._reader = reader
        arch = _field(reader, "general.architecture")
        if arch != ARCH:
            raise ValueError(f"{self.path}: GGUF architecture is {arch!r}; musegl reads "
                             f"{ARCH!r} text models (general.type={_field(reader, 'general.type')!r})")
        self._tensors = reader.tensors
        self.tokenizer = read_tokenizer(reader, self.path)
        self.name = _field(reader, "general.name") or self.path.stem
        self.file_type = file_type_name(int(_field(reader, "general.file_type", 0)))
        self.fused_qkv = f"blk.0.{FUSED_QKV}" in self._tensors
        self.config = self._read_config()
        self.tensor_names = text_weight_names(self.config)

    def _key(self, suffix: str, default: Any = None, required: bool = False) -> Any:
        key = f"{ARCH}.{suffix}"
        return _require(self._reader, key, self.path) if required else _field(self._reader, key, default)

    def _tensor(self, name: str) -> Any:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ValueError(f"{self.path}: GGUF lacks tensor {name!r}")
        return tensor

    def _read_config(self) -> TextConfig:
        n = int(self._key("block_count", required=True))
        hidden = int(self._key("embedding_length", required=True))
        heads = int(self._key("attention.head_count", required=True))
        head_dim = int(self._key("attention.key_length", hidden // heads))
        value_length = int(self._key("attention.value_length", head_dim))
        if value_length != head_dim:
            raise ValueError(f"{self.path}: key_length {head_dim} != value_length {value_length}")
        sliding = sliding_layout(self._key("attention.sliding_window_pattern"), n)
        softcap = self._key("final_logit_softcapping")
        vocab = int(self._tensor("token_embd.weight").shape[1])
        tok = self.tokenizer
        return TextConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._key("feed_forward_length", required=True)),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=int(self._key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            sliding_window=int(self._key("attention.sliding_window", required=True)),
            sliding=sliding,
            rope=sliding,  # llama.cpp: RoPE on SWA layers, NoPE on the others
            rope_theta=float(self._key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(self._key("attention.layer_norm_rms_epsilon", 1e-5)),
            qk_scale_factor=self._qk_scale_factor(n),
            output_multiplier=float(self._key("logit_scale", required=True)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            max_position_embeddings=int(self._key("context_length", required=True)),
            bos_token_id=None if tok is None else tok.bos_token_id,
            eos_token_ids=() if tok is None else (tok.eos_token_id,),
        )

    def _qk_scale_factor(self, num_layers: int) -> float:
        """The one value every ``attn_q_norm`` element holds; ``attn_k_norm`` must be ones."""
        scale: float | None = None
        for i in range(num_layers):
            q = dequantize_rows(self._tensor(f"blk.{i}.attn_q_norm.weight"))
            k = dequantize_rows(self._tensor(f"blk.{i}.attn_k_norm.weight"))
            if not np.all(q == q.flat[0]):
                raise ValueError(f"{self.path}: blk.{i}.attn_q_norm.weight is not constant; "
                                 "Muse Glimmer's QK norm is scale-less times qk_scale_factor")
            if scale is None:
                scale = float(q.flat[0])
            elif float(q.flat[0]) != scale:
                raise ValueError(f"{self.path}: attn_q_norm differs between layers "
                                 f"({scale} vs {float(q.flat[0])} at blk.{i})")
            if not np.all(k == 1.0):
                raise ValueError(f"{self.path}: blk.{i}.attn_k_norm.weight is not all ones")
        assert scale is not None
        return scale

    def read_stored(self, name: str) -> StoredTensor:
        """One weight in its stored dtype (f16/bf16/quantized blocks), transformers layout;
        1-D tensors (norms) as float32 through :meth:`read`."""
        config = self.config
        want = expected_shape(config, name)
        if len(want) == 1:
            return StoredTensor(name, "f32", want, self.read(name))
        if not name.startswith("layers."):
            stored = stored_from_gguf(name, self._tensor(gguf_name(name)))
        else:
            _, index, suffix = name.split(".", 2)
            fused = self._fused_rows(suffix)
            if self.fused_qkv and fused is not None:
                stored = stored_from_gguf(name, self._tensor(f"blk.{index}.{FUSED_QKV}"), fused)
            else:
                stored = stored_from_gguf(name, self._tensor(gguf_name(name)))
            if suffix == "self_attn.q_proj.weight":
                stored = unpermute_stored_rows(stored, config.num_heads)
            elif suffix == "self_attn.k_proj.weight":
                stored = unpermute_stored_rows(stored, config.num_kv_heads)
        if stored.shape != want:
            raise ValueError(f"{self.path}: {name} has shape {stored.shape}, expected {want}")
        return stored

    def _fused_rows(self, suffix: str) -> slice | None:
        config = self.config
        q_rows = config.num_heads * config.head_dim
        kv_rows = config.num_kv_heads * config.head_dim
        return {"self_attn.q_proj.weight": slice(0, q_rows),
                "self_attn.k_proj.weight": slice(q_rows, q_rows + kv_rows),
                "self_attn.v_proj.weight": slice(q_rows + kv_rows, q_rows + 2 * kv_rows)}.get(suffix)

    def read(self, name: str) -> np.ndarray:
        config = self.config
        if not name.startswith("layers."):
            weight = dequantize_rows(self._tensor(gguf_name(name)))
        else:
            _, index, suffix = name.split(".", 2)
            block = f"blk.{index}"
            q_rows = config.num_heads * config.head_dim
            kv_rows = config.num_kv_heads * config.head_dim
            fused = {"self_attn.q_proj.weight": slice(0, q_rows),
                     "self_attn.k_proj.weight": slice(q_rows, q_rows + kv_rows),
                     "self_attn.v_proj.weight": slice(q_rows + kv_rows, q_rows + 2 * kv_rows)}
            if self.fused_qkv and suffix in fused:
                weight = dequantize_rows(self._tensor(f"{block}.{FUSED_QKV}"), fused[suffix])
            else:
                weight = dequantize_rows(self._tensor(gguf_name(name)))
            if suffix == "self_attn.q_proj.weight":
                weight = unpermute_rope_rows(weight, config.num_heads)
            elif suffix == "self_attn.k_proj.weight":
                weight = unpermute_rope_rows(weight, config.num_kv_heads)
            elif suffix in CENTERED_NORMS:
                weight = weight - np.float32(1.0)
        want = expected_shape(config, name)
        if weight.shape != want:
            raise ValueError(f"{self.path}: {name} has shape {weight.shape}, expected {want}")
        return np.ascontiguousarray(weight, dtype=np.float32)

    def close(self) -> None:
        self._tensors = {}
        self._reader = None  # type: ignore[assignment]
