"""What the cuda and torch-cpu executors will hold, before loading (``ExecutorSpec.memory_plan``).

Runs in the front process, so it imports neither torch nor the kernels (seconds, and on
CUDA a context that takes device memory): from the checkpoint's tensor table alone
(:func:`musegl_core.engine.fit.checkpoint_tensors`):

* ``--weights stored`` (the torch-cpu default with float32 activations): f32/f16/bf16 and
  the GGUF types the CPU kernels run (:data:`STORED_BLOCKS`, the kernels' table
  :data:`~musegl_cuda.cpu.stored_matrix.KINDS`: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, and mlx-lm's 4-bit
  groups of 64) at their
  file size; any other type decoded to float32;
* ``--weights upcast``: every value in the activation dtype.

The device's memory: on CUDA the card's total from the driver (``cuDeviceTotalMem``, no
context created), less a reserve for the CUDA context and the executor's workspace; on
the CPU what the kernel says can be allocated (``MemAvailable``). The norms (float32
vectors) are counted as they are. The KV layout is the executor's (``kv_block_bytes``
over blocks of :data:`BLOCK_SIZE` positions, elements of the activation dtype).
"""

from __future__ import annotations

import ctypes

from musegl_core.engine.fit import MemoryPlan, TensorEntry, checkpoint_tensors
from musegl_core.plugins.specs import ExecutorOptions

#: CUDA context, cuBLAS workspace, graphs and the step's activations, kept out of the KV room.
CUDA_RESERVE = 1 << 30
#: stored form -> values per block the CPU kernels need a row to fill (stored_matrix.KINDS)
STORED_BLOCKS = {"f32": 32, "f16": 32, "bf16": 32, "q8_0": 32, "q4_0": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256,
                 "mlx_q4_g64": 64}
#: the executor's KV block (musegl_cuda.executor.DEFAULT_BLOCK_SIZE)
BLOCK_SIZE = 16
ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


def stored_bytes(t: TensorEntry) -> tuple[str, int]:
    """(form, bytes) of a tensor kept as stored on the CPU."""
    block = STORED_BLOCKS.get(t.kind)
    if len(t.shape) == 2 and block is not None and t.shape[1] % block == 0:
        return t.kind, t.nbytes
    return "f32", t.numel * 4  # norms; a type the kernels do not run, decoded to float32 at load


def cuda_total_memory(index: int) -> tuple[int, str] | None:
    """(bytes, name) of CUDA device ``index`` from the driver, without a context; None when
    the driver does not answer."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        if cuda.cuInit(0) != 0:
            return None
        device = ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(device), index) != 0:
            return None
        total = ctypes.c_size_t()
        if cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device) != 0:
            return None
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, 256, device)
        return int(total.value), name.value.decode(errors="replace")
    except (OSError, AttributeError):
        return None


def memory_plan(options: ExecutorOptions, default_device: str) -> MemoryPlan:
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.dtypes import dtype_name
    from musegl_core.engine.kv_dtype import kv_position_bytes
    from musegl_core.engine.memory import available_ram

    device = options.device or default_device
    on_cuda = device.startswith("cuda")
    dtype = dtype_name(options.dtype) if options.dtype else ("bfloat16" if on_cuda else "float32")
    size = ITEM_SIZES[dtype]
    checkpoint = load_checkpoint(options.model)  # the tensor table only
    config, file_type = checkpoint.config, checkpoint.file_type
    checkpoint.close()
    tensors = checkpoint_tensors(options.model)
    upcast = {dtype: sum(t.numel * (4 if len(t.shape) == 1 else size) for t in tensors)}
    stored: dict[str, int] = {}
    for t in tensors:
        kind, n = stored_bytes(t)
        stored[kind] = stored.get(kind, 0) + n
    mode = options.extra.get("weights")  # --weights; None: the executor's default (executor.resolve_weights)
    if mode is None:
        if on_cuda:  # quantized files (GGUF blocks, FP8) run as stored on CUDA, unquantized ones upcast
            quantized = options.extra.get("quantization") or file_type not in ("f32", "f16", "bf16", "mixed", "")
            mode = "stored" if quantized else "upcast"
        else:
            mode = "stored" if dtype == "float32" and file_type not in ("f32", "") else "upcast"
    weights = stored if mode == "stored" else upcast
    kv = (kv_position_bytes(config, options.kv_cache_dtype, size) * BLOCK_SIZE, BLOCK_SIZE)
    if on_cuda:
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        found = cuda_total_memory(index)
        memory, name = found if found is not None else (None, "")
        alternatives = (("--weights stored", sum(stored.values())),) if mode == "upcast" else ()
        return MemoryPlan(f"{device} ({name})" if name else device, memory, weights, reserve=CUDA_RESERVE,
                          kv_layout=kv, alternatives=alternatives)
    alternatives = (("--weights stored", sum(stored.values())),) if mode == "upcast" and dtype == "float32" else ()
    return MemoryPlan("cpu (host memory available)", available_ram(), weights, alternatives=alternatives,
                      kv_layout=kv)
