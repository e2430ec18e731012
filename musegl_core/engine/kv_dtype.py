"""``--kv-cache-dtype``: what one cached position costs for each KV storage dtype.

``auto`` keeps K and V in the activation dtype (bfloat16 on CUDA, float32 on the CPU);
``fp8`` keeps them as float8 e4m3 (one byte an element) with a float32 scale per layer,
K or V and KV head (a fixed, position-independent overhead that is not counted per
position). The executors that support ``fp8`` (torch on CUDA and the CPU) report their
block bytes through :func:`kv_position_bytes`; the others refuse ``fp8`` at start-up.
The element sizes themselves are :func:`musegl_core.engine.kv_memory.element_bytes`.
"""

from __future__ import annotations

import math

from musegl_core.engine.kv_memory import element_bytes
from musegl_core.errors import ConfigError

KV_CACHE_DTYPES = ("auto", "fp8")
#: The largest finite float8 e4m3 value: a stored element is ``x / scale`` saturated at ±448.
E4M3_MAX = 448.0


def fp8_k_scale(head_dim: int) -> float:
    """The FP8 K scale of every layer and KV head: K leaves the scale-less QK norm with
    ``‖k‖₂ ≤ √head_dim`` and RoPE rotates pairs (the norm stays), so ``|k_i| ≤ √head_dim``."""
    return math.sqrt(head_dim) / E4M3_MAX


def fp8_v_scale(row_norm_max: float, norm_scale_max: float, hidden: int) -> float:
    """The FP8 V scale of one layer's KV head: V row ``j`` is ``W_v[j] · x`` with ``x`` the
    layer's centered input norm (``‖x‖₂ ≤ √hidden · max|1+w|``), so by Cauchy-Schwarz
    ``|v_j| ≤ ‖W_v[j]‖₂ · max|1+w| · √hidden``; ``row_norm_max`` is the largest ``‖W_v[j]‖₂``
    of the head's rows, ``norm_scale_max`` the largest ``|1+w|``."""
    return max(row_norm_max * norm_scale_max * math.sqrt(hidden) / E4M3_MAX, 1e-30)


def check_kv_cache_dtype(kv_cache_dtype: str, spec) -> None:
    """Refuse, in one line at start-up, a ``--kv-cache-dtype`` the chosen executor (its
    :class:`~musegl_core.plugins.specs.ExecutorSpec`) does not store."""
    if kv_cache_dtype not in spec.kv_cache_dtypes:
        takes = ", ".join(spec.kv_cache_dtypes)
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: the {spec.name} executor keeps K/V in its activation "
                          f"dtype only (--kv-cache-dtype {takes}); fp8 runs on the cuda, torch-cpu and mlx executors")


def kv_element_bytes(kv_cache_dtype: str, activation_itemsize: int) -> int:
    """Bytes of one cached K or V element: the activation dtype's for ``auto``, 1 for ``fp8``
    (:func:`musegl_core.engine.kv_memory.element_bytes`, the one table of KV element sizes)."""
    return element_bytes(kv_cache_dtype, activation_itemsize)


def kv_position_bytes(config, kv_cache_dtype: str, activation_itemsize: int) -> int:
    """Bytes one position of KV costs over all layers, K and V, for a decoder ``config``
    (``num_layers``, ``num_kv_heads``, ``head_dim``): with ``fp8`` half of bfloat16's and a
    quarter of float32's, so the same ``--kv-cache-memory`` holds 2x (4x) the positions."""
    element = kv_element_bytes(kv_cache_dtype, activation_itemsize)
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * element
