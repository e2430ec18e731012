"""Float32 products whose rows do not depend on their batch, with torch's GEMM alone.

Where the stored-weight kernels do not run (no AVX2 or AVX-512, no C compiler, or
``MUSEGL_CPU_KERNELS=fallback``), matrices are float32 and multiplied by torch. A
BLAS picks its algorithm by the product's shape and thread count, and rounds a row
differently with the number of rows beside it (measured with torch 2.13's MKL on the
development machine: row 0 of a 1-, 8- and 100-row product differ in the last bits),
which made the same seeded request sample differently alone and batched.
:func:`fixed_block_linear` therefore multiplies every product in blocks of exactly
:data:`~musegl_cuda.cpu.native.FALLBACK_ROWS` rows (the last block padded with zero
rows) into fresh buffers, so every call has one shape. Whether a row's result then
also ignores its place in the block and torch's thread count is checked once per
weight shape, not assumed (:func:`plan_for`): where it does not, the product runs on
one torch thread, or, failing that, each row alone as row 0 of its own block (exact
by construction, at up to 16x the arithmetic).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import attrs
import torch
import torch.nn.functional as F

from musegl_cuda.cpu.native import FALLBACK_ROWS

log = logging.getLogger("musegl.cuda")


#: torch's thread count when this module was imported (the process' default).
DEFAULT_THREADS = torch.get_num_threads()


@attrs.frozen
class BlockPlan:
    """How products with one weight shape run: on one of the torch thread counts in
    ``threads`` (shown to give the same bits; a call at another count runs on the last),
    ``packed``: several rows per block (False: each row alone in its own block)."""

    threads: tuple[int, ...]
    packed: bool

    def thread_count(self) -> int | None:
        """The count to set for a product now (None: keep torch's current one)."""
        return None if torch.get_num_threads() in self.threads else self.threads[-1]


_plans: dict[tuple[int, int], BlockPlan] = {}


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _block(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows @ weight^T`` as one product of exactly FALLBACK_ROWS rows (zero rows after ``rows``)."""
    buf = torch.zeros(FALLBACK_ROWS, weight.shape[1], dtype=torch.float32)
    buf[: rows.shape[0]] = rows
    return F.linear(buf, weight)[: rows.shape[0]]


def plan_for(weight: torch.Tensor) -> BlockPlan:
    """The plan for ``weight``'s shape, checked on its first product: a block's rows
    moved to other places and a row alone among zero rows must give the same bits, on
    one torch thread and on the process' default count, and the two counts the same."""
    n, k = weight.shape
    plan = _plans.get((n, k))
    if plan is not None:
        return plan
    x = torch.randn(FALLBACK_ROWS, k, generator=torch.Generator().manual_seed(0))

    def invariant(threads: int) -> torch.Tensor | None:
        """The block's product on ``threads`` threads when rows ignore their place, else None."""
        with torch_threads(threads):
            whole = _block(x, weight)
            moved = _block(torch.roll(x, 5, 0), weight)
            alone = _block(x[3:4], weight)
        ok = torch.equal(moved, torch.roll(whole, 5, 0)) and torch.equal(alone, whole[3:4])
        return whole if ok else None

    single = invariant(1)
    if single is None:
        plan = BlockPlan(threads=(1,), packed=False)
    elif DEFAULT_THREADS > 1 and (default := invariant(DEFAULT_THREADS)) is not None and torch.equal(default, single):
        plan = BlockPlan(threads=(1, DEFAULT_THREADS), packed=True)
    else:
        plan = BlockPlan(threads=(1,), packed=True)
    if plan.threads == (1,) and DEFAULT_THREADS > 1:
        log.info("float32 fallback products for a %d x %d weight: %s", n, k,
                 "one torch thread" if plan.packed else "each row alone in its block, one torch thread")
    _plans[(n, k)] = plan
    return plan


def fixed_block_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` (float32) with each row's result independent of the other rows
    of ``x``; see the module docstring."""
    m = x.shape[0]
    plan = plan_for(weight)
    out = torch.empty(m, weight.shape[0], dtype=torch.float32)
    step = FALLBACK_ROWS if plan.packed else 1
    with torch_threads(plan.thread_count()):
        for start in range(0, m, step):
            out[start:start + step] = _block(x[start:start + step], weight)
    return out


_row_threads: dict[tuple[int, int], tuple[int, ...]] = {}


def row_threads(weight: torch.Tensor) -> tuple[int, ...]:
    """The torch thread counts on which a one-row product with ``weight``'s shape gives
    the same bits (checked on the first such product: one thread and the default)."""
    n, k = weight.shape
    counts = _row_threads.get((n, k))
    if counts is None:
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
        with torch_threads(1):
            single = torch.mm(x, weight.t())
        counts = (1,)
        if DEFAULT_THREADS > 1:
            with torch_threads(DEFAULT_THREADS):
                if torch.equal(torch.mm(x, weight.t()), single):
                    counts = (1, DEFAULT_THREADS)
        _row_threads[(n, k)] = counts
    return counts


def single_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` (float32), each row of ``x`` as its own one-row product: one
    shape, so one BLAS algorithm, and a row's result is by construction independent of
    the other rows. A decode row reads the weight once and does its own arithmetic
    only (a 16-row block does 16 rows' worth: 3-5x the time of one row at decode
    sizes, measured with torch 2.13's MKL); m rows read the weight m times, which is
    why prompt rows take :func:`fixed_block_linear` instead (see
    :class:`~musegl_cuda.cpu.stored_matrix.DenseMatrix`)."""
    counts = row_threads(weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    with torch_threads(None if torch.get_num_threads() in counts else counts[-1]):
        for r in range(x.shape[0]):
            torch.mm(x[r:r + 1], weight.t(), out=out[r:r + 1])
    return out
