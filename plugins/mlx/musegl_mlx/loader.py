"""Fill a :class:`~musegl_mlx.model.MuseGlimmerDecoder` from a checkpoint, tensor by tensor.

The core's readers (GGUF and Hugging Face) yield every weight as a float32
numpy array in transformers' layout and names (GGUF Q/K rows already
un-permuted), so this module only converts: dense matrices to the model
dtype, norm weights rounded to the model dtype and then kept in float32
(``1+w`` for the centered ones), as transformers does when it loads a
checkpoint in that dtype. q/k/v/gate are fused into one matrix and the MLP's
gate/up into another, so each runs as one product.
"""

from __future__ import annotations

import gc
import logging
from typing import Iterable, Iterator

import mlx.core as mx
import numpy as np

from musegl_core.allocator import release_free_heap
from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.hf_reader import CENTERED_NORMS, text_weight_names
from musegl_mlx.model import Embedding, GroupProducts, Linear, LinearGroup, MuseGlimmerDecoder
from musegl_mlx.quant import QuantizedWeight

log = logging.getLogger("musegl.mlx")

QKVG = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.gate_proj.weight")
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")

def checkpoint_weights(checkpoint) -> Iterator[tuple[str, object]]:
    """The weights of an open :class:`~musegl_core.checkpoint.loader.Checkpoint`,
    one at a time, as :func:`load_weights` takes them, read in their stored
    form (:meth:`~musegl_core.checkpoint.loader.Checkpoint.iter_stored`):
    f32/f16 as numpy arrays, bf16 as MLX bfloat16 arrays (no float32 copy),
    GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K and mlx-lm's quantized matrices as
    :class:`~musegl_mlx.quant.QuantizedWeight` (kept quantized; Q6_K in its
    nearest MLX form, whose error the log gives for the first such matrix); any
    other quantized type is dequantized, and the log says so once per type."""
    from musegl_core.checkpoint.stored import mlx_layout
    from musegl_mlx.quant import q6_k_error, quantized_weight

    told: set[str] = set()
    for stored in checkpoint.iter_stored():
        layout = mlx_layout(stored.dtype)
        if stored.dtype in ("f32", "f16"):
            yield stored.name, stored.data
        elif stored.dtype == "bf16":
            yield stored.name, mx.array(stored.data).view(mx.bfloat16)
        elif layout is not None:
            yield stored.name, QuantizedWeight(stored.shape, stored.data, stored.scales, stored.biases,
                                               bits=layout[0], group_size=layout[1])
        else:
            if stored.dtype == "q6_k" and "q6_k" not in told:
                log.warning("GGUF Q6_K has no exact MLX layout (16-value scales): its tensors run as 6-bit "
                            "groups of 32, relative RMS error %.2e on %s", q6_k_error(stored), stored.name)
                told.add("q6_k")
            weight = quantized_weight(stored)
            if weight is None:
                if stored.dtype not in told:
                    log.warning("GGUF type %s has no MLX quantized layout: its tensors are dequantized "
                                "(first: %s)", stored.dtype.upper(), stored.name)
                    told.add(stored.dtype)
                yield stored.name, stored.to_float32()
            else:
                yield stored.name, weight


def dense(array: np.ndarray, dtype: mx.Dtype) -> Linear:
    return Linear(converted(array, dtype))


def converted(array: np.ndarray | mx.array, dtype: mx.Dtype) -> mx.array:
    """``array`` as an MLX array of ``dtype``, evaluated now (so the float32 copy is freed)."""
    out = (array if isinstance(array, mx.array) else mx.array(array)).astype(dtype)
    mx.eval(out)
    return out


def norm_weight(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """A norm weight rounded to the model dtype, then float32."""
    return converted(array, dtype).astype(mx.float32)


def _layout(linear: Linear) -> tuple | None:
    return linear.layout


def _stack(parts: list[Linear]) -> Linear:
    if len(parts) == 1:
        return parts[0]
    if not parts[0].quantized:
        return Linear(mx.concatenate([p.weight for p in parts]))
    done: dict[tuple[int, ...], mx.array] = {}  # an array the parts' scales and biases share is stacked once

    def stacked(arrays: list[mx.array]) -> mx.array:
        key = tuple(id(a) for a in arrays)
        if key not in done:
            done[key] = mx.concatenate(arrays)
        return done[key]

    def values(items: list):
        if items[0] is None:
            return None
        if isinstance(items[0], GroupProducts):
            multipliers = None if items[0].multiplier is None else stacked([v.multiplier for v in items])
            return GroupProducts(stacked([v.factor for v in items]), multipliers, items[0].times, items[0].dtype)
        return stacked(items)

    return Linear(mx.concatenate([p.weight for p in parts]), values([p.scales for p in parts]),
                  values([p.biases for p in parts]), parts[0].group_size, parts[0].bits)


def fuse(parts: list[Linear], dtype: mx.Dtype) -> Linear | LinearGroup:
    """Stack the rows of several projections into one where they share a layout (all
    dense, or all quantized alike); otherwise a :class:`LinearGroup` of runs of
    consecutive parts that do, each kept as stored."""
    runs: list[list[Linear]] = []
    for part in parts:
        if runs and _layout(runs[-1][-1]) == _layout(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    if len(runs) == 1:
        return _stack(runs[0])
    return LinearGroup([_stack(run) for run in runs])


def load_weights(model: MuseGlimmerDecoder, weights: Iterable[tuple[str, object]]) -> None:
    """Convert every ``(name, weight)`` into ``model``. A weight is a float array
    (numpy or MLX), or a :class:`~musegl_mlx.quant.QuantizedWeight` for a
    matrix kept quantized. Raises ValueError when one is missing, unknown or
    of the wrong shape."""
    config, dtype = model.config, model.dtype
    pending: dict[tuple[int, str], Linear] = {}
    loaded: set[str] = set()
    for name, value in weights:
        linear = None
        if isinstance(value, QuantizedWeight):
            check_shape(config, name, value.shape)
            if name in ("norm.weight",) or len(value.shape) != 2:
                raise ValueError(f"{name}: a quantized 1-D weight")
            linear = value.linear(dtype)
        else:
            array = value
            check_shape(config, name, array.shape)
        loaded.add(name)
        if name == "embed_tokens.weight":
            model.embed_tokens = Embedding(linear) if linear is not None else Embedding(Linear(converted(array, dtype)))
            continue
        if name == "norm.weight":
            model.norm = norm_weight(array, dtype)
            continue
        if name == "lm_head.weight":
            model.lm_head = linear or dense(array, dtype)
            continue
        if not name.startswith("layers."):
            raise ValueError(f"unknown weight {name!r}")
        _, index, suffix = name.split(".", 2)
        layer = model.layers[int(index)]
        if suffix in CENTERED_NORMS:
            layer.norms[suffix.removesuffix(".weight")] = 1.0 + norm_weight(array, dtype)
        elif suffix == "self_attn.o_proj.weight":
            layer.o_proj = linear or dense(array, dtype)
        elif suffix == "mlp.down_proj.weight":
            layer.down_proj = linear or dense(array, dtype)
        elif suffix in QKVG or suffix in GATE_UP:
            pending[(int(index), suffix)] = linear or dense(array, dtype)
            group = QKVG if suffix in QKVG else GATE_UP
            if all((int(index), s) in pending for s in group):
                fused = fuse([pending.pop((int(index), s)) for s in group], dtype)
                mx.eval(fused.arrays())
                if group is QKVG:
                    layer.qkvg = fused
                else:
                    layer.gate_up = fused
        else:
            raise ValueError(f"unknown weight {name!r}")
    missing = set(text_weight_names(config)) - loaded
    if missing:
        raise ValueError(f"checkpoint did not provide {sorted(missing)[:5]}")
    mx.eval(model_arrays(model))
    mx.clear_cache()  # the buffers of load-time copies (fused parts, casts) go back to the system
    gc.collect()
    release_free_heap()  # and the heap's holes the numpy conversions left


def model_arrays(model: MuseGlimmerDecoder) -> list[mx.array]:
    """Every array of the model (to evaluate them once, after loading)."""
    out = [model.norm, model.inv_freq]
    linears = [model.lm_head, model.embed_tokens.table]
    for layer in model.layers:
        out.extend(layer.norms.values())
        linears.extend((layer.qkvg, layer.o_proj, layer.gate_up, layer.down_proj))
    for linear in linears:
        out.extend(linear.arrays())
    return out


def check_shape(config: TextConfig, name: str, shape: tuple[int, ...]) -> None:
    from musegl_core.checkpoint.hf_reader import expected_shape

    want = expected_shape(config, name)
    if tuple(shape) != tuple(want):
        raise ValueError(f"{name}: shape {tuple(shape)}, the config says {tuple(want)}")
