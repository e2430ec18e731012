"""What the cuda and torch-cpu executors will hold, before loading (``ExecutorSpec.memory_plan``).

From the checkpoint's tensor table alone (:func:`musegl_core.engine.fit.checkpoint_tensors`):

* ``--weights stored`` (the torch-cpu default with float32 activations): f32/f16/bf16 and
  the GGUF types the CPU kernels run (:data:`~musegl_cuda.cpu.stored_matrix.KINDS`:
  Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) at their file size; any other type decoded to float32;
* ``--weights upcast``: every value in the activation dtype.

The device's memory: on CUDA the card's total (less a reserve for the CUDA context and
the executor's workspace); on the CPU what the kernel says can be allocated
(``MemAvailable``). The norms (float32 vectors) are counted as they are.
"""

from __future__ import annotations

from musegl_core.engine.fit import MemoryPlan, TensorEntry, checkpoint_tensors
from musegl_core.plugins.specs import ExecutorOptions

#: CUDA context, cuBLAS workspace, graphs and the step's activations, kept out of the KV room.
CUDA_RESERVE = 1 << 30


def stored_bytes(t: TensorEntry) -> tuple[str, int]:
    """(form, bytes) of a tensor kept as stored on the CPU."""
    from musegl_cuda.cpu.stored_matrix import KINDS

    kind = {"f32": "f32", "f16": "f16", "bf16": "bf16"}.get(t.kind, t.kind)
    block = KINDS.get(kind, (None, 0))[1]
    if len(t.shape) == 2 and kind in KINDS and t.shape[1] % block == 0:
        return kind, t.nbytes
    return "f32", t.numel * 4  # norms; a type the kernels do not run, decoded to float32 at load


def memory_plan(options: ExecutorOptions, default_device: str) -> MemoryPlan:
    import torch

    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.memory import available_ram
    from musegl_cuda.executor import resolve_dtype, resolve_weights

    device = torch.device(options.device or default_device)
    dtype = resolve_dtype(options.dtype, device)
    checkpoint = load_checkpoint(options.model)  # the tensor table only
    file_type = checkpoint.file_type
    checkpoint.close()
    tensors = checkpoint_tensors(options.model)
    size = torch.empty((), dtype=dtype).element_size()
    upcast = {str(dtype).removeprefix("torch."): sum(t.numel * (4 if len(t.shape) == 1 else size) for t in tensors)}
    stored: dict[str, int] = {}
    for t in tensors:
        kind, n = stored_bytes(t)
        stored[kind] = stored.get(kind, 0) + n
    try:
        mode = resolve_weights(options.extra.get("weights"), device, dtype, file_type)  # --weights
    except ValueError:
        mode = "upcast"
    weights = stored if mode == "stored" else upcast
    alternatives: tuple[tuple[str, int], ...] = ()
    if device.type == "cuda":
        index = device.index if device.index is not None else 0
        memory = int(torch.cuda.get_device_properties(index).total_memory) if torch.cuda.is_available() else None
        name = f"{device} ({torch.cuda.get_device_name(index)})" if torch.cuda.is_available() else str(device)
        return MemoryPlan(name, memory, weights, reserve=CUDA_RESERVE)
    if mode == "upcast" and dtype == torch.float32:
        alternatives = (("--weights stored", sum(stored.values())),)
    return MemoryPlan("cpu (host memory available)", available_ram(), weights, alternatives=alternatives)
