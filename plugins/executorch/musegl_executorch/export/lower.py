"""``torch.export`` of :class:`~musegl_executorch.export.graph.OffGraphDecoder`
per method, lowered with the XNNPACK partitioner, written as ``.pte`` + ``.ptd``.

Every method shares one set of weights: they are tagged as external
constants of one data file (``model.ptd``) that the program refers to by
name, so the weights are stored once whatever the number of methods.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch
from torch.export import Dim

from musegl_core.checkpoint.config import TextConfig
from musegl_executorch.export.graph import OffGraphDecoder

if TYPE_CHECKING:
    from musegl_executorch.export.draft import DraftWeights
    from musegl_executorch.export.vision import ExportVisionEncoder

log = logging.getLogger(__name__)

#: The name of the weights file (``model.ptd``); the program records it.
DATA_NAME = "model"
OTHERS = "forward_others"
EMBED_TEXT = "embed_text"
FROM_EMBEDDINGS = "forward_from_embeddings"
VISION_ENCODER = "vision_encoder"
DRAFT_CONTEXT = "draft_context"
DRAFT_BLOCK = "draft_block"


@attrs.frozen
class Limits:
    """The axes' bounds every method is exported with."""

    forward_sizes: tuple[int, ...]
    max_prefill_chunk: int
    max_cells: int
    native_context: int
    window: int


def example_inputs(config: TextConfig, dtype: torch.dtype, groups: int, rows: int, cached: int,
                   windowed: int, cells: int, heads: int, page_groups=None) -> tuple[torch.Tensor, ...]:
    """Inputs of the right shapes and valid values (the tracing example); ``page_groups``
    (a :class:`~musegl_core.engine.sliding_pages.PageGroups`): the sliding pages' shapes."""
    rows_of_pool = config.num_layers if page_groups is None else page_groups.places
    kv = (rows_of_pool, cells, config.num_kv_heads, config.head_dim)
    window = torch.arange(groups * windowed, dtype=torch.long).reshape(groups, windowed) % cells
    if page_groups is not None:
        window = window.expand(page_groups.sliding_groups, groups, windowed).contiguous()
    positions = torch.arange(groups * rows, dtype=torch.long).reshape(groups, rows) + cached
    return (
        torch.zeros(groups, rows, dtype=torch.long),
        positions,
        torch.zeros(kv, dtype=dtype),
        torch.zeros(kv, dtype=dtype),
        torch.arange(groups * cached, dtype=torch.long).reshape(groups, cached) % cells,
        torch.zeros(groups, rows, cached, dtype=torch.float32),
        window,
        torch.zeros(groups, rows, windowed, dtype=torch.float32),
        torch.arange(heads, dtype=torch.long),
    )


def _axis(name: str, upper: int):
    """A dynamic axis over 1..upper, or the static size 1 when upper is 1."""
    return Dim(name, min=1, max=upper) if upper > 1 else None


def min_head_rows(limits: Limits) -> int:
    """The fewest head rows ``forward_others`` (and ``forward_from_embeddings``) take: 0, so
    that a prefill piece nobody samples skips the head (a vocabulary-wide product), unless
    a piece is one row (the axis would be 0..1, which ``torch.export`` specializes)."""
    return 0 if limits.max_prefill_chunk >= 2 else 1


def method_shapes(limits: Limits, groups: int | None, sliding_pages: bool = False):
    """(example sizes, dynamic_shapes) of one method: ``forward_{groups}`` (``groups``
    single-row groups) or, for ``groups=None``, ``forward_others`` (one group of up to
    ``max_prefill_chunk`` rows, 0 .. ``max_prefill_chunk`` head rows: see
    :func:`min_head_rows`). ``sliding_pages``: ``window_slots`` has a leading axis of sliding
    groups (static)."""
    cells = Dim("cells", min=2, max=limits.max_cells)
    kf_max = min(limits.native_context, limits.max_cells)  # a call never reads more keys than the pool holds
    kw_max = max(1, limits.window - 1)
    kf, kw = _axis("cached", kf_max), _axis("windowed", kw_max)
    if groups is None:
        t = _axis("rows", limits.max_prefill_chunk)
        r = Dim("heads", min=0, max=limits.max_prefill_chunk) if min_head_rows(limits) == 0 else None
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
        axes(d2=kw) if sliding_pages else axes(d1=kw), axes(d1=t, d2=kw),  # window_slots, window_bias
        axes(d0=r),  # head_rows
    )
    return sizes, dynamic


def method_names(limits: Limits, vision: bool = False, draft: bool = False) -> list[str]:
    """The program's methods, in the program's order: ``forward_{N}`` per forward size,
    ``forward_others``; with ``vision``, ``embed_text``, ``forward_from_embeddings`` and
    ``vision_encoder``; with ``draft``, ``draft_context`` and ``draft_block``."""
    names = [f"forward_{n}" for n in limits.forward_sizes] + [OTHERS]
    if vision:
        names += [EMBED_TEXT, FROM_EMBEDDINGS, VISION_ENCODER]
    if draft:
        names += [DRAFT_CONTEXT, DRAFT_BLOCK]
    return names


def export_method(name: str, module: OffGraphDecoder, limits: Limits,
                  vision: "ExportVisionEncoder | None" = None, vision_patches: int = 0,
                  draft: "DraftWeights | None" = None, draft_owners: int = 0) -> torch.export.ExportedProgram:
    """``torch.export`` of one method (a name of :func:`method_names`), weights tagged for
    the external data file: ``vision_encoder`` takes images of up to ``vision_patches``
    patches, ``draft_block`` up to ``draft_owners`` blocks per call (``module.taps`` set
    to the draft's taps)."""
    from musegl_executorch.export.graph import EmbedText, FromEmbeddings

    if name == VISION_ENCODER:
        return _export(vision, *vision_shapes(vision.config, vision_patches))
    if name in (DRAFT_CONTEXT, DRAFT_BLOCK):
        from musegl_executorch.export.draft import DraftBlock, DraftContext

        if name == DRAFT_CONTEXT:
            return _export(DraftContext(draft), *draft_context_shapes(draft, limits))
        return _export(DraftBlock(draft, module), *draft_block_shapes(draft, limits, draft_owners))
    if name == EMBED_TEXT:
        t = _axis("rows", limits.max_prefill_chunk)
        rows = min(3, limits.max_prefill_chunk)
        return _export(EmbedText(module), (torch.zeros(rows, dtype=torch.long),), ({0: t} if t is not None else None,))
    groups = None if name in (OTHERS, FROM_EMBEDDINGS) else int(name.removeprefix("forward_"))
    page_groups = getattr(module, "page_groups", None)
    sizes, dyn = method_shapes(limits, groups, sliding_pages=page_groups is not None)
    inputs = example_inputs(module.config, module.dtype, **sizes, page_groups=page_groups)
    if name == FROM_EMBEDDINGS:
        first = torch.zeros(*inputs[0].shape, module.config.hidden_size, dtype=module.dtype)
        return _export(FromEmbeddings(module), (first,) + inputs[1:], dyn)
    return _export(module, inputs, dyn)


def _export(module: torch.nn.Module, inputs: tuple, dynamic) -> torch.export.ExportedProgram:
    """One method, its weights tagged as constants of the external data file. The tag
    goes on the lifted weights' placeholders (what XNNPACK's serializer reads), so the
    method is traced once (tagging the unlifted module's attributes and exporting again,
    as ``delegate_external_constants_pass_unlifted`` needs, traced it twice)."""
    from torch.export.graph_signature import InputKind

    program = torch.export.export(module, inputs, dynamic_shapes=dynamic, strict=False)
    kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    weights = {spec.arg.name for spec in program.graph_signature.input_specs if spec.kind in kinds}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in weights:
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = DATA_NAME
    return program


def vision_shapes(config, max_patches: int):
    """Example inputs and dynamic shapes of ``vision_encoder``: ``N = 4·M`` patches,
    ``M`` merged rows in 1 .. max_patches / 4, ``W`` windows in 1 .. the most windows
    a grid of that many patches has."""
    from musegl_executorch.export.vision import example_vision_inputs, most_windows

    merged = Dim("merged", min=1, max=max(2, max_patches // 4))
    n = 4 * merged
    w = Dim("windows", min=1, max=max(2, most_windows(config.pos_side, max_patches)))
    side = config.pos_side
    inputs = example_vision_inputs(config, (2, 2 * side + 2))  # three windows, one of them an edge window
    return inputs, ({0: n}, {0: n}, {0: n}, {0: n}, {0: n}, {0: w}, {0: w}, {0: n}, {0: merged})


def draft_context_keys(config, limits: Limits) -> int:
    """Most context keys one draft block reads: the window when every draft layer slides
    (positions ``P - window .. P - 1``), else every position the pool can hold."""
    reach = min(limits.native_context, limits.max_cells)
    if config.sliding_window is not None and all(config.sliding):
        return max(1, min(config.sliding_window, reach))
    return reach


def draft_context_shapes(draft: "DraftWeights", limits: Limits):
    """Example inputs and dynamic shapes of ``draft_context``: up to ``max_prefill_chunk`` rows."""
    c = draft.config
    n = _axis("rows", limits.max_prefill_chunk)
    rows = min(3, limits.max_prefill_chunk)
    inputs = (torch.zeros(rows, len(c.target_layer_ids) * c.hidden_size, dtype=draft.dtype),
              torch.arange(rows, dtype=torch.long))
    return inputs, ({0: n} if n is not None else None, {0: n} if n is not None else None)


def draft_block_shapes(draft: "DraftWeights", limits: Limits, owners: int):
    """Example inputs and dynamic shapes of ``draft_block``: 1 .. ``owners`` blocks of
    2 .. the draft's block size rows, 1 .. :func:`draft_context_keys` context keys."""
    c = draft.config
    b = _axis("owners", owners)
    r = Dim("block", min=2, max=c.block_size) if c.block_size > 2 else None
    keys = draft_context_keys(c, limits)
    s = _axis("context", keys)
    cells = Dim("cells", min=2, max=limits.max_cells)
    blocks, rows, cached, pool = min(2, owners), min(3, c.block_size), min(3, keys), 8
    kv = (c.num_layers, pool, c.num_kv_heads, c.head_dim)
    inputs = (
        torch.zeros(blocks, rows, dtype=torch.long),
        torch.arange(blocks * rows, dtype=torch.long).reshape(blocks, rows) + cached,
        torch.zeros(kv, dtype=draft.dtype),
        torch.zeros(kv, dtype=draft.dtype),
        torch.arange(blocks * cached, dtype=torch.long).reshape(blocks, cached) % pool,
        torch.zeros(blocks, rows, cached, dtype=torch.float32),
        torch.zeros(blocks, rows, cached, dtype=torch.float32),
        torch.tensor([b * rows + r for b in range(blocks) for r in range(1, rows)], dtype=torch.long),
    )

    def axes(**named) -> dict | None:
        found = {int(k[1:]): v for k, v in named.items() if v is not None}
        return found or None

    m = _axis("drafted", owners * (c.block_size - 1))
    dynamic = (axes(d0=b, d1=r), axes(d0=b, d1=r), {1: cells}, {1: cells}, axes(d0=b, d1=s),
               axes(d0=b, d1=r, d2=s), axes(d0=b, d1=r, d2=s), axes(d0=m))
    return inputs, dynamic


def _partitioner(configs=None):
    """An XNNPACK partitioner whose preserved ops (``aten.linear``) skip ExecuTorch's
    filtered path when every instance of them passes its check.

    ``to_edge_transform_and_lower`` keeps the ops a partitioner wants whole out of the
    decompositions. Given a per-node check, it decomposes the program three times (once
    functionalizing, once with the ops preserved, once more after hiding the nodes that
    pass the check); given none, it preserves every instance and decomposes twice. Each
    decomposition retraces the method with fake tensors and symbolic shapes (the
    largest part of the lowering), so when the check accepts every node of the method
    anyway, this partitioner gives no check: the same ops are preserved, one retrace
    fewer per method (the same ``.pte`` bytes for the tiny preset's methods). When a
    node fails it, the check is kept and ExecuTorch's path is unchanged."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    class Partitioner(XnnpackPartitioner):
        def ops_to_not_decompose(self, ep):
            ops, check = super().ops_to_not_decompose(ep)
            if check is None:
                return ops, check
            wanted = set(ops)
            nodes = [n for n in ep.graph.nodes if n.op == "call_function" and n.target in wanted]
            return (ops, None) if all(check(n) for n in nodes) else (ops, check)

    return Partitioner() if configs is None else Partitioner(configs=configs)


def prepare() -> None:
    """Import the lowering and build what XNNPACK's passes build once per process (the
    patterns its SDPA and bilinear-upsample passes match: a few seconds), so that the
    forked workers of :mod:`musegl_executorch.export.workers` inherit them instead of
    each doing it again."""
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner  # noqa: F401
    from executorch.exir import to_edge_transform_and_lower  # noqa: F401
    from executorch.exir.serde import serialize  # noqa: F401

    sdpa.get_graphs()
    bilinear_2d.get_graphs()


def lower_method(name: str, program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """One method in the edge dialect, XNNPACK-partitioned and lowered. XNNPACK takes the
    linear layers, the head's softcap ``tanh`` (the portable ``tanh`` kernel is scalar and
    took about half of a decode call over the 202,048-wide logits), and the attention's
    batched products and softmax (scalar portable kernels too: they made the vision
    encoder 2.4x slower). ``vision_encoder`` gets the partitioner's every op (its
    elementwise ops too: 0.010 -> 0.008 s of CPU for a 32 x 32-patch image on the tiny
    tower, the eager time); the token methods keep the short list.

    ExecuTorch lowers each method on its own (decompositions, edge passes, partitions,
    XNNPACK's preprocessing: nothing is shared between methods until the program is
    emitted), so lowering the methods one at a time, in any process, gives the same
    program as lowering them in one call (the same ``.pte`` bytes: :func:`to_program`)."""
    from executorch.backends.xnnpack.partition.config import BMMConfig, LinearConfig, SoftmaxConfig, TanhConfig
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    configs = [LinearConfig, TanhConfig, BMMConfig, SoftmaxConfig]
    partitioner = _partitioner() if name == VISION_ENCODER else _partitioner(configs)
    edge = to_edge_transform_and_lower({name: program}, partitioner={name: [partitioner]},
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.exported_program(name)


def to_program(lowered: dict[str, torch.export.ExportedProgram]):
    """The ExecuTorch program of the lowered methods (:func:`lower_method`, in the
    program's order); graph inputs are not memory-planned (the pool is handed in by the
    caller without a copy), the weights go to the external data file."""
    from executorch.exir import EdgeCompileConfig, EdgeProgramManager, ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    # What to_edge_transform_and_lower returns for several methods (its to_backend step
    # builds this manager from the lowered programs, with this config).
    edge = EdgeProgramManager(lowered, None, EdgeCompileConfig(_check_ir_validity=False))
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
