"""What the MLX executor will hold, before loading (``ExecutorSpec.memory_plan``).

From the checkpoint's tensor table alone (:func:`musegl_core.engine.fit.checkpoint_tensors`)
and the forms :mod:`musegl_mlx.quant` gives: GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q5_K as their
codes (8, 4 or 5 bits a value) with a scale and a bias per 32 values in the compute
dtype, Q6_K as 8-bit codes in groups of 32, mlx-lm's matrices as they are (scales and
biases in the compute dtype), everything else (f16/bf16/f32, other GGUF types) in the
compute dtype. The memory: the recommended working set on Metal, MemAvailable elsewhere.
"""

from __future__ import annotations

from musegl_core.checkpoint.stored import mlx_layout
from musegl_core.engine.fit import MemoryPlan, TensorEntry, checkpoint_tensors
from musegl_core.plugins.specs import ExecutorOptions

#: GGUF type -> bits of its MLX codes (groups of 32)
GGUF_BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q4_k": 4, "q5_k": 5, "q6_k": 8}


def mlx_bytes(t: TensorEntry, size: int) -> tuple[str, int]:
    """(form, bytes) of one tensor as the MLX executor keeps it, ``size`` the compute dtype's item size."""
    layout = mlx_layout(t.kind)
    if layout is not None and len(t.shape) == 2:
        bits, group = layout
        rows, cols = t.shape
        return t.kind, rows * cols * bits // 8 + 2 * rows * (cols // group) * size
    bits = GGUF_BITS.get(t.kind)
    if bits is not None and len(t.shape) == 2:
        rows, cols = t.shape
        block = 256 if t.kind.endswith("_k") else 32
        if cols % block == 0:
            return f"{t.kind} as {bits}-bit", rows * cols * bits // 8 + 2 * rows * (cols // 32) * size
    if len(t.shape) == 1:
        return "f32", t.numel * 4
    return "dense", t.numel * size


def memory_plan(options: ExecutorOptions) -> MemoryPlan:
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_mlx.executor import available_ram, metal, resolve_dtype

    checkpoint = load_checkpoint(options.model)  # the tensor table only
    file_type = checkpoint.file_type
    checkpoint.close()
    size = resolve_dtype(options.dtype, file_type).size
    weights: dict[str, int] = {}
    for t in checkpoint_tensors(options.model):
        kind, n = mlx_bytes(t, size)
        weights[kind] = weights.get(kind, 0) + n
    where = "mlx (Metal working set)" if metal() else "mlx (host memory available)"
    return MemoryPlan(where, available_ram(), weights)
