"""``torch.export`` of :class:`~musegl_executorch.export.graph.OffGraphDecoder`
per method, lowered with the XNNPACK partitioner, written as ``.pte`` + ``.ptd``.

Every method shares one set of weights: they are tagged as external
constants of one data file (``model.ptd``) that the program refers to by
name, so the weights are stored once whatever the number of methods.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import attrs
import torch
from torch.export import Dim

from musegl_core.checkpoint.config import TextConfig
from musegl_executorch.export.graph import OffGraphDecoder

if TYPE_CHECKING:
    from musegl_executorch.export.vision import ExportVisionEncoder

log = logging.getLogger(__name__)

#: The name of the weights file (``model.ptd``); the program records it.
DATA_NAME = "model"
OTHERS = "forward_others"
EMBED_TEXT = "embed_text"
FROM_EMBEDDINGS = "forward_from_embeddings"
VISION_ENCODER = "vision_encoder"


@attrs.frozen
class Limits:
    """The axes' bounds every method is exported with."""

    forward_sizes: tuple[int, ...]
    max_prefill_chunk: int
    max_cells: int
    native_context: int
    window: int


def example_inputs(config: TextConfig, dtype: torch.dtype, groups: int, rows: int, cached: int,
                   windowed: int, cells: int, heads: int) -> tuple[torch.Tensor, ...]:
    """Inputs of the right shapes and valid values (the tracing example)."""
    kv = (config.num_layers, cells, config.num_kv_heads, config.head_dim)
    positions = torch.arange(groups * rows, dtype=torch.long).reshape(groups, rows) + cached
    return (
        torch.zeros(groups, rows, dtype=torch.long),
        positions,
        torch.zeros(kv, dtype=dtype),
        torch.zeros(kv, dtype=dtype),
        torch.arange(groups * cached, dtype=torch.long).reshape(groups, cached) % cells,
        torch.zeros(groups, rows, cached, dtype=torch.float32),
        torch.arange(groups * windowed, dtype=torch.long).reshape(groups, windowed) % cells,
        torch.zeros(groups, rows, windowed, dtype=torch.float32),
        torch.arange(heads, dtype=torch.long),
    )


def _axis(name: str, upper: int):
    """A dynamic axis over 1..upper, or the static size 1 when upper is 1."""
    return Dim(name, min=1, max=upper) if upper > 1 else None


def method_shapes(limits: Limits, groups: int | None):
    """(example sizes, dynamic_shapes) of one method: ``forward_{groups}`` (``groups``
    single-row groups) or, for ``groups=None``, ``forward_others`` (one group of up to
    ``max_prefill_chunk`` rows)."""
    cells = Dim("cells", min=2, max=limits.max_cells)
    kf_max = min(limits.native_context, limits.max_cells)  # a call never reads more keys than the pool holds
    kw_max = max(1, limits.window - 1)
    kf, kw = _axis("cached", kf_max), _axis("windowed", kw_max)
    if groups is None:
        t = _axis("rows", limits.max_prefill_chunk)
        r = _axis("heads", limits.max_prefill_chunk)
        sizes = dict(groups=1, rows=min(3, limits.max_prefill_chunk), heads=min(2, limits.max_prefill_chunk))
    else:
        t = None
        r = _axis("heads", groups)
        sizes = dict(groups=groups, rows=1, heads=min(2, groups))
    sizes.update(cached=min(3, kf_max), windowed=min(2, kw_max), cells=8)

    def axes(**named) -> dict | None:
        found = {int(k[1:]): v for k, v in named.items() if v is not None}
        return found or None

    dynamic = (
        axes(d1=t), axes(d1=t),  # tokens, positions
        {1: cells}, {1: cells},  # k_pool, v_pool
        axes(d1=kf), axes(d1=t, d2=kf),  # full_slots, full_bias
        axes(d1=kw), axes(d1=t, d2=kw),  # window_slots, window_bias
        axes(d0=r),  # head_rows
    )
    return sizes, dynamic


def export_methods(module: OffGraphDecoder, limits: Limits,
                   progress: Callable[[int, int, str], None] | None = None,
                   vision: "ExportVisionEncoder | None" = None,
                   vision_patches: int = 0) -> dict[str, torch.export.ExportedProgram]:
    """``torch.export`` of every method, weights tagged for the external data file; with
    ``vision``, also ``embed_text``, ``forward_from_embeddings`` and ``vision_encoder``
    (images of up to ``vision_patches`` patches)."""
    from musegl_executorch.export.graph import EmbedText, FromEmbeddings

    names = [f"forward_{n}" for n in limits.forward_sizes] + [OTHERS]
    if vision is not None:
        names += [EMBED_TEXT, FROM_EMBEDDINGS, VISION_ENCODER]
    methods: dict[str, torch.export.ExportedProgram] = {}
    for done, name in enumerate(names):
        if progress:
            progress(done, len(names), f"exporting {name}")
        if name == VISION_ENCODER:
            methods[name] = _export(vision, *vision_shapes(vision.config, vision_patches))
            continue
        if name == EMBED_TEXT:
            t = _axis("rows", limits.max_prefill_chunk)
            rows = min(3, limits.max_prefill_chunk)
            methods[name] = _export(EmbedText(module), (torch.zeros(rows, dtype=torch.long),),
                                    ({0: t} if t is not None else None,))
            continue
        groups = None if name in (OTHERS, FROM_EMBEDDINGS) else int(name.removeprefix("forward_"))
        sizes, dyn = method_shapes(limits, groups)
        inputs = example_inputs(module.config, module.dtype, **sizes)
        if name == FROM_EMBEDDINGS:
            first = torch.zeros(*inputs[0].shape, module.config.hidden_size, dtype=module.dtype)
            methods[name] = _export(FromEmbeddings(module), (first,) + inputs[1:], dyn)
        else:
            methods[name] = _export(module, inputs, dyn)
    if progress:
        progress(len(names), len(names), "exported")
    return methods


def _export(module: torch.nn.Module, inputs: tuple, dynamic) -> torch.export.ExportedProgram:
    """One method, its weights tagged as constants of the external data file."""
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    program = torch.export.export(module, inputs, dynamic_shapes=dynamic, strict=False)
    tagged = program.module()
    delegate_external_constants_pass_unlifted(module=tagged, gen_tag_fn=lambda _node: DATA_NAME)
    return torch.export.export(tagged, inputs, dynamic_shapes=dynamic, strict=False)


def vision_shapes(config, max_patches: int):
    """Example inputs and dynamic shapes of ``vision_encoder``: ``N = 4·M`` patches,
    ``M`` merged rows in 1 .. max_patches / 4."""
    from musegl_executorch.export.vision import example_vision_inputs

    merged = Dim("merged", min=1, max=max(2, max_patches // 4))
    n = 4 * merged
    inputs = example_vision_inputs(config, (4, 6))
    return inputs, ({0: n}, {0: n}, {0: n}, {0: n}, {0: n}, {0: n, 1: n}, {0: merged})


def lower(methods: dict[str, torch.export.ExportedProgram]):
    """XNNPACK-partitioned ExecuTorch program; graph inputs are not memory-planned
    (the pool is handed in by the caller without a copy). XNNPACK takes the linear
    layers and the head's softcap ``tanh``: the portable ``tanh`` kernel is scalar and
    took about half of a decode call over the 202,048-wide logits."""
    from executorch.backends.xnnpack.partition.config import LinearConfig, TanhConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    edge = to_edge_transform_and_lower(methods, partitioner=[XnnpackPartitioner(configs=[LinearConfig, TanhConfig])],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.to_executorch(ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
        external_constants=lambda _node: DATA_NAME,
    ))


def write(program, outdir: Path) -> tuple[Path, Path]:
    """``model.pte`` and ``model.ptd`` in ``outdir``."""
    outdir.mkdir(parents=True, exist_ok=True)
    pte = outdir / f"{DATA_NAME}.pte"
    pte.write_bytes(program.buffer)
    program.write_tensor_data_to_file(str(outdir))
    ptd = outdir / f"{DATA_NAME}.ptd"
    if not ptd.is_file():
        raise RuntimeError(f"the lowering wrote no {ptd.name} (weights would be inside the .pte)")
    return pte, ptd
