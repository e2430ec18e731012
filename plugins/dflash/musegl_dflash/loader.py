"""Load a DFlash speculator next to a loaded target executor.

The draft has no embedding table and no lm_head: it uses the target's (raw
embedding rows, raw lm_head). An executor that implements the contract's
optional :class:`~musegl_core.engine.executor.TargetAccess` (the torch and
MLX executors) lends them: with torch tensors (the ``cuda``/``torch-cpu``
executors, stored weights included) they are the executor's own, no copy,
and the draft runs on the executor's device and dtype; with another
backend's arrays (MLX) both tables are taken through the interface once, at
load (every embedding row, and the head's product with the identity).
For any other executor they are read from the target checkpoint
(``options.model``) once. Where the executor's arrays are not torch
tensors, the draft runs on ``options.device`` (default CPU) in
``options.dtype`` (default float32).

Over a tensor-parallel executor (one that offers ``speculator_on_ranks``: the
torch plugin's ``TensorParallelExecutor``) the draft is not loaded here: every
rank loads it onto its own device (:func:`rank_speculator`), with the rank's
share of the embedding (a vocabulary-parallel lookup) and the head's argmax
over the ranks (``head_argmax``: each rank's best id, no logits gathered), and
the engine talks to the ranks' replicas through the executor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from musegl_core.engine.dtypes import SPELLINGS
from musegl_core.engine.executor import TargetAccess, target_access
from musegl_core.plugins.specs import ExecutorOptions
from musegl_dflash.checkpoint import DraftCheckpoint
from musegl_dflash.model import DFlashDraft
from musegl_dflash.speculator import DFlashSpeculator, TargetHead, as_tensor


def _options_placement(options: ExecutorOptions) -> tuple[torch.device, torch.dtype]:
    name = SPELLINGS.get(options.dtype or "float32", "float32")
    return torch.device(options.device or "cpu"), getattr(torch, name)


def _lent(access: TargetAccess, info: Any, options: ExecutorOptions) -> tuple[TargetHead, torch.device, torch.dtype]:
    """The head the executor lends, and where the draft runs."""
    probe = access.embedding_rows(np.zeros((1,), dtype=np.int64))
    if isinstance(probe, torch.Tensor):  # a torch executor: its own tensors, its device and dtype
        return TargetHead(access.embedding_rows, access.head_logits), probe.device, probe.dtype
    # Another backend's arrays (MLX): both tables taken through the interface once, as torch
    # tensors: every embedding row, and the head's product with the identity (its raw matrix).
    device, dtype = _options_placement(options)
    embed = as_tensor(access.embedding_rows(np.arange(info.vocab_size, dtype=np.int64)), device, dtype)
    head = as_tensor(access.head_logits(np.eye(info.hidden_size, dtype=np.float32)), device, dtype)
    return TargetHead.of_tensors(embed, head.t().contiguous()), device, dtype


def _from_checkpoint(options: ExecutorOptions, device: torch.device, dtype: torch.dtype) -> TargetHead:
    from musegl_core.checkpoint.loader import load_checkpoint

    checkpoint = load_checkpoint(options.model)
    try:
        return TargetHead.of_tensors(torch.from_numpy(checkpoint.read("embed_tokens.weight")).to(device, dtype),
                                     torch.from_numpy(checkpoint.read("lm_head.weight")).to(device, dtype))
    finally:
        checkpoint.close()


def target_head(executor: Any, options: ExecutorOptions) -> tuple[TargetHead, torch.device, torch.dtype]:
    """The target's raw embedding rows and lm_head product, and the device and dtype the
    draft runs in: lent by a :class:`TargetAccess` executor, else read from the checkpoint."""
    access = target_access(executor)
    if access is not None:
        return _lent(access, executor.info, options)
    device, dtype = _options_placement(options)
    return _from_checkpoint(options, device, dtype), device, dtype


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


def rank_speculator(target: Any, path: str, n_draft: int) -> DFlashSpeculator:
    """The draft on one tensor-parallel rank (called there, on every rank alike, with the
    rank's ``RankTarget``): loaded onto the rank's device in its activation dtype, drafting
    with the target's embedding and head through the ranks' collectives (none while it loads)."""
    head = TargetHead(target.embedding_rows, target.head_logits, target.head_argmax)
    return DFlashSpeculator(load_draft(path, target.device, target.dtype), head, n_draft, target.block_size)


def load_speculator(path: str, executor: Any, options: ExecutorOptions, n_draft: int) -> Any:
    on_ranks = getattr(executor, "speculator_on_ranks", None)
    if callable(on_ranks):  # tensor parallel: a replica on every rank (module docstring)
        speculator = on_ranks("musegl_dflash.loader:rank_speculator", (str(Path(path).resolve()), n_draft))
    else:
        head, device, dtype = target_head(executor, options)
        draft = load_draft(path, device, dtype, options.progress)
        speculator = DFlashSpeculator(draft, head, n_draft, executor.block_size)
    from musegl_dflash.replay import benchmark_replay  # BENCHMARK ONLY, off unless its variable is set

    return benchmark_replay(speculator, n_draft)
