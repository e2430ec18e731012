"""Write a Muse Glimmer text model as GGUF, in llama.cpp's converter layout.

Used by the tests to build the GGUF twin of a Hugging Face checkpoint and by
``musegl make-tiny``. The file is written tensor by tensor (tensor infos
first, then each tensor's data), so only one converted tensor is in memory at
a time.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Mapping

import gguf
import numpy as np

from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.gguf_reader import ARCH, FUSED_QKV, gguf_name, permute_rope_rows
from musegl_core.checkpoint.hf_reader import CENTERED_NORMS, expected_shape, text_weight_names
from musegl_core.checkpoint.tokenizer_data import GGUFTokenizerData

Progress = Callable[[int, int, str], None]

# file_type name -> (general.file_type, tensor type of the matrices)
FILE_TYPES = {
    "f32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
    "f16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    "bf16": (gguf.LlamaFileType.MOSTLY_BF16, gguf.GGMLQuantizationType.BF16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
    "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, gguf.GGMLQuantizationType.Q4_0),
}


def _gguf_tensors(config: TextConfig, weights: Mapping[str, np.ndarray],
                  fuse_qkv: bool) -> Iterator[tuple[str, Callable[[], np.ndarray], tuple[int, ...]]]:
    """``(gguf name, make float32 tensor, torch-order shape)`` for every tensor, in file order.

    The tensors are produced lazily so that the writer converts one at a time.
    """
    hd = config.head_dim

    def converted(name: str) -> np.ndarray:
        w = np.asarray(weights[name], dtype=np.float32)
        suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if suffix == "self_attn.q_proj.weight":
            return permute_rope_rows(w, config.num_heads)
        if suffix == "self_attn.k_proj.weight":
            return permute_rope_rows(w, config.num_kv_heads)
        if suffix in CENTERED_NORMS:
            return w + np.float32(1.0)  # the +1 baked in, in float32
        return w

    def qk_norms(block: str) -> Iterator[tuple[str, Callable[[], np.ndarray], tuple[int, ...]]]:
        # llama.cpp's generic "rms(x)·w" reproduces the scale-less norm × qk_scale_factor.
        yield (f"{block}.attn_q_norm.weight",
               lambda: np.full(hd, config.qk_scale_factor, dtype=np.float32), (hd,))
        yield f"{block}.attn_k_norm.weight", lambda: np.ones(hd, dtype=np.float32), (hd,)

    qkv = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
    for name in text_weight_names(config):
        if not name.startswith("layers."):
            yield gguf_name(name), lambda name=name: converted(name), expected_shape(config, name)
            continue
        _, index, suffix = name.split(".", 2)
        block = f"blk.{index}"
        if fuse_qkv and suffix in qkv:
            if suffix == qkv[0]:  # rows [q (permuted); k (permuted); v]
                parts = [f"layers.{index}.{s}" for s in qkv]
                rows = sum(expected_shape(config, p)[0] for p in parts)
                yield (f"{block}.{FUSED_QKV}",
                       lambda parts=parts: np.concatenate([converted(p) for p in parts]),
                       (rows, config.hidden_size))
                yield from qk_norms(block)
            continue
        yield gguf_name(name), lambda name=name: converted(name), expected_shape(config, name)
        if suffix == "self_attn.k_proj.weight":
            yield from qk_norms(block)


def _tensor_type(name: str, shape: tuple[int, ...],
                 matrix_type: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The converter's dtype policy: 1-D and ``*_norm.weight`` in F32; matrices in the
    file type, falling back to F16 when a row does not fit the quantization blocks."""
    if len(shape) == 1 or name.endswith("_norm.weight"):
        return gguf.GGMLQuantizationType.F32
    if matrix_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return matrix_type
    block, _ = gguf.GGML_QUANT_SIZES[matrix_type]
    return matrix_type if shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16


def _encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(values, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return np.ascontiguousarray(values, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)


def _nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> tuple[tuple[int, ...], int]:
    """``(stored numpy shape, bytes)`` of a tensor of torch-order ``shape``."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return shape, int(np.prod(shape)) * 4
    if qtype == gguf.GGMLQuantizationType.F16:
        return shape, int(np.prod(shape)) * 2
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    return byte_shape, int(np.prod(byte_shape))


def add_decoder_metadata(writer: gguf.GGUFWriter, config: Any, file_type: gguf.LlamaFileType, name: str) -> None:
    """The keys every decoder GGUF of the converter's layout has: the model type, name and
    file type, and the shape (layers, context, widths, heads, head size, RoPE base, RMS
    epsilon) of ``config``, a :class:`TextConfig` or any config with those fields (the
    DFlash draft's)."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _add_metadata(writer: gguf.GGUFWriter, config: TextConfig, file_type: gguf.LlamaFileType,
                  name: str) -> None:
    if config.rope != config.sliding:
        raise ValueError("GGUF cannot express a layout where RoPE layers differ from sliding layers "
                         "(llama.cpp applies RoPE exactly on SWA layers)")
    add_decoder_metadata(writer, config, file_type, name)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_logit_scale(config.output_multiplier)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([bool(s) for s in config.sliding])


def add_tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer: GGUFTokenizerData,
                           vocab_size: int | None = None) -> None:
    """Write the ``tokenizer.ggml.*`` keys; ``vocab_size``, when
    given, must equal the token list's length."""
    vocab_size = len(tokenizer.tokens) if vocab_size is None else vocab_size
    if len(tokenizer.tokens) != vocab_size or len(tokenizer.token_types) != vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer.tokens)} tokens and "
                         f"{len(tokenizer.token_types)} token types; the model's vocabulary is {vocab_size}")
    writer.add_tokenizer_model(tokenizer.model)
    writer.add_tokenizer_pre(tokenizer.pre)
    writer.add_token_list(list(tokenizer.tokens))
    writer.add_token_types(list(tokenizer.token_types))
    if tokenizer.merges:
        writer.add_token_merges(list(tokenizer.merges))
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.eot_token_id is not None:
        writer.add_eot_token_id(tokenizer.eot_token_id)
    if tokenizer.padding_token_id is not None:
        writer.add_pad_token_id(tokenizer.padding_token_id)
    if tokenizer.mask_token_id is not None:
        writer.add_mask_token_id(tokenizer.mask_token_id)
    writer.add_add_bos_token(tokenizer.add_bos_token)
    writer.add_add_eos_token(tokenizer.add_eos_token)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)


def write_text_gguf(
    path: str | os.PathLike[str],
    config: TextConfig,
    weights: Mapping[str, np.ndarray],
    tokenizer: GGUFTokenizerData | None,
    *,
    file_type: str = "f32",
    name: str = "Muse Glimmer",
    fuse_qkv: bool = False,
    progress: Progress | None = None,
) -> None:
    """Write the text decoder ``weights`` (transformers names and layout) as a GGUF file.

    ``weights`` maps the names of :func:`~musegl_core.checkpoint.hf_reader.text_weight_names`
    to arrays; it may be lazy (each value is read once, when its tensor is written).
    ``file_type`` picks the matrix dtype (``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``); norms and
    1-D tensors are always F32. ``fuse_qkv`` writes ``attn_qkv`` instead of
    ``attn_q/k/v``. ``progress(done, total, name)`` is called after each tensor.
    """
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type {file_type!r} is not one of {', '.join(FILE_TYPES)}")
    missing = [n for n in text_weight_names(config) if n not in weights]
    if missing:
        raise ValueError(f"weights lack {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    for n in text_weight_names(config):
        if tuple(np.shape(weights[n])) != expected_shape(config, n):
            raise ValueError(f"{n} has shape {tuple(np.shape(weights[n]))}, "
                             f"expected {expected_shape(config, n)}")
    ftype, matrix_type = FILE_TYPES[file_type]

    writer = gguf.GGUFWriter(os.fspath(path), ARCH)
    try:
        _add_metadata(writer, config, ftype, name)
        if tokenizer is not None:  # None: the tokenizer lives beside the file (tokenizer.json)
            add_tokenizer_metadata(writer, tokenizer, config.vocab_size)
        plan = []
        for tensor_name, make, shape in _gguf_tensors(config, weights, fuse_qkv):
            qtype = _tensor_type(tensor_name, shape, matrix_type)
            stored_shape, nbytes = _nbytes(shape, qtype)
            stored_dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else (
                np.float16 if qtype == gguf.GGMLQuantizationType.F16 else np.uint8)
            writer.add_tensor_info(tensor_name, stored_shape, np.dtype(stored_dtype), nbytes,
                                   raw_dtype=None if stored_dtype != np.uint8 else qtype)
            plan.append((tensor_name, make, qtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for done, (tensor_name, make, qtype) in enumerate(plan, start=1):
            writer.write_tensor_data(_encode(make(), qtype))
            if progress is not None:
                progress(done, len(plan), tensor_name)
    finally:
        writer.close()
