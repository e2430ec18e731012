"""Hook implementations of the musegl-cuda plugin (entry point ``cuda``).

Two executors share one implementation: ``cuda`` (a GPU is visible) and
``torch-cpu`` (always available, the fallback). torch is imported inside the
functions so that ``musegl plugins`` and the front stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from musegl_core.plugins.hookspecs import hookimpl
from musegl_core.plugins.specs import ExecutorOptions, ExecutorSpec

if TYPE_CHECKING:
    from musegl_cuda.executor import TorchExecutor


def cuda_available() -> bool:
    """True when torch is importable and sees at least one CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _create(options: ExecutorOptions, default_device: str) -> "TorchExecutor":
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.checkpoint.vision import load_vision
    from musegl_cuda.executor import TorchExecutor

    checkpoint = load_checkpoint(options.model, progress=options.progress)
    vision = None
    try:
        vision = load_vision(options.model, options.mmproj, checkpoint.config.hidden_size)
        return TorchExecutor(checkpoint, device=options.device or default_device, dtype=options.dtype,
                             vision=vision)
    finally:
        checkpoint.close()
        if vision is not None:
            vision.close()


def kv_layout(options: ExecutorOptions, default_device: str) -> tuple[int, int]:
    """``(bytes per KV block, block size)`` from the checkpoint's config, no weights read."""
    import torch

    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_cuda.executor import DEFAULT_BLOCK_SIZE, resolve_dtype

    checkpoint = load_checkpoint(options.model)
    try:
        c = checkpoint.config
    finally:
        checkpoint.close()
    dtype = resolve_dtype(options.dtype, torch.device(options.device or default_device))
    size = torch.empty((), dtype=dtype).element_size()
    return c.num_layers * 2 * DEFAULT_BLOCK_SIZE * c.num_kv_heads * c.head_dim * size, DEFAULT_BLOCK_SIZE


def create_cuda(options: ExecutorOptions) -> "TorchExecutor":
    """The decoder on a GPU (``options.device`` or ``cuda``), bfloat16 unless told otherwise."""
    return _create(options, "cuda")


def create_torch_cpu(options: ExecutorOptions) -> "TorchExecutor":
    """The decoder on the CPU (``options.device`` or ``cpu``), float32 unless told otherwise."""
    return _create(options, "cpu")


@hookimpl
def musegl_executors() -> list[ExecutorSpec]:
    return [
        ExecutorSpec(name="cuda", description="Muse Glimmer decoder in PyTorch on an NVIDIA GPU",
                     create=create_cuda, available=cuda_available, priority=100,
                     kv_layout=lambda options: kv_layout(options, "cuda")),
        ExecutorSpec(name="torch-cpu", description="Muse Glimmer decoder in PyTorch on the CPU",
                     create=create_torch_cpu, available=lambda: True, priority=10,
                     kv_layout=lambda options: kv_layout(options, "cpu")),
    ]
