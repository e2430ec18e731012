"""Hook implementations of the musegl-dflash plugin (entry point ``dflash``).

``musegl serve MODEL --dflash DRAFT [--dflash-n-draft N]`` enables DFlash
speculative decoding with the assistant model at DRAFT (a Hugging Face
directory or a DFlash GGUF). torch is imported only when a draft is loaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from musegl_core.errors import ConfigError
from musegl_core.plugins.hookspecs import hookimpl
from musegl_core.plugins.specs import ExecutorOptions, SpeculatorSpec

if TYPE_CHECKING:
    from musegl_dflash.checkpoint import DraftConfig
    from musegl_dflash.speculator import DFlashSpeculator


@attrs.frozen
class DFlashOptions:
    """The plugin's flags, from ``options.extra``."""

    #: the draft checkpoint (HF directory or DFlash GGUF); None: DFlash is off
    draft: str | None = None
    #: drafts per step; None or 0: the draft's block size minus one
    n_draft: int | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "DFlashOptions":
        return cls(draft=extra.get("dflash"), n_draft=extra.get("dflash_n_draft"))


@attrs.frozen
class TargetShape:
    """What the draft must fit: the target's vocabulary, hidden size and layer count."""

    vocab_size: int
    hidden_size: int
    num_layers: int


def resolve(options: DFlashOptions, draft: "DraftConfig", target: TargetShape) -> int:
    """Check that the draft fits the target and the flags; returns the number of drafts
    per step. Raises :class:`ConfigError` with one line otherwise."""
    where = f"--dflash {options.draft}"
    if draft.hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: the draft's hidden size {draft.hidden_size} does not match the target's "
                          f"{target.hidden_size}")
    if draft.vocab_size is not None and draft.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: the draft was made for a vocabulary of {draft.vocab_size} tokens; the target "
                          f"has {target.vocab_size}")
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise ConfigError(f"{where}: the draft's mask token {draft.mask_token_id} is outside the target's "
                          f"vocabulary of {target.vocab_size} tokens")
    bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ConfigError(f"{where}: the draft reads target layers {list(draft.target_layer_ids)} but the target "
                          f"has {target.num_layers} layers (0..{target.num_layers - 1})")
    most = draft.block_size - 1
    n = options.n_draft
    if n is None or n == 0:
        return most
    if not 1 <= n <= most:
        raise ConfigError(f"--dflash-n-draft must be between 1 and {most} for this draft (block size "
                          f"{draft.block_size}; 0 means {most}), got {n}")
    return n


EXPORT_MANIFEST = "musegl-export.json"


def names_an_export(path: str) -> bool:
    """Does ``--dflash`` name an exported program (a ``musegl export ... --dflash``
    directory or its ``.pte``)? Its draft runs inside the program: the executor that
    serves the export checks and creates it."""
    p = Path(path)
    return (p.is_dir() and (p / EXPORT_MANIFEST).is_file()) or (p.is_file() and p.suffix == ".pte")


def _draft_config(options: DFlashOptions) -> "DraftConfig":
    from musegl_dflash.checkpoint import read_draft_config

    try:
        return read_draft_config(options.draft)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--dflash {options.draft}: {exc}") from None


def _target_config(options: ExecutorOptions) -> Any:
    """The target's text config; a bare ``config.json`` served with ``--load-format dummy``
    (random weights) has no weights to open, so its config is read alone."""
    if options.extra.get("load_format") == "dummy":
        from musegl_core.checkpoint.loader import read_text_config

        return read_text_config(options.model)[0]
    from musegl_core.checkpoint.loader import load_checkpoint

    checkpoint = load_checkpoint(options.model)
    try:
        return checkpoint.config
    finally:
        checkpoint.close()


def check(options: ExecutorOptions) -> None:
    """Validate the flags against the draft's and the target's configs before anything loads
    (called by ``musegl serve`` in the front; numpy only)."""
    flags = DFlashOptions.from_extra(options.extra)
    if flags.draft is None:
        if flags.n_draft is not None:
            raise ConfigError("--dflash-n-draft needs --dflash DRAFT")
        return
    if names_an_export(flags.draft):
        return  # the executor of the export checks its own draft program
    draft = _draft_config(flags)
    c = _target_config(options)
    resolve(flags, draft, TargetShape(c.vocab_size, c.hidden_size, c.num_layers))


def create(executor: Any, options: ExecutorOptions) -> "DFlashSpeculator | None":
    """The speculator for ``--dflash`` (None when it is not given), loaded next to ``executor``."""
    flags = DFlashOptions.from_extra(options.extra)
    if flags.draft is None:
        if flags.n_draft is not None:
            raise ConfigError("--dflash-n-draft needs --dflash DRAFT")
        return None
    if names_an_export(flags.draft):
        host = getattr(executor, "dflash_speculator", None)
        if host is None:
            raise ConfigError(f"--dflash {flags.draft} is an exported program's draft, which runs only inside "
                              f"that export: musegl serve {flags.draft} --dflash {flags.draft}")
        return host(flags)
    draft_config = _draft_config(flags)
    info = executor.info
    n_draft = resolve(flags, draft_config, TargetShape(info.vocab_size, info.hidden_size, info.num_layers))
    from musegl_dflash.loader import load_speculator

    return load_speculator(flags.draft, executor, options, n_draft)


@hookimpl
def musegl_serve_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--dflash", metavar="DRAFT", default=None,
                       help="speculative decoding with this DFlash draft (HF directory or DFlash GGUF)")
    group.add_argument("--dflash-n-draft", metavar="N", type=int, default=None,
                       help="drafts per step (default 0: the draft's block size minus one)")


@hookimpl
def musegl_speculators() -> list[SpeculatorSpec]:
    return [SpeculatorSpec(name="dflash", description="DFlash block drafting with a Muse Glimmer assistant model",
                           create=create, check=check)]
