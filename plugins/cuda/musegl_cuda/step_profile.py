"""BENCHMARK ONLY: ``torch.profiler`` over a window of executor launches, started by a file.

Served figures (DFlash verify blocks, batched decode through HTTP) come from a ``musegl serve``
process; to see where its GPU time goes, set ``MUSEGL_BENCHMARK_PROFILE=DIR`` in that process's
environment (a variable, not a flag: it costs a file check per launch and is not for serving).
Then, whenever a file ``DIR/start`` appears, holding ``SKIP COUNT LABEL`` (e.g. ``4 16 dflash_c1``),
the executor lets ``SKIP`` launches pass, records the next ``COUNT`` (everything the process runs
in that window: the steps, and the speculator's draft forward between them), writes the kernels
sorted by total GPU time to ``DIR/LABEL.txt`` with a first line of totals, and removes
``DIR/start``. ``benchmarks/gpu_decode.py --profile`` writes the start files.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger("musegl.cuda")

#: The variable naming the directory of start files and tables (unset or empty: off).
ENV = "MUSEGL_BENCHMARK_PROFILE"


def device_time_us(events) -> float:
    """The GPU time of ``torch.profiler``'s ``key_averages()``: its device events only (a CPU op
    that launched a library's kernel, e.g. ``aten::mm``, carries that kernel's time too, as the
    table's own "Self CUDA time total" leaves out)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU)


class StepProfiler:
    """Call :meth:`tick` at the start of every launch."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.start_file = self.folder / "start"
        self.skip = 0
        self.left = 0
        self.label = ""
        self.profile = None
        self.started = 0.0

    @classmethod
    def from_env(cls) -> "StepProfiler | None":
        folder = os.environ.get(ENV, "").strip()
        return cls(folder) if folder else None

    def tick(self) -> None:
        if self.profile is not None:
            self.left -= 1
            if self.left <= 0:
                self._finish()
            return
        if self.skip > 0:
            self.skip -= 1
            if self.skip == 0:
                self._begin()
            return
        if not self.start_file.exists():
            return
        try:
            skip, count, label = self.start_file.read_text().split()[:3]
            self.skip, self.left, self.label = int(skip), int(count), label
        except (OSError, ValueError):
            return  # a half-written file: read again at the next launch
        self.start_file.unlink(missing_ok=True)
        if self.skip == 0:
            self._begin()

    def _begin(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profile = profile(activities=activities)
        self.profile.__enter__()
        self.count = self.left
        self.started = time.perf_counter()

    def _finish(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        prof, self.profile = self.profile, None
        prof.__exit__(None, None, None)
        events = prof.key_averages()
        device_us = device_time_us(events)
        table = events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
        head = (f"{self.label}: {self.count} launches, {wall * 1e3:.1f} ms wall, "
                f"{device_us / 1e3:.1f} ms of GPU kernels ({device_us / 1e3 / max(self.count, 1):.2f} ms a launch)\n")
        (self.folder / f"{self.label}.txt").write_text(head + table)
        log.warning("benchmark profile written: %s", self.folder / f"{self.label}.txt")
