"""An export directory: ``model.pte`` + ``model.ptd`` + ``musegl-export.json``
(the manifest) + the tokenizer files, and how MODEL paths resolve to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import cattrs

from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.vision import VisionConfig
from musegl_core.errors import ConfigError
from musegl_dflash.checkpoint import DraftConfig

MANIFEST = "musegl-export.json"
#: The off-graph KV ABI this plugin writes and runs (bumped on any change of the inputs).
ABI = "musegl-offgraph-kv/1"
#: ... exported with ``--sliding-pages`` (pools of layer groups' places, window cells per sliding group):
#: another name, so that a server that does not know it refuses the program instead of misreading it
SLIDING_ABI = "musegl-offgraph-kv/1-sliding-pages"
FORMAT = "musegl-executorch"

converter = cattrs.Converter()

#: The inputs of the ``vision_encoder`` method (``musegl_executorch/export/vision.py``).
VISION_INPUTS = ("pixels", "pos_index", "pos_weight", "cos", "sin", "windows", "window_keys", "unwindow", "shuffle")


@attrs.frozen
class ExportLimits:
    """The bounds the program was exported with."""

    native_context: int  # positions the model supports (the checkpoint's max_position_embeddings)
    max_prefill_chunk: int  # most rows of one forward_others call
    max_cells: int  # most pool cells (blocks x block_size) a method accepts
    forward_sizes: tuple[int, ...]  # the static forward_{N} methods
    #: the fewest head rows forward_others and forward_from_embeddings take: 0 lets a prefill
    #: piece whose logits nobody reads skip the head; 1 in the manifests of earlier exports
    #: (and with --max-prefill-chunk 1), whose pieces run the head on a dummy row
    min_head_rows: int = 1


@attrs.frozen
class VisionExport:
    """The vision encoder inside the program (``musegl export --mmproj``)."""

    config: VisionConfig
    max_patches: int  # the most ViT patches one image may have (the exported patch capacity)
    source: str = ""  # the projector (or Hugging Face directory) it came from
    #: the vision_encoder's inputs (musegl_executorch.export.vision.VISION_INPUTS); () in the
    #: manifests of earlier exports, whose encoder took a whole-image window mask instead
    inputs: tuple[str, ...] = ()


@attrs.frozen
class DFlashExport:
    """The DFlash draft inside the program (``musegl export --dflash DRAFT``): the target
    methods return the draft's taps as a fourth output ``hidden``, and the program has
    ``draft_context`` and ``draft_block``."""

    config: DraftConfig
    max_owners: int  # most blocks one draft_block call drafts
    context_keys: int  # most context keys one block reads (the draft's window, or the pool)
    source: str = ""  # the draft checkpoint it came from

    @property
    def taps(self) -> tuple[int, ...]:
        return self.config.taps

    @property
    def max_block(self) -> int:
        """Rows of the widest block (``[anchor, MASK × n]``): the draft's trained block size."""
        return self.config.block_size


@attrs.frozen
class Manifest:
    """``musegl-export.json``: what the program is and how to call it."""

    format: str
    abi: str
    name: str
    config: TextConfig
    activation_dtype: str
    quantization: str  # "none" or "int8-weight-only"
    limits: ExportLimits
    methods: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    program: str = "model.pte"
    data: str = "model.ptd"
    tokenizer: str = "tokenizer.json"
    source: str = ""
    executorch_version: str = ""
    export_seconds: float = 0.0
    vision: VisionExport | None = None  # None: a text-only program
    dflash: DFlashExport | None = None  # None: no draft (the methods return no hidden states)
    #: pools of layer groups' places and window cells per sliding group (``--sliding-pages``);
    #: False in the manifests of earlier exports
    sliding_pages: bool = False

    def dump(self) -> str:
        return json.dumps(converter.unstructure(self), indent=2) + "\n"


def claims(model: str) -> bool:
    """Is ``model`` an ExecuTorch artifact (a ``.pte`` file or an export directory)?"""
    path = Path(model)
    return (path.is_file() and path.suffix == ".pte") or (path.is_dir() and (path / MANIFEST).is_file())


def directory_of(model: str) -> Path:
    path = Path(model)
    return path if path.is_dir() else path.parent


def read_manifest(model: str) -> Manifest:
    """The manifest of an artifact, checked: one line (ConfigError) for anything a
    server cannot run, including a program exported without the off-graph ABI."""
    path = Path(model)
    if not path.exists():
        raise ConfigError(f"{model}: no such file or directory")
    manifest_path = directory_of(model) / MANIFEST
    if not manifest_path.is_file():
        raise ConfigError(f"{model}: no {MANIFEST} beside the program: not a musegl export with the off-graph "
                          f"KV ABI (export it with `musegl export CHECKPOINT -o DIR`)")
    try:
        raw: dict[str, Any] = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{manifest_path}: unreadable manifest ({exc})") from None
    if raw.get("format") != FORMAT or raw.get("abi") not in (ABI, SLIDING_ABI):
        raise ConfigError(f"{model}: exported without the off-graph KV ABI {ABI!r} "
                          f"(found {raw.get('abi')!r}); re-export it with `musegl export`")
    try:
        manifest = converter.structure(raw, Manifest)
    except Exception as exc:  # cattrs raises a class group
        raise ConfigError(f"{manifest_path}: malformed manifest ({type(exc).__name__})") from None
    if manifest.sliding_pages != (manifest.abi == SLIDING_ABI):
        raise ConfigError(f"{manifest_path}: malformed manifest (ABI {manifest.abi!r} with sliding_pages "
                          f"{manifest.sliding_pages})")
    directory = directory_of(model)
    if path.is_file() and path.name != manifest.program:
        raise ConfigError(f"{model}: the manifest beside it describes {manifest.program}, not {path.name}")
    for name in (manifest.program, manifest.data):
        if not (directory / name).is_file():
            raise ConfigError(f"{model}: {name} is missing from the export directory")
    if manifest.vision is not None and manifest.vision.inputs != VISION_INPUTS:
        raise ConfigError(f"{model}: its vision encoder takes {list(manifest.vision.inputs) or 'a whole-image mask'} "
                          f"(an earlier musegl export), not {list(VISION_INPUTS)}; re-export it with musegl export MODEL --mmproj PROJECTOR")
    return manifest
