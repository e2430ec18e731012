"""From a loaded checkpoint to an export directory."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from musegl_core.errors import ConfigError

from musegl_executorch.artifact import (ABI, FORMAT, MANIFEST, SLIDING_ABI, VISION_INPUTS, DFlashExport,
                                        ExportLimits, Manifest, VisionExport)
from musegl_executorch.export.graph import HIDDEN_OUTPUT, INPUT_NAMES, OUTPUT_NAMES, OffGraphDecoder
from musegl_executorch.export.lower import (Limits, draft_context_keys, export_method, lower_method, method_names,
                                            min_head_rows, prepare, to_program, write)
from musegl_executorch.export.workers import Report, lower_all

#: The name of the last bar of :func:`build_artifact`'s ``method_progress``: the program's
#: emission and writing, after every method is lowered.
PROGRAM = "program"

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_decoder(checkpoint, dtype: torch.dtype) -> OffGraphDecoder:
    """The checkpoint's weights in the export module (through the torch executor's
    loader, so both executors read a checkpoint the same way)."""
    from musegl_cuda.model import MuseGlimmerDecoder

    with torch.no_grad():
        decoder = MuseGlimmerDecoder(checkpoint.config, dtype, torch.device("cpu"))
        loaded = set()
        for name, array in checkpoint.iter_weights():
            decoder.load_weight(name, torch.from_numpy(array))
            loaded.add(name)
        missing = set(MuseGlimmerDecoder.weight_names(checkpoint.config)) - loaded
        if missing:
            raise ValueError(f"checkpoint did not provide {sorted(missing)[:5]}")
        return OffGraphDecoder.from_decoder(decoder, dtype)


class Int8Linear(torch.nn.Module):
    """Weight-only int8 linear layer: per-output-channel symmetric int8 weights and
    float32 scales; the graph dequantizes (``int8 -> activation dtype, x scale``)
    and multiplies, so only the int8 weights and the scales are stored."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = (self.weight_int8.to(torch.float32) * self.scale[:, None]).to(x.dtype)
        return torch.nn.functional.linear(x, weight)


def quantize_int8(module: OffGraphDecoder) -> None:
    """Replace every linear layer (projections, MLP, head) with :class:`Int8Linear`."""
    for layer in module.layers:
        for name in ("qkvg", "o_proj", "gate_up", "down_proj"):
            setattr(layer, name, Int8Linear(getattr(layer, name)))
    module.lm_head = Int8Linear(module.lm_head)


def write_tokenizer(tokenizer, out: Path) -> None:
    """``tokenizer.json`` + the ids and template a Hugging Face directory declares beside it."""
    (out / "tokenizer.json").write_text(tokenizer.to_tokenizer_json(), encoding="utf-8")
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": list(tokenizer.end_of_generation_ids)}
    if tokenizer.pad_id is not None:
        generation["pad_token_id"] = tokenizer.pad_id
    if tokenizer.mask_id is not None:
        generation["mask_token_id"] = tokenizer.mask_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer.chat_template:
        (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": tokenizer.chat_template}) + "\n")


def load_vision_module(vision_weights, config, dtype: torch.dtype):
    """The projector's weights in the exportable tower (through the eager loader)."""
    from musegl_cuda.vision import load_vision_encoder
    from musegl_executorch.export.vision import ExportVisionEncoder

    with torch.no_grad():
        return ExportVisionEncoder(load_vision_encoder(vision_weights, config, dtype, torch.device("cpu")))


def load_draft_module(path: str, dtype: torch.dtype):
    """The DFlash draft's weights in the exportable modules (through the eager loader)."""
    from musegl_dflash.loader import load_draft
    from musegl_executorch.export.draft import DraftWeights

    with torch.no_grad():
        return DraftWeights.from_draft(load_draft(path, torch.device("cpu"), dtype), dtype)


def build_artifact(checkpoint, tokenizer, out: Path, *, forward_sizes: tuple[int, ...], max_prefill_chunk: int,
                   max_cells: int, activation_dtype: str, quantization: str,
                   progress: Callable[[int, int, str], None] | None = None, vision_weights=None,
                   vision_patches: int = 0, vision_source: str = "", draft_path: str | None = None,
                   draft_owners: int = 8, jobs: int = 1, method_progress: Report | None = None,
                   sliding_pages: bool = False) -> Manifest:
    """Export the checkpoint to ``out``. ``jobs`` processes export and lower the methods
    (:mod:`musegl_executorch.export.workers`); ``method_progress(method, done, total,
    what)`` follows each method, ``progress(done, total, what)`` the whole export (a
    step per lowered method, then the program). ``sliding_pages``: pools of layer groups'
    places and one set of window cells per sliding group (``--sliding-pages``;
    :meth:`~musegl_executorch.export.graph.OffGraphDecoder.use_page_groups`)."""
    from executorch.version import __version__ as et_version

    started = time.perf_counter()
    config = checkpoint.config
    module = load_decoder(checkpoint, DTYPES[activation_dtype])
    if quantization == "int8-weight-only":
        quantize_int8(module)
    if sliding_pages:
        from musegl_core.engine.sliding_pages import PageGroups

        groups = PageGroups.of(config.sliding)
        if groups is None:
            raise ConfigError("--sliding-pages: this model's full layers do not form one group of as many layers "
                              "as each group of sliding layers (docs/engine.md \"Sliding layers keep their window\")")
        module.use_page_groups(groups)
    limits = Limits(forward_sizes, max_prefill_chunk, max_cells, config.max_position_embeddings,
                    config.sliding_window)
    vision = None if vision_weights is None else load_vision_module(vision_weights, config,
                                                                     DTYPES[activation_dtype])
    draft = None if draft_path is None else load_draft_module(draft_path, DTYPES[activation_dtype])
    if draft is not None:
        module.taps = draft.config.taps
    names = method_names(limits, vision is not None, draft is not None)
    finished: list[str] = []

    def report(name: str, done: int, total: int, what: str) -> None:
        if method_progress:
            method_progress(name, done, total, what)
        if done == total and total:
            finished.append(name)
            if progress:
                progress(len(finished), len(names) + 1, f"lowered {name}")

    if progress:
        progress(0, len(names) + 1, "exporting and lowering")
    out.mkdir(parents=True, exist_ok=True)
    for stale in (MANIFEST, "model.pte", "model.ptd"):
        (out / stale).unlink(missing_ok=True)
    prepare()
    with tempfile.TemporaryDirectory(prefix=".lowering-", dir=out) as scratch, torch.no_grad():
        lowered = lower_all(names, lambda name: export_method(name, module, limits, vision, vision_patches, draft,
                                                              draft_owners),
                            lower_method, jobs, Path(scratch), report)
    if method_progress:
        method_progress(PROGRAM, 0, 2, "to_executorch")
    with torch.no_grad():
        program = to_program(lowered)
    if method_progress:
        method_progress(PROGRAM, 1, 2, "writing")
    write(program, out)
    write_tokenizer(tokenizer, out)
    manifest = Manifest(
        format=FORMAT, abi=SLIDING_ABI if sliding_pages else ABI, name=checkpoint.name, config=config, activation_dtype=activation_dtype,
        quantization=quantization,
        limits=ExportLimits(config.max_position_embeddings, max_prefill_chunk, max_cells, forward_sizes,
                            min_head_rows(limits)),
        methods=tuple(lowered),
        inputs=INPUT_NAMES, outputs=OUTPUT_NAMES + ((HIDDEN_OUTPUT,) if draft is not None else ()), source=str(checkpoint.path), executorch_version=et_version,
        export_seconds=round(time.perf_counter() - started, 2),
        vision=None if vision is None else VisionExport(vision.config, vision_patches, vision_source, VISION_INPUTS),
        dflash=None if draft is None else DFlashExport(draft.config, draft_owners,
                                                       draft_context_keys(draft.config, limits), str(draft_path)),
        sliding_pages=sliding_pages,
    )
    (out / MANIFEST).write_text(manifest.dump())  # last: a directory without it is no export
    if method_progress:
        method_progress(PROGRAM, 2, 2, "written")
    if progress:
        progress(len(names) + 1, len(names) + 1, "written")
    return manifest
