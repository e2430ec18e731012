"""Sizing the KV pool from the memory the backend has, before any request runs.

Blocks on demand (docs/engine.md "KV memory"): sessions and requests take KV
blocks as they grow, and a request reserves, when it starts, only what it may
still take to its end. So the pool must hold at least one request of
``--max-context`` positions (:func:`minimum_blocks`); settings that cannot
fail at start-up with one line that says what would fit
(:class:`~musegl_core.errors.ConfigError`, exit status 2), never later with a
request half-way through. How many sessions it holds at once depends on their
lengths, not on ``--max-context``.

The memory is ``--kv-cache-memory`` when given (the pool takes all of it: the
spare blocks hold more sessions and keep finished prefixes cached for reuse),
otherwise what the limits ask for, every session slot (``--max-sessions``) and
prefix snapshot (``--prefix-cache-entries``) at ``--max-context`` positions at
once, cut to ``--kv-cache-fraction`` of what the executor reports free once its
weights are loaded. ``--kv-blocks`` sets the block count directly (tests,
experiments).
"""

from __future__ import annotations

from musegl_core.errors import ConfigError

GIB = 1 << 30


def kv_block_bytes(config, block_size: int, itemsize: int) -> int:
    """Bytes one KV block costs over all layers, K and V, for a decoder ``config``
    (``num_layers``, ``num_kv_heads``, ``head_dim``) whose cache holds ``itemsize``-byte
    elements: what an executor's ``kv_bytes_per_block`` (and its spec's ``kv_layout``)
    reports when it stores every layer's K and V for every position."""
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * itemsize


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """``512MiB``, ``24GiB``, ``1.5G``, ``1000000`` -> bytes (binary units)."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
             "mib": 1 << 20, "g": GIB, "gb": GIB, "gib": GIB, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("kmgtib")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"expected a size such as 512MiB or 24GiB, got {text!r}") from None
    if unit not in units or value <= 0:
        raise ValueError(f"expected a size such as 512MiB or 24GiB, got {text!r}")
    return int(value * units[unit])


def minimum_blocks(block_size: int, max_context: int, snapshots: int) -> int:
    """The fewest blocks a pool may have: one request of ``max_context`` positions, plus
    the blocks it may copy on write (a reused partial block, and the prompt's last
    block once a snapshot shares it): :meth:`SessionTable.run_blocks
    <musegl_core.engine.sessions.SessionTable.run_blocks>`."""
    return -(-max_context // block_size) + 1 + (1 if snapshots else 0)


def check_fits(*, bytes_per_block: int, block_size: int, budget: int, source: str, max_sessions: int,
               max_context: int, snapshots: int) -> int:
    """Blocks that ``budget`` bytes hold; raises ConfigError when they cannot hold one
    request of ``--max-context`` positions (``max_sessions`` is not a limit on memory:
    blocks on demand, sessions hold what they fill)."""
    least = minimum_blocks(block_size, max_context, snapshots)
    affordable = budget // bytes_per_block if bytes_per_block > 0 else least
    if least > affordable:
        fit_context = max(0, (affordable - (least - -(-max_context // block_size))) * block_size)
        raise ConfigError(
            f"the KV cache cannot hold one --max-context {max_context} request: that needs "
            f"{human_bytes(least * bytes_per_block)} but {human_bytes(budget)} is available ({source}); "
            f"what fits: --max-context {fit_context}"
        )
    return affordable


def plan_pool(config, executor, speculator, pages_per_block: int = 1) -> int:
    """The number of KV blocks for an engine with ``config`` over ``executor``. With sliding
    pages (``pages_per_block`` > 1) the pool is of pages and a speculator's store, indexed
    by page ids, takes its block bytes for every page of a block."""
    block_size = executor.block_size
    needed = config.needed_blocks(block_size)
    if config.kv_blocks is not None:
        return config.kv_blocks
    per_block = executor.kv_bytes_per_block() + speculator.kv_bytes_per_block() * pages_per_block
    if config.kv_cache_memory is not None:
        budget, source = config.kv_cache_memory, "--kv-cache-memory"
    else:
        available = executor.kv_memory_available()
        if available is None:
            return needed
        budget = int(available * config.kv_cache_fraction)
        source = f"--kv-cache-fraction {config.kv_cache_fraction} of {human_bytes(available)} free"
    affordable = check_fits(
        bytes_per_block=per_block, block_size=block_size, budget=budget, source=source,
        max_sessions=config.max_sessions, max_context=config.max_context, snapshots=config.prefix_cache_entries,
    )
    return affordable if config.kv_cache_memory is not None else min(needed, affordable)
