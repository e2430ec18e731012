"""Hook implementations of the musegl-cuda plugin (entry point ``cuda``).

Two executors share one implementation: ``cuda`` (a GPU is visible) and
``torch-cpu`` (always available, the fallback). torch is imported inside the
functions that build an executor, never to answer whether one is available
(:mod:`musegl_cuda.cuda.availability`), so that ``musegl plugins`` and the front
stay fast.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from musegl_core.errors import ConfigError
from musegl_core.plugins.hookspecs import hookimpl
from musegl_core.plugins.specs import ExecutorOptions, ExecutorSpec

from musegl_cuda.cuda.availability import cuda_available
from musegl_cuda.config_only import read_config_only

if TYPE_CHECKING:
    from musegl_cuda.executor import TorchExecutor


LOAD_FORMATS = ("auto", "dummy")
#: ``--kv-cache-dtype`` values both executors (and their tensor-parallel ranks) store (musegl_cuda.kv_fp8)
KV_CACHE_DTYPES = ("auto", "fp8")
WEIGHT_MODES = ("stored", "upcast")
QUANTIZATIONS = ("fp8",)  # musegl_cuda.quantization.QUANTIZATIONS (not imported here: it imports torch)


@hookimpl
def musegl_serve_options(group) -> None:
    group.add_argument("--forward-sizes", default=None, metavar="N,N,...",
                       help="decode step widths captured as CUDA graphs at start-up (default 1,2,4,8,16,32,64,128; "
                            "'none': no graphs); the cuda executor only")
    group.add_argument("--sync-steps", action="store_true",
                       help="read every step before launching the next (the cuda executor launches decode "
                            "steps ahead by default, so the host's work overlaps the GPU's; for comparison "
                            "and debugging)")
    group.add_argument("--load-format", default="auto", metavar="FORMAT",
                       help="auto: read the checkpoint's weights; dummy: random weights made on the device "
                            "(seeded, repeatable), --model needs only a config.json")
    group.add_argument("--weights", default=None, choices=WEIGHT_MODES,
                       help="stored: keep the checkpoint's matrices as stored and multiply them with kernels "
                            "that read them directly (torch-cpu: f16, bf16, GGUF Q8_0/Q4_0/Q4_K, the default with "
                            "--dtype float32; cuda: GGUF Q8_0/Q4_0/Q4_K/Q5_K/Q6_K and FP8, the default for "
                            "quantized checkpoints); upcast: convert every weight to --dtype at load")
    group.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="fp8: quantize f16/bf16/f32 matrices at load to float8 e4m3 with one scale per "
                            "output row (cuda: kept in 8 bits; torch-cpu: decoded back to float32, for "
                            "checking); needs --weights stored (the default with it)")
    group.add_argument("--fp8-w8a8-rows", type=int, default=None, metavar="N",
                       help="cuda, FP8 weights with one scale per tensor or row: products of at least N rows "
                            "quantize the activations per row and run torch._scaled_mm (W8A8), fewer rows "
                            "dequantize the weights in a Triton kernel (default 32)")
    group.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="split the model over N devices (one process per GPU: cuda:0 .. cuda:N-1; on the "
                            "CPU N processes sharing the cores); N must divide the attention heads and the MLP "
                            "width (default 1; docs/scaling.md)")


def parse_forward_sizes(text: str | None) -> tuple[int, ...] | None:
    """``--forward-sizes``: None (the defaults), ``none`` (no graphs) or ascending positive widths."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--forward-sizes must be comma-separated integers or 'none', got {text!r}") from None
    if not sizes or any(s <= 0 or s > 4096 for s in sizes):
        raise ConfigError(f"--forward-sizes must list widths between 1 and 4096, got {text!r}")
    return tuple(sorted(set(sizes)))


def weight_mode(options: ExecutorOptions) -> str | None:
    value = options.extra.get("weights")
    if value is not None and value not in WEIGHT_MODES:
        raise ConfigError(f"--weights must be one of {', '.join(WEIGHT_MODES)}, got {value!r}")
    return value


def quantization(options: ExecutorOptions) -> str | None:
    value = options.extra.get("quantization")
    if value is not None and value not in QUANTIZATIONS:
        raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {value!r}")
    return value


def w8a8_rows(options: ExecutorOptions) -> int | None:
    value = options.extra.get("fp8_w8a8_rows")
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ConfigError(f"--fp8-w8a8-rows must be a positive integer, got {value!r}")
    return value


def load_format(options: ExecutorOptions) -> str:
    value = options.extra.get("load_format") or "auto"
    if value not in LOAD_FORMATS:
        raise ConfigError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {value!r}")
    return value


def check_model(options: ExecutorOptions) -> None:
    """``musegl serve``'s check before loading: with ``--load-format dummy`` only a
    config (and a tokenizer, or the demo one for a bare config.json) is needed."""
    from musegl_core.model_tokenizer import load_tokenizer
    from musegl_core.servable import check_servable, one_line

    if load_format(options) != "dummy":
        check_servable(options.model)
        return
    read_config_only(options.model)
    try:
        load_tokenizer(options.model)
    except Exception as exc:
        raise ConfigError(f"cannot serve {options.model!r}: {one_line(exc)}") from None


def check_cpu_model(options: ExecutorOptions) -> None:
    """:func:`check_model`, and ``$MUSEGL_CPU_KERNELS`` names a kernel path this CPU runs and
    ``$MUSEGL_CPU_KQUANT`` a k-quant mode (one line before the worker starts, rather than
    from the worker at its first matrix)."""
    import os

    from musegl_cuda.cpu import native

    forced = os.environ.get(native.ENV, "").strip().lower()
    if forced and forced != native.FALLBACK:
        missing = native.missing_for(native.path_named(forced))  # KernelPathError for an unknown name
        if missing:
            raise native.KernelPathError(f"{native.ENV}={forced}: the {forced} kernels need {', '.join(missing)}, "
                                         "which this CPU lacks")
    native.kquant_mode()  # KernelPathError for a bad $MUSEGL_CPU_KQUANT
    check_model(options)


def tensor_parallel_size(options: ExecutorOptions) -> int:
    value = options.extra.get("tensor_parallel_size")
    if value is None:
        return 1
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"--tensor-parallel-size must be a positive integer, got {value!r}")
    return value


def _create_parallel(options: ExecutorOptions, default_device: str, size: int):
    """``--tensor-parallel-size`` N > 1: the model split over N rank processes (musegl_cuda.parallel)."""
    import torch

    from musegl_cuda.parallel.executor import TensorParallelExecutor, exit_worker_after
    from musegl_cuda.parallel.rank import RankSpec
    from musegl_cuda.parallel.shard import check_size

    device = torch.device(options.device or default_device)
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(f"--tensor-parallel-size {size} runs on cuda or cpu devices, not {device.type}")
    if device.index is not None:
        raise ConfigError(f"--tensor-parallel-size {size} uses cuda:0 .. cuda:{size - 1}; "
                          f"--device {options.device} names one device")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(f"--tensor-parallel-size {size} needs {size} GPUs; torch sees "
                          f"{torch.cuda.device_count()}")
    try:
        check_size(read_config_only(options.model).config, size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    dummy = load_format(options) == "dummy"
    spec = RankSpec(model=options.model, device=device.type, size=size, dtype=options.dtype,
                    weights=None if dummy else weight_mode(options),
                    forward_sizes=parse_forward_sizes(options.extra.get("forward_sizes")),
                    async_steps=False if options.extra.get("sync_steps") else None, dummy=dummy,
                    mmproj=options.mmproj, kv_cache_dtype=options.kv_cache_dtype, log_level=logging.getLevelName(logging.getLogger().level).lower())
    return TensorParallelExecutor(spec, on_failure=exit_worker_after())


def _create(options: ExecutorOptions, default_device: str) -> "TorchExecutor":
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.checkpoint.vision import load_vision
    from musegl_cuda.executor import TorchExecutor

    size = tensor_parallel_size(options)
    if size > 1:
        if quantization(options) is not None:
            raise ConfigError("--quantization runs without --tensor-parallel-size")
        return _create_parallel(options, default_device, size)
    sizes = parse_forward_sizes(options.extra.get("forward_sizes"))
    async_steps = False if options.extra.get("sync_steps") else None  # None: the device's default
    if options.kv_cache_dtype == "fp8":
        import torch

        from musegl_cuda.kv_fp8 import check_device

        try:  # before any weight is read
            check_device(torch.device(options.device or default_device))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if load_format(options) == "dummy":
        try:
            return TorchExecutor(read_config_only(options.model), device=options.device or default_device,  # type: ignore[arg-type]
                                 dtype=options.dtype, forward_sizes=sizes, dummy_seed=0, async_steps=async_steps,
                                 quantization=quantization(options), w8a8_rows=w8a8_rows(options),
                                 kv_cache_dtype=options.kv_cache_dtype)
        except ValueError as exc:
            if str(exc).startswith("quantization"):
                raise ConfigError(f"--quantization: {exc}") from None
            raise
    checkpoint = load_checkpoint(options.model, progress=options.progress)
    vision = None
    try:
        vision = load_vision(options.model, options.mmproj, checkpoint.config.hidden_size)
        try:
            return TorchExecutor(checkpoint, device=options.device or default_device, dtype=options.dtype,
                                 forward_sizes=sizes, vision=vision, weights=weight_mode(options),
                                 async_steps=async_steps, quantization=quantization(options),
                                 w8a8_rows=w8a8_rows(options), kv_cache_dtype=options.kv_cache_dtype)
        except ValueError as exc:
            if str(exc).startswith("quantization"):
                raise ConfigError(f"--quantization: {exc}") from None
            if "weights 'stored'" in str(exc):
                raise ConfigError(f"--weights stored: {exc}") from None
            raise
    finally:
        checkpoint.close()
        if vision is not None:
            vision.close()


def kv_layout(options: ExecutorOptions, default_device: str) -> tuple[int, int]:
    """``(bytes per KV block, block size)`` from the checkpoint's config, no weights read.
    With ``--tensor-parallel-size`` N, what TensorParallelExecutor.kv_bytes_per_block says:
    a rank's share of a block (its KV heads) on CUDA, where each device holds its own; the
    N shares together on the CPU, where the ranks share the host's memory."""
    import torch

    from musegl_core.engine.kv_dtype import kv_position_bytes
    from musegl_cuda.executor import DEFAULT_BLOCK_SIZE, resolve_dtype

    device = torch.device(options.device or default_device)
    dtype = resolve_dtype(options.dtype, device)
    size = torch.empty((), dtype=dtype).element_size()
    config = read_config_only(options.model).config
    per_block = kv_position_bytes(config, options.kv_cache_dtype, size) * DEFAULT_BLOCK_SIZE
    ranks = tensor_parallel_size(options)
    if ranks > 1:
        from musegl_cuda.parallel.shard import ShardPlan

        try:
            per_rank = per_block * ShardPlan.of(config, ranks).kv_heads.size // config.num_kv_heads
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        per_block = per_rank * ranks if device.type == "cpu" else per_rank
    return per_block, DEFAULT_BLOCK_SIZE


def memory_plan(options: ExecutorOptions, default_device: str):
    """The weights' bytes on the device and its memory, before loading (:mod:`musegl_cuda.memory_plan`)."""
    from musegl_cuda import memory_plan as plan

    return plan.memory_plan(options, default_device)


def create_cuda(options: ExecutorOptions) -> "TorchExecutor":
    """The decoder on a GPU (``options.device`` or ``cuda``), bfloat16 unless told otherwise."""
    return _create(options, "cuda")


def create_torch_cpu(options: ExecutorOptions) -> "TorchExecutor":
    """The decoder on the CPU (``options.device`` or ``cpu``): float32 activations and the
    checkpoint's matrices as stored (``--weights stored``) unless told otherwise."""
    return _create(options, "cpu")


@hookimpl
def musegl_executors() -> list[ExecutorSpec]:
    return [
        ExecutorSpec(name="cuda", description="Muse Glimmer decoder in PyTorch on an NVIDIA GPU",
                     create=create_cuda, available=cuda_available, priority=100,
                     kv_layout=lambda options: kv_layout(options, "cuda"), check=check_model,
                     kv_cache_dtypes=KV_CACHE_DTYPES, memory_plan=lambda options: memory_plan(options, "cuda"),
                     sliding_pages=True),
        ExecutorSpec(name="torch-cpu", description="Muse Glimmer decoder in PyTorch on the CPU",
                     create=create_torch_cpu, available=lambda: True, priority=10,
                     kv_layout=lambda options: kv_layout(options, "cpu"), check=check_cpu_model,
                     kv_cache_dtypes=KV_CACHE_DTYPES, memory_plan=lambda options: memory_plan(options, "cpu"),
                     sliding_pages=True),
    ]
