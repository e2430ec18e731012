"""What the MLX executor will hold, before loading (``ExecutorSpec.memory_plan``).

From the checkpoint's tensor table alone (:func:`musegl_core.engine.fit.checkpoint_tensors`)
and the forms :mod:`musegl_mlx.quant` gives (:func:`gguf_mlx_bytes`): GGUF Q8_0/Q4_0/Q4_1
as their codes (8 or 4 bits a value) with float16 scales and biases per 32 values (Q4_0's
bias computed from its scale in float32), Q4_K/Q5_K as 4- or 5-bit codes with the file's
factors (a float16 pair per 256 values, two bytes per 32), Q6_K as 6-bit codes with its
float16 ``d`` per 256 and an int8 per 32; mlx-lm's matrices as they are (at the file's
bytes in float32; scales and biases in the compute dtype otherwise); everything else
(f16/bf16/f32, other GGUF types) in the compute dtype. The memory: the recommended working
set on Metal, MemAvailable elsewhere.
"""

from __future__ import annotations

from musegl_core.checkpoint.stored import mlx_layout
from musegl_core.engine.fit import MemoryPlan, TensorEntry, checkpoint_tensors
from musegl_core.plugins.specs import ExecutorOptions

#: GGUF type -> bits of its MLX codes (groups of 32)
GGUF_BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q4_k": 4, "q5_k": 5, "q6_k": 6}


def gguf_mlx_bytes(kind: str, rows: int, cols: int, size: int) -> int:
    """Bytes of a GGUF matrix of ``kind`` in its MLX form (:mod:`musegl_mlx.quant`),
    ``size`` the compute dtype's item size."""
    values = rows * cols
    groups, supers = values // 32, values // 256
    codes = values * GGUF_BITS[kind] // 8
    if kind == "q8_0":
        return codes + groups * 4
    if kind == "q4_0":  # float32 compute: the bias is computed from the scales, held once
        return codes + groups * 2 + (0 if size == 4 else groups * 2)
    if kind == "q4_1":
        return codes + groups * 4
    if kind == "q6_k":
        return codes + supers * 2 + groups
    return codes + supers * 4 + groups * 2  # q4_k, q5_k


def mlx_bytes(t: TensorEntry, size: int) -> tuple[str, int]:
    """(form, bytes) of one tensor as the MLX executor keeps it, ``size`` the compute dtype's item size."""
    layout = mlx_layout(t.kind)
    if layout is not None and len(t.shape) == 2:
        bits, group = layout
        rows, cols = t.shape
        if size == 4:  # float32 compute keeps the file's scale dtype
            return t.kind, t.nbytes
        return t.kind, rows * cols * bits // 8 + 2 * rows * (cols // group) * size
    bits = GGUF_BITS.get(t.kind)
    if bits is not None and len(t.shape) == 2:
        rows, cols = t.shape
        block = 256 if t.kind.endswith("_k") else 32
        if cols % block == 0:
            return f"{t.kind} as {bits}-bit", gguf_mlx_bytes(t.kind, rows, cols, size)
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
