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

MASK64 = (1 << 64) - 1


def _mix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) of the draw at ``position`` under ``seed``."""
    return (_mix(_mix(seed & MASK64) ^ (position & MASK64)) >> 11) * (1.0 / (1 << 53))


def random_seed() -> int:
    """A fresh seed for a request that gave none (63 bits, from the OS)."""
    return int.from_bytes(os.urandom(8), "little") >> 1
