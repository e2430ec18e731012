"""The vision tower, adapter and projection of a checkpoint.

Two sources, numpy only, the same weights under the same names:

* a Hugging Face directory whose ``config.json`` has a ``vision_config``
  (``model.vision_tower.*``, ``model.vision_adapter.*``,
  ``model.vision_projection.*``);
* a projector GGUF in llama.cpp's converter layout (``general.type =
  "mmproj"``, ``clip.projector_type = "muse-glimmer"``), given beside a GGUF
  text model with ``--mmproj``. Its Q/K rows (weights and biases) are
  un-permuted back to transformers' rotate_half layout.

Names are transformers' vision-tower names without ``model.vision_tower.``,
plus ``adapter.fc1.weight``, ``adapter.fc2.weight`` and
``projection.weight``. One difference: ``patch_embedding.weight`` is the
**temporal-summed** kernel ``(hidden, 588)`` (columns ``ch·196 + py·14 +
px``) that the GGUF stores; for still images ``W_t0·x + W_t1·x = (W_t0 +
W_t1)·x``, so the tower takes one frame per patch row (the preprocessing
produces exactly that).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

import attrs
import numpy as np

from musegl_core.checkpoint.gguf_file import GGUFFile
from musegl_core.checkpoint.gguf_reader import dequantize_rows, permute_rope_rows, unpermute_rope_rows
from musegl_core.checkpoint.hf_reader import open_safetensors

PROJECTOR_TYPE = "muse-glimmer"
PATCH_SIZE = 14
MERGE_SIZE = 2
FRAME = 3 * PATCH_SIZE * PATCH_SIZE  # 588


@attrs.frozen
class VisionConfig:
    """Hyper-parameters of the vision tower and projector.

    ``full[i]`` is True for a full-attention layer (else window attention over
    ``pos_side x pos_side`` patch windows); ``pos_side`` is the side of the
    learned position table; ``text_hidden_size`` the projection's output.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    pos_side: int
    full: tuple[bool, ...]
    out_hidden_size: int
    projector_hidden_size: int
    text_hidden_size: int
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    patch_size: int = PATCH_SIZE
    merge_size: int = MERGE_SIZE

    def __attrs_post_init__(self) -> None:
        if len(self.full) != self.num_layers:
            raise ValueError("full must have one entry per vision layer")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError("the vision head dim must be a multiple of 4 (axial 2-D RoPE)")
        if self.patch_size != PATCH_SIZE or self.merge_size != MERGE_SIZE:
            raise ValueError(f"vision patch {self.patch_size} / merge {self.merge_size} are not supported "
                             f"(musegl preprocesses {PATCH_SIZE}-pixel patches merged {MERGE_SIZE}x{MERGE_SIZE})")
        if self.out_hidden_size != self.hidden_size * self.merge_size ** 2:
            raise ValueError(f"out_hidden_size {self.out_hidden_size} != 4 x vision hidden {self.hidden_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @staticmethod
    def default_full(num_layers: int) -> tuple[bool, ...]:
        """Full attention on every 4th layer and the last (llama.cpp hard-codes this)."""
        return tuple((i + 1) % 4 == 0 or i == num_layers - 1 for i in range(num_layers))


LAYER_WEIGHTS = (
    "norm1.weight", "norm1.bias",
    "attn.q_proj.weight", "attn.q_proj.bias", "attn.k_proj.weight", "attn.k_proj.bias",
    "attn.v_proj.weight", "attn.v_proj.bias", "attn.proj.weight", "attn.proj.bias",
    "norm2.weight", "norm2.bias",
    "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias",
)


def vision_weight_names(config: VisionConfig) -> tuple[str, ...]:
    names = ["patch_embedding.weight", "position_embedding.weight", "ln_pre.weight", "ln_pre.bias"]
    for i in range(config.num_layers):
        names.extend(f"layers.{i}.{suffix}" for suffix in LAYER_WEIGHTS)
    names.extend(("ln_post.weight", "ln_post.bias", "adapter.fc1.weight", "adapter.fc2.weight",
                  "projection.weight"))
    return tuple(names)


def vision_shape(config: VisionConfig, name: str) -> tuple[int, ...]:
    h, f = config.hidden_size, config.intermediate_size
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
    shapes = {
        "patch_embedding.weight": (h, FRAME),
        "position_embedding.weight": (config.pos_side ** 2, h),
        "attn.q_proj.weight": (h, h), "attn.k_proj.weight": (h, h), "attn.v_proj.weight": (h, h),
        "attn.proj.weight": (h, h),
        "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,), "mlp.fc2.weight": (h, f),
        "adapter.fc1.weight": (config.projector_hidden_size, config.out_hidden_size),
        "adapter.fc2.weight": (config.projector_hidden_size, config.projector_hidden_size),
        "projection.weight": (config.text_hidden_size, config.projector_hidden_size),
    }
    return shapes.get(suffix, (h,))


class VisionWeights:
    """An opened vision checkpoint: ``config``, ``tensor_names`` and ``read(name)``
    (float32, the layout above)."""

    source: str
    config: VisionConfig
    path: Path

    def read(self, name: str) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return vision_weight_names(self.config)

    def iter_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.tensor_names:
            array = self.read(name)
            if array.shape != vision_shape(self.config, name):
                raise ValueError(f"{self.path}: vision weight {name} has shape {array.shape}, "
                                 f"expected {vision_shape(self.config, name)}")
            yield name, array

    def close(self) -> None:
        pass


# -- Hugging Face --------------------------------------------------------------------------------
def hf_vision_config(raw: dict[str, Any]) -> VisionConfig | None:
    """The vision config of a ``muse_glimmer`` ``config.json``, or None (text-only)."""
    if raw.get("model_type") != "muse_glimmer" or not raw.get("vision_config"):
        return None
    v, text = raw["vision_config"], raw.get("text_config") or {}
    layers = int(v.get("num_hidden_layers", 50))
    types = v.get("layer_types")
    full = VisionConfig.default_full(layers) if types is None else tuple(t == "full_attention" for t in types)
    side = int(v.get("pos_emb_height", 32))
    if int(v.get("pos_emb_width", side)) != side:
        raise ValueError("a non-square vision position table is not supported")
    if int(v.get("patch_temporal", 2)) != 2:
        raise ValueError("vision patch_temporal must be 2")
    if v.get("hidden_act", "gelu") != "gelu" or raw.get("projector_hidden_act", "gelu") != "gelu":
        raise ValueError("only the exact (erf) GELU is supported in the vision tower")
    rope = v.get("rope_parameters") or {}
    hidden = int(v.get("hidden_size", 1536))
    return VisionConfig(
        hidden_size=hidden,
        intermediate_size=int(v.get("intermediate_size", 8960)),
        num_layers=layers,
        num_heads=int(v.get("num_attention_heads", 16)),
        pos_side=side,
        full=full,
        out_hidden_size=int(raw.get("out_hidden_size", 6144)),
        projector_hidden_size=int(raw.get("projector_hidden_size", 4096)),
        text_hidden_size=int(text.get("hidden_size", 6656)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        patch_size=int(v.get("patch_size", PATCH_SIZE)),
        merge_size=int(v.get("merge_size", MERGE_SIZE)),
    )


_HF_PREFIXES = ("model.vision_tower.", "vision_tower.")
_HF_TOP = {"model.vision_adapter.fc1.weight": "adapter.fc1.weight", "model.vision_adapter.fc2.weight": "adapter.fc2.weight",
           "model.vision_projection.weight": "projection.weight"}


def _hf_name(stored: str) -> str | None:
    if stored in _HF_TOP:
        return _HF_TOP[stored]
    for prefix in _HF_PREFIXES:
        if stored.startswith(prefix):
            name = stored[len(prefix):]
            return {"patch_embedder.patch_embedding.weight": "patch_embedding.weight",
                    "patch_embedder.position_embedding_table.weight": "position_embedding.weight"}.get(name, name)
    return None


class HFVisionReader(VisionWeights):
    source = "hf"

    def __init__(self, path: str | os.PathLike[str], config: VisionConfig) -> None:
        self.path = Path(path)
        self.config = config
        self._files, stored = open_safetensors(self.path)
        self._located: dict[str, tuple[str, str]] = {}
        for stored_name, fname in stored:
            name = _hf_name(stored_name)
            if name is not None:
                self._located[name] = (fname, stored_name)
        missing = [n for n in vision_weight_names(config) if n not in self._located]
        if missing:
            raise ValueError(f"{self.path}: config.json has a vision_config but the checkpoint lacks "
                             f"{', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))

    def read(self, name: str) -> np.ndarray:
        fname, stored = self._located[name]
        array = self._files[fname].read(stored)
        if name == "patch_embedding.weight":  # (hidden, 2·588): sum the two temporal slots
            if array.shape != (self.config.hidden_size, 2 * FRAME):
                raise ValueError(f"{self.path}: {stored} has shape {array.shape}")
            array = array[:, :FRAME] + array[:, FRAME:]
        return np.ascontiguousarray(array, dtype=np.float32)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


# -- GGUF mmproj ---------------------------------------------------------------------------------
GGUF_LAYER = {
    "norm1.weight": "ln1.weight", "norm1.bias": "ln1.bias",
    "attn.q_proj.weight": "attn_q.weight", "attn.q_proj.bias": "attn_q.bias",
    "attn.k_proj.weight": "attn_k.weight", "attn.k_proj.bias": "attn_k.bias",
    "attn.v_proj.weight": "attn_v.weight", "attn.v_proj.bias": "attn_v.bias",
    "attn.proj.weight": "attn_out.weight", "attn.proj.bias": "attn_out.bias",
    "norm2.weight": "ln2.weight", "norm2.bias": "ln2.bias",
    "mlp.fc1.weight": "ffn_up.weight", "mlp.fc1.bias": "ffn_up.bias",
    "mlp.fc2.weight": "ffn_down.weight", "mlp.fc2.bias": "ffn_down.bias",
}
GGUF_TOP = {
    "patch_embedding.weight": "v.patch_embd.weight", "position_embedding.weight": "v.position_embd.weight",
    "ln_pre.weight": "v.pre_ln.weight", "ln_pre.bias": "v.pre_ln.bias",
    "ln_post.weight": "v.post_ln.weight", "ln_post.bias": "v.post_ln.bias",
    "adapter.fc1.weight": "mm.0.weight", "adapter.fc2.weight": "mm.1.weight", "projection.weight": "mm.2.weight",
}


def mmproj_name(name: str) -> str:
    if name.startswith("layers."):
        _, index, suffix = name.split(".", 2)
        return f"v.blk.{index}.{GGUF_LAYER[suffix]}"
    return GGUF_TOP[name]


def _rope_rows(array: np.ndarray, heads: int, inverse: bool) -> np.ndarray:
    """Q/K RoPE row (un)permutation of a weight ``(out, in)`` or a bias ``(out,)``."""
    matrix = array.reshape(array.shape[0], -1)
    out = (unpermute_rope_rows if inverse else permute_rope_rows)(matrix, heads)
    return out.reshape(array.shape)


class MMProjReader(VisionWeights):
    """A ``clip`` GGUF with projector type ``muse-glimmer``."""

    source = "gguf"

    def __init__(self, path: str | os.PathLike[str], text_hidden_size: int | None = None) -> None:
        self.path = Path(path)
        reader = GGUFFile(self.path)
        self._reader = reader
        f = reader.fields
        if f.get("general.architecture") != "clip" or f.get("general.type", "mmproj") != "mmproj":
            raise ValueError(f"{self.path}: not a projector GGUF (general.architecture="
                             f"{f.get('general.architecture')!r}, general.type={f.get('general.type')!r})")
        kind = f.get("clip.projector_type")
        if kind != PROJECTOR_TYPE:
            raise ValueError(f"{self.path}: projector type {kind!r}; musegl reads {PROJECTOR_TYPE!r} projectors")
        for key in ("clip.vision.image_mean", "clip.vision.image_std"):
            value = f.get(key)
            if value is not None and not np.allclose(value, 0.5):
                raise ValueError(f"{self.path}: {key} = {value}; musegl normalizes with 0.5 (the Muse default)")

        def need(key: str) -> Any:
            if key not in f:
                raise ValueError(f"{self.path}: projector GGUF lacks {key!r}")
            return f[key]

        self._tensors = reader.tensors
        layers = int(need("clip.vision.block_count"))
        hidden = int(need("clip.vision.embedding_length"))
        pos = self._tensor("v.position_embd.weight")
        side = math.isqrt(int(pos.shape[1]))
        if side * side != int(pos.shape[1]):
            raise ValueError(f"{self.path}: v.position_embd has {pos.shape[1]} rows, not a square table")
        mm0, mm1 = self._tensor("mm.0.weight"), self._tensor("mm.2.weight")
        projection = int(f.get("clip.vision.projection_dim", mm1.shape[1]))
        if text_hidden_size is not None and projection != text_hidden_size:
            raise ValueError(f"{self.path}: the projector writes {projection}-wide rows; the text model's "
                             f"hidden size is {text_hidden_size}")
        self.config = VisionConfig(
            hidden_size=hidden,
            intermediate_size=int(need("clip.vision.feed_forward_length")),
            num_layers=layers,
            num_heads=int(need("clip.vision.attention.head_count")),
            pos_side=side,
            full=VisionConfig.default_full(layers),
            out_hidden_size=int(mm0.shape[0]),
            projector_hidden_size=int(mm0.shape[1]),
            text_hidden_size=projection,
            layer_norm_eps=float(f.get("clip.vision.attention.layer_norm_epsilon", 1e-5)),
            rope_theta=10000.0,  # not in the file; llama.cpp hard-codes it
            patch_size=int(f.get("clip.vision.patch_size", PATCH_SIZE)),
            merge_size=int(f.get("clip.vision.spatial_merge_size", MERGE_SIZE)),
        )

    def _tensor(self, name: str) -> Any:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ValueError(f"{self.path}: projector GGUF lacks tensor {name!r}")
        return tensor

    def read(self, name: str) -> np.ndarray:
        array = dequantize_rows(self._tensor(mmproj_name(name)))
        if name == "patch_embedding.weight":  # (hidden, 3, 14, 14) conv kernel
            array = array.reshape(self.config.hidden_size, FRAME)
        elif name.startswith("layers.") and name.split(".", 2)[2].startswith(("attn.q_proj", "attn.k_proj")):
            array = _rope_rows(array, self.config.num_heads, inverse=True)
        return np.ascontiguousarray(array, dtype=np.float32)

    def close(self) -> None:
        self._tensors = {}
        if self._reader is not None:
            self._reader.close()
        self._reader = None  # type: ignore[assignment]


def load_vision(model: str | os.PathLike[str], mmproj: str | os.PathLike[str] | None = None,
                text_hidden_size: int | None = None) -> VisionWeights | None:
    """The vision weights that go with ``model``: the projector GGUF ``mmproj``
    when given, else those inside a Hugging Face directory, else None (a
    text-only load)."""
    if mmproj is not None:
        path = Path(mmproj)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such projector file (--mmproj)")
        return MMProjReader(path, text_hidden_size)
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        config = hf_vision_config(json.loads((path / "config.json").read_text()))
        if config is not None:
            if text_hidden_size is not None and config.text_hidden_size != text_hidden_size:
                raise ValueError(f"{path}: text_config.hidden_size disagrees with the text model")
            return HFVisionReader(path, config)
    return None


# -- writing (tests, make-tiny) ------------------------------------------------------------------
def write_mmproj_gguf(path: str | os.PathLike[str], config: VisionConfig, weights: dict[str, Any], *,
                      file_type: str = "f32", name: str = "Muse Glimmer projector") -> None:
    """Write vision ``weights`` (the names and layout of this module) as a projector
    GGUF in llama.cpp's converter layout: ``clip`` metadata, Q/K rows permuted
    (weights and biases), the temporal-summed patch kernel as ``(hidden, 3, 14,
    14)``, norms / biases / the position table in F32, the patch kernel in F16
    for an F16 file, other matrices in ``file_type`` (f32, f16, q8_0)."""
    import gguf

    types = {"f32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
             "f16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
             "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0)}
    if file_type not in types:
        raise ValueError(f"file_type {file_type!r} is not one of {', '.join(types)}")
    ftype, matrix_type = types[file_type]
    F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
    writer = gguf.GGUFWriter(os.fspath(path), "clip")
    try:
        writer.add_type("mmproj")
        writer.add_name(name)
        writer.add_file_type(int(ftype))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_string("clip.projector_type", PROJECTOR_TYPE)
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_uint32("clip.vision.projection_dim", config.text_hidden_size)
        writer.add_uint32("clip.vision.image_size", config.pos_side * config.patch_size * config.merge_size)
        writer.add_uint32("clip.vision.patch_size", config.patch_size)
        writer.add_uint32("clip.vision.embedding_length", config.hidden_size)
        writer.add_uint32("clip.vision.feed_forward_length", config.intermediate_size)
        writer.add_uint32("clip.vision.block_count", config.num_layers)
        writer.add_uint32("clip.vision.attention.head_count", config.num_heads)
        writer.add_float32("clip.vision.attention.layer_norm_epsilon", config.layer_norm_eps)
        writer.add_uint32("clip.vision.spatial_merge_size", config.merge_size)
        writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
        if config.full != VisionConfig.default_full(config.num_layers):
            raise ValueError("the projector GGUF cannot express a non-default full/window layer layout")
        for tname in vision_weight_names(config):
            w = np.asarray(weights[tname], dtype=np.float32)
            if w.shape != vision_shape(config, tname):
                raise ValueError(f"{tname} has shape {w.shape}, expected {vision_shape(config, tname)}")
            if tname.startswith("layers.") and tname.split(".", 2)[2].startswith(("attn.q_proj", "attn.k_proj")):
                w = _rope_rows(w, config.num_heads, inverse=False)
            if tname == "patch_embedding.weight":
                w = w.reshape(config.hidden_size, 3, config.patch_size, config.patch_size)
                qtype = F16 if matrix_type == F16 else F32
            elif w.ndim == 1 or tname == "position_embedding.weight":
                qtype = F32
            else:
                qtype = matrix_type
            if qtype == F32:
                writer.add_tensor(mmproj_name(tname), np.ascontiguousarray(w))
            elif qtype == F16:
                writer.add_tensor(mmproj_name(tname), np.ascontiguousarray(w, dtype=np.float16))
            else:
                writer.add_tensor(mmproj_name(tname), gguf.quants.quantize(np.ascontiguousarray(w), qtype),
                                  raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def hf_vision_weights(state: dict[str, Any], config: VisionConfig) -> dict[str, np.ndarray]:
    """This module's weights from a transformers state dict (``model.vision_tower.*`` ...),
    as numpy float32 (the patch kernel summed over its temporal slots)."""
    out = {}
    for stored, value in state.items():
        name = _hf_name(stored)
        if name is None:
            continue
        array = np.asarray(value, dtype=np.float32)
        if name == "patch_embedding.weight":
            array = array[:, :FRAME] + array[:, FRAME:]
        out[name] = array
    missing = [n for n in vision_weight_names(config) if n not in out]
    if missing:
        raise ValueError(f"state dict lacks vision weights {missing[:3]}")
    return out
