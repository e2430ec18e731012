"""The periodic throughput line the worker logs while requests run.

Every ``--throughput-log-interval`` seconds of a busy period the engine logs
one INFO line: tokens generated and prompt positions computed per second
since the previous line, running and queued requests, and KV blocks in use.
An idle engine logs nothing, and the first line of a busy period covers only
that period (the idle time before it is not averaged in).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("musegl.engine")


class ThroughputLog:
    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self.generated = 0  # tokens committed since the last line
        self.prompt = 0  # prompt positions computed since the last line
        self._since: float | None = None  # start of the current measurement (None: idle)

    def pause(self) -> None:
        """The engine is idle: the next busy period starts a fresh measurement."""
        self._since = None
        self.generated = self.prompt = 0

    def tick(self, *, running: int, queued: int, blocks_used: int, blocks_total: int) -> bool:
        """After a step: log the line if an interval has passed; whether it did."""
        if self.interval <= 0:
            return False
        now = self.clock()
        if self._since is None:  # the first step of a busy period starts the measurement
            self._since, self.generated, self.prompt = now, 0, 0
            return False
        span = now - self._since
        if span < self.interval:
            return False
        log.info("throughput: %.1f tokens/s generated, %.1f prompt tokens/s over %.1f s; %d running, %d queued; "
                 "KV blocks %d of %d in use", self.generated / span, self.prompt / span, span, running, queued,
                 blocks_used, blocks_total)
        self._since, self.generated, self.prompt = now, 0, 0
        return True
