"""Attention rows on the CPU (stored mode): ``mw_attention`` on every kernel path this CPU
runs and the torch fallback, against a float64 reference, each row's bits independent of
the rows beside it."""

from __future__ import annotations

import pytest
import torch

from musegl_cuda.cpu import attention, native
from musegl_cuda.cpu.attention import RowKeys, attend

KV_HEADS, GROUP, SLOTS = 2, 4, 300


def cache(hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(hd)
    return torch.randn(SLOTS, KV_HEADS, hd, generator=g), torch.randn(SLOTS, KV_HEADS, hd, generator=g)


def keys_of(lists: list[torch.Tensor], rows: list[tuple[int, int]]) -> RowKeys:
    """Rows ``(list index, keys seen)`` over slot lists ``lists``."""
    starts = torch.tensor([0] + [len(s) for s in lists]).cumsum(0)
    offsets = torch.tensor([int(starts[i]) for i, _ in rows])
    counts = torch.tensor([n for _, n in rows])
    slots = torch.cat(lists)
    return RowKeys(slots, offsets, counts, int(counts.max()), int(slots.max()), int(slots.min()))


def reference(q, k, v, keys: RowKeys, window: int, scale: float) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        count, offset = int(keys.counts[r]), int(keys.offsets[r])
        lo = max(0, count - window) if window else 0
        idx = keys.slots[offset + lo:offset + count]
        kr = k[idx].double().repeat_interleave(GROUP, dim=1)  # (n, heads, hd)
        vr = v[idx].double().repeat_interleave(GROUP, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[r].double(), kr) * scale, dim=-1)
        out[r] = torch.einsum("hn,nhd->hd", probs, vr)
    return out


def run(path: str):
    if path == "torch":
        return lambda q, k, v, keys, window, scale: attention._rows_in_torch(q, k, v, keys, window, scale)
    try:
        kernels = native.kernels(path)
    except native.KernelPathError as exc:
        pytest.skip(f"{path} kernels do not run here: {exc}")
    return lambda q, k, v, keys, window, scale: attend(q, k, v, keys, window, scale, kernels)


@pytest.mark.parametrize("hd", [32, 128])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("path", [*native.PATH_NAMES, "torch"])
def test_attention_rows_are_accurate_and_ignore_their_batch(path, window, hd):
    """Three sequences (1, 9 and 70 keys, scattered slots), every row of a prompt chunk of
    the longest and one decode row of each: within float32 rounding of float64, and each
    row the same bits computed alone, beside rows of other lengths, or in another chunk."""
    attend_rows = run(path)
    k, v = cache(hd)
    perm = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(7))
    lists = [perm[:1], perm[1:10], perm[10:80]]
    rows = [(0, 1), (1, 9), *[(2, n) for n in range(50, 71)]]
    keys = keys_of(lists, rows)
    q = torch.randn(len(rows), KV_HEADS * GROUP, hd, generator=torch.Generator().manual_seed(8))
    scale = hd ** -0.5
    got = attend_rows(q, k, v, keys, window, scale)
    error = (got.double() - reference(q, k, v, keys, window, scale)).abs().max()
    assert error < 1e-5, float(error)
    for subset in ([0], [1], [2], [22], [0, 22], [5, 6, 7], list(range(10, 23))):
        part = keys_of(lists, [rows[i] for i in subset])
        assert torch.equal(attend_rows(q[subset], k, v, part, window, scale), got[subset]), subset


def test_keys_outside_the_cache_are_refused():
    k, v = cache(32)
    keys = keys_of([torch.tensor([3, SLOTS])], [(0, 2)])
    with pytest.raises(IndexError, match="outside the cache"):
        attend(torch.zeros(1, KV_HEADS * GROUP, 32), k, v, keys, 0, 1.0, None)
