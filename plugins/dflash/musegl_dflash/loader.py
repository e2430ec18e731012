"""Load a DFlash speculator next to a loaded target executor.

The draft has no embedding table and no lm_head: it uses the target's (raw
embedding rows, raw lm_head). When the executor holds them as torch tensors
(the ``cuda``/``torch-cpu`` executors: ``executor.model.embed_tokens`` and
``executor.model.lm_head.weight``) they are shared, no copy; for any other
executor they are read from the target checkpoint (``options.model``) once.
The draft runs on the executor's torch device and dtype when it has them,
else on ``options.device`` (default CPU) in ``options.dtype`` (default float32).
"""

from __future__ import annotations

from typing import Any

import torch

from musegl_core.plugins.specs import ExecutorOptions
from musegl_dflash.checkpoint import DraftCheckpoint
from musegl_dflash.model import DFlashDraft
from musegl_dflash.speculator import DFlashSpeculator

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _placement(executor: Any, options: ExecutorOptions) -> tuple[torch.device, torch.dtype]:
    device, dtype = getattr(executor, "device", None), getattr(executor, "dtype", None)
    if isinstance(device, torch.device) and isinstance(dtype, torch.dtype):
        return device, dtype
    return torch.device(options.device or "cpu"), DTYPES.get(options.dtype or "float32", torch.float32)


def target_head(executor: Any, options: ExecutorOptions, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's raw embedding table and lm_head weight, both ``(vocab, hidden)``."""
    model = getattr(executor, "model", None)
    embed = getattr(model, "embed_tokens", None)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if isinstance(embed, torch.Tensor) and isinstance(head, torch.Tensor):
        return embed.detach(), head.detach()
    from musegl_core.checkpoint.loader import load_checkpoint

    checkpoint = load_checkpoint(options.model)
    try:
        return (torch.from_numpy(checkpoint.read("embed_tokens.weight")).to(device, dtype),
                torch.from_numpy(checkpoint.read("lm_head.weight")).to(device, dtype))
    finally:
        checkpoint.close()


def load_draft(path: str, device: torch.device, dtype: torch.dtype, progress=None) -> DFlashDraft:
    checkpoint = DraftCheckpoint(path)
    try:
        draft = DFlashDraft(checkpoint.config, dtype, device)
        names = checkpoint.config.weight_names()
        for done, (name, array) in enumerate(checkpoint.iter_weights(), start=1):
            draft.load_weight(name, torch.from_numpy(array))
            if progress is not None:
                progress(done, len(names), f"dflash {name}")
    finally:
        checkpoint.close()
    return draft


def load_speculator(path: str, executor: Any, options: ExecutorOptions, n_draft: int) -> DFlashSpeculator:
    device, dtype = _placement(executor, options)
    draft = load_draft(path, device, dtype, options.progress)
    embed, head = target_head(executor, options, device, dtype)
    return DFlashSpeculator(draft, embed, head, n_draft, executor.block_size)
