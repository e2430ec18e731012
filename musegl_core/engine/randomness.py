"""Position-keyed random numbers: a draw depends on (seed, position) only.

Every sampled row gets one uniform number in [0, 1) from the request's seed
and the absolute position of the token being drawn. The executor draws by
inverse CDF with it, so a sequence's token at a position is the same whether
it runs alone or batched, after a session rewind, or under speculative
verification (where several positions are drawn in one step).

The mixing function is SplitMix64's finaliser (Steele, Lea and Flood, 2014)
applied to ``seed`` and ``position`` in turn; its output's top 53 bits make
the double.
"""

from __future__ import annotations

import os
import random
import threading

MASK64 = (1 << 64) - 1


def _mix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) of the draw at ``position`` under ``seed``."""
    return (_mix(_mix(seed & MASK64) ^ (position & MASK64)) >> 11) * (1.0 / (1 << 53))


class _SeedSource:
    """Where the seeds of requests that gave none come from: the OS, or a generator
    seeded by ``musegl serve --seed`` (vLLM's meaning of its ``--seed``: the same
    requests, in the same order, draw the same seeds after a restart)."""

    def __init__(self) -> None:
        self._generator: random.Random | None = None
        self._lock = threading.Lock()

    def seed(self, seed: int | None) -> None:
        with self._lock:
            self._generator = None if seed is None else random.Random(seed)

    def draw(self) -> int:
        with self._lock:
            if self._generator is not None:
                return self._generator.getrandbits(63)
        return int.from_bytes(os.urandom(8), "little") >> 1


_SOURCE = _SeedSource()


def seed_requests(seed: int | None) -> None:
    """Draw the seeds of unseeded requests from a generator seeded with ``seed``
    (None: from the OS again). The worker calls this once at start-up."""
    _SOURCE.seed(seed)


def random_seed() -> int:
    """A fresh seed for a request that gave none (63 bits, from the OS or ``--seed``'s generator)."""
    return _SOURCE.draw()
