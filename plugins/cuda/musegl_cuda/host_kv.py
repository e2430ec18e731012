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
  for the side stream on the host.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch


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
        with torch.cuda.stream(self.stream):
            gathered = kv[:, :, torch.tensor(src, device=self.device)].movedim(2, 0).contiguous()
            for i, page in enumerate(dst):
                host[page].copy_(gathered[i], non_blocking=True)
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
        with torch.cuda.stream(self.stream):
            staged = torch.empty((len(src), *host.shape[1:]), dtype=host.dtype, device=self.device)
            for i, page in enumerate(src):
                staged[i].copy_(host[page], non_blocking=True)
            kv[:, :, torch.tensor(dst, device=self.device)] = staged.movedim(0, 2)
        self._mark(dst)

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


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Float8 storage as bytes: indexing float8 is not implemented everywhere."""
    return t.view(torch.uint8) if t.element_size() == 1 else t
