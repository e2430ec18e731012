"""Hook implementations of the musegl-mlx plugin (entry point ``mlx``).

One executor, ``mlx``: the Muse Glimmer decoder in MLX. On macOS with Apple
silicon it is the default when installed (its priority is above every other
backend there); elsewhere (the CPU build of MLX on Linux) it runs only when
asked for with ``--executor mlx``. MLX is imported inside the functions, so
``musegl plugins`` and the front stay fast, and a machine without a usable
MLX only hears about it when ``--executor mlx`` is asked for.
"""

from __future__ import annotations

import functools
import platform
import sys
from typing import TYPE_CHECKING

from musegl_core.errors import ConfigError
from musegl_core.plugins.hookspecs import hookimpl
from musegl_core.plugins.specs import ExecutorOptions, ExecutorSpec

if TYPE_CHECKING:
    from musegl_mlx.executor import MLXExecutor

#: Above cuda (100) and torch-cpu (10): the default on Apple silicon.
APPLE_PRIORITY = 200
#: Below torch-cpu: on Linux the torch executor stays the default.
OTHER_PRIORITY = 5


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


@functools.cache
def unavailable_reason() -> str | None:
    """Why MLX cannot run here (one line), or None when it can."""
    from musegl_mlx import blas

    blas.route()  # before MLX is loaded (see musegl_mlx.blas)
    try:
        import mlx.core as mx
    except ImportError as exc:
        wanted = "mlx" if sys.platform == "darwin" else "mlx[cpu]"
        return f"MLX is not usable here ({exc}); install it with: pip install '{wanted}>=0.32,<0.33'"
    try:
        mx.eval(mx.array([1.0]) + 1)
    except Exception as exc:  # a broken install or no usable device
        return f"MLX is installed but cannot run ({type(exc).__name__}: {exc})"
    return None


def mlx_available() -> bool:
    return unavailable_reason() is None


def apply_options(options: ExecutorOptions) -> None:
    """Check ``--device``/``--dtype`` (one-line errors) and make ``--device cpu|gpu``
    MLX's default device (no option: MLX's own default)."""
    from musegl_mlx.executor import DTYPES

    if options.device not in (None, "cpu", "gpu", "mlx"):
        raise ConfigError(f"the mlx executor takes --device cpu or gpu (MLX's devices), got {options.device!r}")
    if options.dtype is not None and options.dtype not in DTYPES:
        raise ConfigError(f"--dtype {options.dtype!r} is not one of float32, float16, bfloat16")
    if options.device in ("cpu", "gpu"):
        import mlx.core as mx

        mx.set_default_device(mx.cpu if options.device == "cpu" else mx.gpu)


def create_mlx(options: ExecutorOptions) -> "MLXExecutor":
    """The decoder in MLX, in ``options.dtype`` (default: see ``musegl_mlx.precision``)."""
    reason = unavailable_reason()
    if reason is not None:
        raise ConfigError(reason)
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_mlx.executor import MLXExecutor

    apply_options(options)
    from musegl_core.checkpoint.vision import load_vision
    from musegl_mlx.loader import checkpoint_weights

    checkpoint = load_checkpoint(options.model, progress=options.progress)
    vision = None
    try:
        vision = load_vision(options.model, options.mmproj, checkpoint.config.hidden_size)
        return MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype=options.dtype,
                           vision=vision, stored_dtype=checkpoint.file_type, kv_cache_dtype=options.kv_cache_dtype)
    finally:
        checkpoint.close()
        if vision is not None:
            vision.close()


def kv_layout(options: ExecutorOptions) -> tuple[int, int]:
    """``(bytes per KV block, block size)`` from the checkpoint's config, no weights read."""
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_mlx.executor import DEFAULT_BLOCK_SIZE, resolve_dtype

    from musegl_core.engine.kv_dtype import kv_position_bytes

    checkpoint = load_checkpoint(options.model)
    checkpoint.close()
    apply_options(options)
    size = resolve_dtype(options.dtype, checkpoint.file_type).size
    per_position = kv_position_bytes(checkpoint.config, options.kv_cache_dtype, size)
    return per_position * DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE


def memory_plan(options: ExecutorOptions):
    """The weights' bytes as MLX will hold them and the memory there (:mod:`musegl_mlx.memory_plan`)."""
    from musegl_mlx import memory_plan as plan

    apply_options(options)
    return plan.memory_plan(options)


def check(options: ExecutorOptions) -> None:
    """The front's check: the core's (a checkpoint with a tokenizer), and no flag of another
    executor that MLX would not honour."""
    from musegl_core.servable import check_servable

    if (options.extra.get("tensor_parallel_size") or 1) > 1:
        raise ConfigError("--tensor-parallel-size: the mlx executor runs on one device "
                          "(tensor parallelism is the cuda and torch-cpu executors')")
    check_servable(options.model)


@hookimpl
def musegl_executors() -> list[ExecutorSpec]:
    return [
        ExecutorSpec(name="mlx", description="Muse Glimmer decoder in MLX (Apple silicon; MLX's CPU build elsewhere)",
                     create=create_mlx, available=mlx_available,
                     priority=APPLE_PRIORITY if apple_silicon() else OTHER_PRIORITY,
                     kv_layout=kv_layout, unavailable_reason=unavailable_reason, check=check,
                     kv_cache_dtypes=("auto", "fp8"),
                     memory_plan=memory_plan, sliding_pages=True),
    ]
