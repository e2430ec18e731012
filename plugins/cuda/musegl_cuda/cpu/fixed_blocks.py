"""Float32 products whose rows do not depend on their batch, with torch's GEMM alone.

Where the stored-weight kernels do not run (no AVX2 or AVX-512, no C compiler, or
``MUSEGL_CPU_KERNELS=fallback``), matrices are float32 and multiplied by torch. A
BLAS picks its algorithm by the product's shape and thread count, and rounds a row
differently with the number of rows beside it (measured with torch 2.13's MKL on the
development machine: row 0 of a 1-, 8- and 100-row product differ in the last bits),
which made the same seeded request sample differently alone and batched.
:func:`fixed_block_linear` therefore multiplies every product in blocks of a fixed
number of rows (the last block padded with zero rows) into fresh buffers, so every
call has one shape: :data:`~musegl_cuda.cpu.native.FALLBACK_ROWS` (16) for prompt
rows nobody samples, :data:`~musegl_cuda.cpu.native.SAMPLED_ROWS` (2) for sampled
rows (decode rows, a prompt's last row), which
:class:`~musegl_cuda.cpu.stored_matrix.DenseMatrix` tells apart. A decode row in a
16-row block did 16 rows' arithmetic (3-4x a one-row product's time at decode sizes
with torch 2.13's MKL, one thread); a 2-row product costs about what a 1-row one does
(1 x 202048 x 1024: 78 ms, 2 rows 83, 4 rows 161, 16 rows 223), and a row's result
in it ignores its partner (unlike MKL's 1- and 3..16-row products, which each round
differently). Whether a row's result then
also ignores its place in the block and torch's thread count is checked once per
weight shape, not assumed (:func:`plan_for`): where it does not, the product runs on
one torch thread, or, failing that, each row alone as row 0 of its own block (exact
by construction, at up to the block's size times the arithmetic).
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


_plans: dict[tuple[int, int, int], BlockPlan] = {}


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


def _block(rows: torch.Tensor, weight: torch.Tensor, size: int) -> torch.Tensor:
    """``rows @ weight^T`` as one product of exactly ``size`` rows (zero rows after ``rows``)."""
    buf = torch.zeros(size, weight.shape[1], dtype=torch.float32)
    buf[: rows.shape[0]] = rows
    return F.linear(buf, weight)[: rows.shape[0]]


def plan_for(weight: torch.Tensor, size: int = FALLBACK_ROWS) -> BlockPlan:
    """The plan for ``weight``'s shape in blocks of ``size`` rows, checked on its first
    product: a block's rows moved to other places and a row alone among zero rows must
    give the same bits, on one torch thread and on the process' default count, and the
    two counts the same."""
    n, k = weight.shape
    plan = _plans.get((n, k, size))
    if plan is not None:
        return plan
    x = torch.randn(size, k, generator=torch.Generator().manual_seed(0))
    shift, last = (5, 3) if size > 5 else (1, size - 1)

    def invariant(threads: int) -> torch.Tensor | None:
        """The block's product on ``threads`` threads when rows ignore their place, else None."""
        with torch_threads(threads):
            whole = _block(x, weight, size)
            moved = _block(torch.roll(x, shift, 0), weight, size)
            alone = _block(x[last:last + 1], weight, size)
        ok = torch.equal(moved, torch.roll(whole, shift, 0)) and torch.equal(alone, whole[last:last + 1])
        return whole if ok else None

    single = invariant(1)
    if single is None:
        plan = BlockPlan(threads=(1,), packed=False)
    elif DEFAULT_THREADS > 1 and (default := invariant(DEFAULT_THREADS)) is not None and torch.equal(default, single):
        plan = BlockPlan(threads=(1, DEFAULT_THREADS), packed=True)
    else:
        plan = BlockPlan(threads=(1,), packed=True)
    if plan.threads == (1,) and DEFAULT_THREADS > 1:
        log.info("float32 fallback products for a %d x %d weight in %d-row blocks: %s", n, k, size,
                 "one torch thread" if plan.packed else "each row alone in its block, one torch thread")
    _plans[(n, k, size)] = plan
    return plan


def fixed_block_linear(x: torch.Tensor, weight: torch.Tensor, size: int = FALLBACK_ROWS) -> torch.Tensor:
    """``x @ weight^T`` (float32) in blocks of exactly ``size`` rows, with each row's
    result independent of the other rows of ``x``; see the module docstring."""
    m = x.shape[0]
    plan = plan_for(weight, size)
    out = torch.empty(m, weight.shape[0], dtype=torch.float32)
    step = size if plan.packed else 1
    with torch_threads(plan.thread_count()):
        for start in range(0, m, step):
            out[start:start + step] = _block(x[start:start + step], weight, size)
    return out
