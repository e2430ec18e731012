"""Sizing the KV pool from the memory the backend has, before any request runs.

The pool must hold what the limits promise: every session slot (``--max-sessions``)
and every prefix snapshot (``--prefix-cache-entries``) can grow to
``--max-context`` positions. The memory for it is ``--kv-cache-memory`` when
given, otherwise ``--kv-cache-fraction`` of what the executor reports free once
its weights are loaded. Settings that do not fit fail at start-up with one
line that says what would fit (:class:`~musegl_core.errors.ConfigError`,
exit status 2), never later with a request half-way through.

With ``--kv-cache-memory`` the pool takes all of it (the spare blocks keep
finished prefixes cached for reuse); without it the pool is exactly what the
limits need, so a default server takes no more memory than it can use.
``--kv-blocks`` sets the block count directly (tests, experiments).
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


def check_fits(*, bytes_per_block: int, block_size: int, budget: int, source: str, max_sessions: int,
               max_context: int, snapshots: int) -> int:
    """Blocks that ``budget`` bytes hold; raises ConfigError when the limits need more."""
    blocks_per_slot = -(-max_context // block_size)
    needed = (max_sessions + snapshots) * blocks_per_slot
    affordable = budget // bytes_per_block if bytes_per_block > 0 else needed
    if needed > affordable:
        slots = max_sessions + snapshots
        fit_context = (affordable // slots) * block_size
        fit_sessions = affordable // blocks_per_slot - snapshots
        extra = f" (+{snapshots} --prefix-cache-entries)" if snapshots else ""
        raise ConfigError(
            f"the KV cache cannot hold --max-sessions {max_sessions} x --max-context {max_context}{extra}: "
            f"that needs {human_bytes(needed * bytes_per_block)} but {human_bytes(budget)} is available "
            f"({source}); what fits: --max-context {fit_context} with {max_sessions} sessions, or "
            f"{max(fit_sessions, 0)} sessions of {max_context} tokens"
        )
    return affordable


def plan_pool(config, executor, speculator) -> int:
    """The number of KV blocks for an engine with ``config`` over ``executor``."""
    block_size = executor.block_size
    needed = config.needed_blocks(block_size)
    if config.kv_blocks is not None:
        return config.kv_blocks
    per_block = executor.kv_bytes_per_block() + speculator.kv_bytes_per_block()
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
    return affordable if config.kv_cache_memory is not None else needed
