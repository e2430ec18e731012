"""Sliding pages in the torch executor's forward, against the same executor keeping every
position of every layer: prompt rows, rows whose window no longer reaches freed pages, and
a rewind past the window that recomputes only the sliding layers' K/V (``keep_full``
chunks). ``paged``: through the CUDA path's forward (:meth:`TorchExecutor._forward_plan`,
the Triton kernels reading each layer group's block tables; on the CPU under
``TRITON_INTERPRET=1``, the slow tier) instead of the CPU path's. Shared by
``test_sliding_pages.py``."""

from __future__ import annotations

import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_cuda.executor import TorchExecutor

BLOCK = 4


def _executor(path: str, sliding: bool, pages: int, paged: bool, device: str) -> TorchExecutor:
    ex = TorchExecutor(load_checkpoint(path), device=device, dtype="float32", block_size=BLOCK)
    groups = ex.use_sliding_pages() if sliding else None
    ex.allocate_kv(pages)
    ex.paged = paged  # on the CPU: the CUDA path's forward (under Triton's interpreter), called directly
    return ex, groups


def _forward(ex: TorchExecutor, step: Step) -> torch.Tensor:
    """Every row's logits of ``step`` (no sampling)."""
    from musegl_cuda.cuda.plan import plan_step, rows_per_tile

    c = ex.config
    with torch.inference_mode():
        if ex.paged:
            plan = plan_step(step, ex.block_size, ex.num_blocks, c.vocab_size,
                             rows_per_tile(ex.prefill_block_m, c.num_heads // c.num_kv_heads))
            normed, _ = ex._forward_plan(plan, ex.kv, ex.prefill_block_m, step=step)
            return ex.model.logits(normed[:step.num_tokens]).float().cpu()
        head, _hidden, _starts = ex._run_eager(step, ex.kv)
        return head(torch.arange(step.num_tokens)).float()


def check_sliding_pages(path: str, paged: bool, prompt: int = 64, rewind: int = 60, device: str = "cpu") -> dict:
    """Run a ``prompt``-token prefill, a continuation whose window left the first blocks, and a
    rewind to ``rewind`` whose window left the device: the rewind recomputes the sliding
    layers' K/V of ``start .. rewind`` into pages of its own (the engine's ``window_start``:
    from the block ``sliding layers × window`` before the window's block) while the full
    layers' K/V stay untouched; each continuation's logits match the executor that keeps
    everything. Returns the worst relative logit difference. ``device`` "cuda": on a GPU
    (``paged`` must then be True: the CUDA path)."""
    ids = torch.randint(3, 500, (prompt + 8,), generator=torch.Generator().manual_seed(3)).tolist()
    full, _ = _executor(path, False, 80, paged, device)
    paged_ex, found = _executor(path, True, 256, paged, device)
    groups, window, layers = found
    blocks = list(range(1, -(-(prompt + 8) // BLOCK) + 1))  # the full layers' pages (the reference's blocks)
    # the sliding groups' pages, disjoint from the full ones; page 0 (what -1 reads) holds garbage
    spare = iter(range(len(blocks) + 1, 256))
    sliding = [[next(spare) for _ in blocks] for _ in range(groups)]
    poison = paged_ex.kv.new_full(paged_ex.kv[:, :, 0].shape, 7.5)

    def step(start: int, end: int, tables, keep_full: bool = False) -> Step:
        return Step([SeqChunk(0, ids[start:end], list(range(start, end)), blocks, sliding_blocks=tuple(tables),
                              keep_full=keep_full)])

    def forget(tables, before: int) -> list[list[int]]:
        """The tables with the pages of blocks before index ``before`` given back (-1), and those
        pages overwritten with garbage: nothing may read them."""
        out = []
        for table in tables:
            for page in table[:before]:
                if page >= 0:
                    paged_ex.kv[:, :, page] = poison
            out.append([-1] * before + table[before:])
        return out

    worst = 0.0

    def compare(start: int, end: int, tables) -> None:
        nonlocal worst
        want = _forward(full, step(start, end, [[-1] * len(blocks)] * groups))
        got = _forward(paged_ex, step(start, end, tables))
        worst = max(worst, float((want - got).abs().max() / want.abs().max()))
        assert torch.equal(want.argmax(-1), got.argmax(-1)), (start, end)

    paged_ex.kv[:, :, 0] = poison
    compare(0, rewind, sliding)  # the prompt up to the rewind point, every page in place
    # the window of position ``rewind`` starts in block (rewind - window) // BLOCK: the pages before go
    tables = forget(sliding, (rewind - window) // BLOCK)
    compare(rewind, prompt, tables)
    # rewind: every sliding page up to the window's block is gone as well; recompute from ``start``
    # (sessions.SessionTable.window_start) into fresh pages, the full layers' K/V untouched
    exact = (rewind - window) // BLOCK * BLOCK
    start = max(0, exact - (layers - 1) * window) // BLOCK * BLOCK
    gone = forget(tables, -(-prompt // BLOCK))
    own = [[next(spare) if i >= start // BLOCK else -1 for i in range(len(blocks))] for _ in range(groups)]
    merged = [[o if o >= 0 else g for o, g in zip(mine, lost)] for mine, lost in zip(own, gone)]
    kept = paged_ex.kv[:, :, blocks].clone()
    _forward(paged_ex, step(start, rewind, merged, keep_full=True))
    assert torch.equal(paged_ex.kv[:, :, blocks], kept), "a keep_full chunk wrote the full layers' pages"
    # past the rewind, only the exact pages (from the window's block on) are read
    after = [[-1] * (exact // BLOCK) + table[exact // BLOCK:] for table in merged]
    compare(rewind, prompt + 8, after)
    return {"worst": worst, "recomputed": rewind - start}
