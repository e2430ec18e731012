"""Hook implementations of the musegl-executorch plugin (entry point ``executorch``).

* the ``export`` command (``musegl export MODEL -o OUTDIR``);
* the ``executorch`` executor, which claims ``.pte`` files and export
  directories, so ``musegl serve OUTDIR`` picks it without ``--executor``.

executorch and torch are imported inside the functions: ``musegl --help``
and the front stay fast.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from musegl_core.errors import ConfigError
from musegl_core.plugins.hookspecs import hookimpl
from musegl_core.plugins.specs import CommandSpec, ExecutorOptions, ExecutorSpec
from musegl_executorch.artifact import claims, directory_of, read_manifest

if TYPE_CHECKING:
    from musegl_executorch.executor import ExecuTorchExecutor


def executorch_available() -> bool:
    """The runtime is installed (its XNNPACK backend is checked when a program loads)."""
    return importlib.util.find_spec("executorch") is not None


def check(options: ExecutorOptions) -> None:
    """The front's check: an export with the off-graph ABI, within its native context."""
    if (options.extra.get("tensor_parallel_size") or 1) > 1:
        raise ConfigError("--tensor-parallel-size: the executorch executor runs the program in one process "
                          "(tensor parallelism is the cuda and torch-cpu executors')")
    manifest = read_manifest(options.model)
    if options.max_context is not None and options.max_context > manifest.limits.native_context:
        raise ConfigError(f"--max-context {options.max_context} is beyond the exported native context "
                          f"{manifest.limits.native_context} of {options.model}")
    if options.mmproj and manifest.vision is None:
        raise ConfigError(f"{options.model} is a text-only export (no vision encoder); --mmproj cannot add one at "
                          f"serve time: re-export with musegl export MODEL --mmproj {options.mmproj} -o DIR")
    if options.mmproj:
        raise ConfigError(f"{options.model} already holds its vision encoder (exported from "
                          f"{manifest.vision.source or 'a projector'}); serve it without --mmproj")
    check_dflash(options, manifest)
    if options.dtype and options.dtype != manifest.activation_dtype:
        raise ConfigError(f"--dtype {options.dtype}: the program was exported with activation dtype "
                          f"{manifest.activation_dtype} (re-export with --activation-dtype)")


def check_dflash(options: ExecutorOptions, manifest) -> None:
    """``--dflash`` with an export: the draft runs inside the program, so ``--dflash`` names
    the served export itself, which must hold a draft that fits its target."""
    from pathlib import Path

    draft = options.extra.get("dflash")
    if draft is None:
        return
    if manifest.dflash is None:
        raise ConfigError(f"{options.model} was exported without a DFlash draft (its methods return no hidden "
                          f"states); re-export with musegl export MODEL --dflash {draft} -o DIR")
    served = directory_of(options.model).resolve()
    if Path(draft).exists() and directory_of(draft).resolve() == served and claims(draft):
        from musegl_dflash.plugin import DFlashOptions, TargetShape, resolve

        c = manifest.config
        resolve(DFlashOptions.from_extra(options.extra), manifest.dflash.config,
                TargetShape(c.vocab_size, c.hidden_size, c.num_layers))
        return
    if claims(draft):
        other = read_manifest(draft)
        raise ConfigError(f"--dflash {draft}: that draft program belongs to the export of {other.source or other.name}, "
                          f"not to {options.model} (exported from {manifest.source or manifest.name}); a draft "
                          f"program runs only with the target it was exported with: --dflash {options.model}")
    raise ConfigError(f"{options.model} already holds its DFlash draft (exported from "
                      f"{manifest.dflash.source or 'a draft'}); serve it with --dflash {options.model}")


def create(options: ExecutorOptions) -> "ExecuTorchExecutor":
    from musegl_executorch.executor import ExecuTorchExecutor

    check(options)
    if options.progress:
        options.progress(0, 1, "loading the program")
    executor = ExecuTorchExecutor(options.model, max_context=options.max_context)
    if options.progress:
        options.progress(1, 1, "loaded")
    return executor


def kv_layout(options: ExecutorOptions) -> tuple[int, int]:
    from musegl_core.engine.dtypes import ITEMSIZE, dtype_name
    from musegl_core.engine.kv_sizing import kv_block_bytes
    from musegl_executorch.executor import BLOCK_SIZE

    manifest = read_manifest(options.model)
    size = ITEMSIZE[dtype_name(manifest.activation_dtype)]
    return kv_block_bytes(manifest.config, BLOCK_SIZE, size), BLOCK_SIZE


def _add_export_arguments(parser) -> None:
    from musegl_executorch.export.command import add_arguments

    add_arguments(parser)


def _run_export(args) -> int:
    from musegl_executorch.export.command import run

    return run(args)


@hookimpl
def musegl_executors() -> list[ExecutorSpec]:
    return [ExecutorSpec(name="executorch", description="an exported Muse Glimmer program (musegl export) "
                                                        "on the CPU through ExecuTorch (XNNPACK)",
                         create=create, available=executorch_available, priority=5, kv_layout=kv_layout,
                         claims=claims, check=check, sliding_pages=True)]


@hookimpl
def musegl_commands() -> list[CommandSpec]:
    return [CommandSpec(name="export", description="export a checkpoint as an ExecuTorch program (.pte + .ptd)",
                        add_arguments=_add_export_arguments, run=_run_export)]
