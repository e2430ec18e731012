"""Load a DFlash speculator next to a loaded target executor.

The draft has no embedding table and no lm_head: it uses the target's (raw
embedding rows, raw lm_head). When the executor holds them as torch tensors
(the ``cuda``/``torch-cpu`` executors: ``executor.model.embed_tokens`` and
``executor.model.lm_head.weight``) they are shared, no copy; when the torch-cpu
executor keeps its weights in stored form (``--weights stored``: f16/bf16/Q8_0
... read by its kernels) the draft goes through those stored matrices; for any
other executor they are read from the target checkpoint (``options.model``) once.
The draft runs on the executor's torch device and dtype when it has them,
else on ``options.device`` (default CPU) in ``options.dtype`` (default float32).
"""

from __future__ import annotations

from typing import Any

import torch

from musegl_core.plugins.specs import ExecutorOptions
from musegl_dflash.checkpoint import DraftCheckpoint
from musegl_dflash.model import DFlashDraft
from musegl_dflash.speculator import DFlashSpeculator, TargetHead

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _placement(executor: Any, options: ExecutorOptions) -> tuple[torch.device, torch.dtype]:
    device, dtype = getattr(executor, "device", None), getattr(executor, "dtype", None)
    if isinstance(device, torch.device) and isinstance(dtype, torch.dtype):
        return device, dtype
    return torch.device(options.device or "cpu"), DTYPES.get(options.dtype or "float32", torch.float32)


def target_head(executor: Any, options: ExecutorOptions, device: torch.device, dtype: torch.dtype) -> TargetHead:
    """The target's raw embedding rows and lm_head product."""
    model = getattr(executor, "model", None)
    embed_stored = getattr(model, "embed_stored", None)
    head_layer = getattr(model, "lm_head", None)
    if embed_stored is not None and getattr(head_layer, "stored", None) is not None:
        def rows(ids: torch.Tensor) -> torch.Tensor:
            return embed_stored.dequantize(ids.reshape(-1)).view(*ids.shape, -1)

        return TargetHead(rows, lambda hidden: head_layer.stored.matmul(hidden.float()))
    embed = getattr(model, "embed_tokens", None)
    head = getattr(head_layer, "weight", None)
    if isinstance(embed, torch.Tensor) and isinstance(head, torch.Tensor) and embed.device.type != "meta":
        return TargetHead.of_tensors(embed.detach(), head.detach())
    from musegl_core.checkpoint.loader import load_checkpoint

    checkpoint = load_checkpoint(options.model)
    try:
        return TargetHead.of_tensors(torch.from_numpy(checkpoint.read("embed_tokens.weight")).to(device, dtype),
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
    return DFlashSpeculator(draft, target_head(executor, options, device, dtype), n_draft, executor.block_size)
