"""``--kv-cache-dtype``: what one cached position costs for each KV storage dtype.

``auto`` keeps K and V in the activation dtype (bfloat16 on CUDA, float32 on the CPU);
``fp8`` keeps them as float8 e4m3 (one byte an element) with a float32 scale per layer,
K or V and KV head (a fixed, position-independent overhead that is not counted per
position). The executors that support ``fp8`` (torch on CUDA and the CPU) report their
block bytes through :func:`kv_position_bytes`; the others refuse ``fp8`` at start-up.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "fp8")


def kv_element_bytes(kv_cache_dtype: str, activation_itemsize: int) -> int:
    """Bytes of one cached K or V element: the activation dtype's for ``auto``, 1 for ``fp8``."""
    if kv_cache_dtype == "auto":
        return activation_itemsize
    if kv_cache_dtype == "fp8":
        return 1
    raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def kv_position_bytes(config, kv_cache_dtype: str, activation_itemsize: int) -> int:
    """Bytes one position of KV costs over all layers, K and V, for a decoder ``config``
    (``num_layers``, ``num_kv_heads``, ``head_dim``): with ``fp8`` half of bfloat16's and a
    quarter of float32's, so the same ``--kv-cache-memory`` holds 2x (4x) the positions."""
    element = kv_element_bytes(kv_cache_dtype, activation_itemsize)
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * element
