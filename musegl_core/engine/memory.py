"""How much host memory there is to take (an executor's ``kv_memory_available``).

Executors whose KV cache lives in the host's memory (the torch executor on
the CPU, ExecuTorch, MLX on Linux) report the kernel's estimate of what can
be allocated without swapping; a backend with a device of its own asks its
device instead.
"""

from __future__ import annotations

MEMINFO = "/proc/meminfo"


def available_ram(meminfo: str = MEMINFO) -> int | None:
    """``MemAvailable`` of the machine in bytes (Linux), else None (unknown)."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
