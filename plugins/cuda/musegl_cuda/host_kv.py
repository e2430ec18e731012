"""The torch executor's host tier (``--kv-offload-memory``): KV pages in host RAM.

The device cache is ``(places, 2, pages, block_size, kv_heads, head_dim)``; the
host tier is ``(host_pages, places, 2, block_size, kv_heads, head_dim)``, one
contiguous slab a page, so a page's copy is one transfer. On the CPU the copies
run at once. On CUDA the host memory is pinned and the copies run on a side
stream, overlapped with the steps launched after them:

* a copy starts after everything already launched on the compute stream (the
  side stream waits for it): a page offloaded holds what the steps before wrote,
  and a page restored into is no longer written by an earlier step;
* a later step, ``copy_blocks`` or restore that touches a page a pending copy
  reads or writes waits for the copies first (:meth:`HostPages.await_pages`), on
  the device (the compute stream waits for the side stream's event); steps of
  other sequences run on beside the copies;
* the host reading or writing host pages (a block handed to a lower tier) waits
  for the side stream on the host; nothing else does: the page indices go to the
  device without waiting for a stream (``torch.tensor(..., device=...)`` would
  wait for the side stream, and with it for the steps launched before the copy).

A copy stages its pages on the device in batches of at most :data:`STAGE_BYTES`
(the gather before a device-to-host copy, the pages before they are scattered
into the cache): a returning 131K-token session of the 30B shape is about 6.5 GiB,
which the memory beside a pool that fills the device does not hold at once. Host
pages that follow each other move in one transfer.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

#: device bytes one batch of a CUDA copy stages at most (at least one page)
STAGE_BYTES = 256 << 20


class HostPages:
    def __init__(self, kv: torch.Tensor, num_pages: int) -> None:
        self.device = kv.device
        self.cuda = kv.device.type == "cuda"
        shape = (num_pages, *kv.shape[:2], *kv.shape[3:])
        self.host = torch.empty(shape, dtype=kv.dtype, pin_memory=self.cuda)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._event = None  # the side stream's last copy
        self._pending: set[int] = set()  # device pages the copies up to ``_event`` read or write

    def await_pages(self, pages: Iterable[int]) -> None:
        """Make the compute stream wait for the pending copies when any of ``pages`` is theirs."""
        if not self._pending:
            return
        if self._event.query():
            self._pending.clear()
            return
        if not self._pending.isdisjoint(pages):
            torch.cuda.current_stream(self.device).wait_event(self._event)
            self._pending.clear()

    def offload(self, kv: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
        """Device page ``src`` -> host page ``dst``."""
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        kv, host = _raw(kv), _raw(self.host)
        if not self.cuda:
            host[torch.tensor(dst)] = kv[:, :, torch.tensor(src)].movedim(2, 0)
            return
        self.await_pages(src)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        per = self._per_batch()
        with torch.cuda.stream(self.stream):  # (a batch's buffer is the side stream's: reused in its order)
            for lo in range(0, len(src), per):
                index = self._index(src[lo:lo + per])
                gathered = kv[:, :, index].movedim(2, 0).contiguous()
                for start, stop, first in runs(dst[lo:lo + per]):
                    host[first:first + stop - start].copy_(gathered[start:stop], non_blocking=True)
        self._mark(src)

    def restore(self, kv: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
        """Host page ``src`` -> device page ``dst``."""
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        kv, host = _raw(kv), _raw(self.host)
        if not self.cuda:
            kv[:, :, torch.tensor(dst)] = host[torch.tensor(src)].movedim(0, 2)
            return
        self.await_pages(dst)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        per = self._per_batch()
        with torch.cuda.stream(self.stream):
            for lo in range(0, len(src), per):
                batch = src[lo:lo + per]
                staged = torch.empty((len(batch), *host.shape[1:]), dtype=host.dtype, device=self.device)
                for start, stop, first in runs(batch):
                    staged[start:stop].copy_(host[first:first + stop - start], non_blocking=True)
                kv[:, :, self._index(dst[lo:lo + per])] = staged.movedim(0, 2)
        self._mark(dst)

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        """Page ids on the device, copied from pinned memory on the current (side) stream: the host
        never waits (a pageable source may make the driver wait for the stream, and
        ``torch.tensor(..., device=...)`` always does)."""
        return torch.tensor(pages, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)

    def _per_batch(self) -> int:
        """Pages one staged batch holds (:data:`STAGE_BYTES`, at least one)."""
        page = self.host[0].numel() * self.host.element_size()
        return max(1, STAGE_BYTES // page)

    def _mark(self, pages: Sequence[int]) -> None:
        self._event = self.stream.record_event()
        self._pending.update(pages)

    def read(self, pages: Sequence[int]) -> bytes:
        self.settle()
        return b"".join(self.host[p].view(torch.uint8).numpy().tobytes() for p in pages)

    def write(self, pages: Sequence[int], data: bytes) -> None:
        self.settle()
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = flat.numel() // max(1, len(pages))
        for i, page in enumerate(pages):
            self.host[page].view(torch.uint8).view(-1).copy_(flat[i * size:(i + 1) * size])

    def settle(self) -> None:
        """Wait on the host for every copy issued."""
        if self.stream is not None:
            self.stream.synchronize()
            self._pending.clear()


def runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``pages`` cut into runs of consecutive ids: ``(start, stop, first page)`` each, where
    ``pages[start:stop]`` is ``first, first + 1, ...`` (one transfer each)."""
    out = []
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            out.append((start, i, pages[start]))
            start = i
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Float8 storage as bytes: indexing float8 is not implemented everywhere."""
    return t.view(torch.uint8) if t.element_size() == 1 else t
