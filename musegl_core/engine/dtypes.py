"""The compute dtypes executors run in, by name (no torch or mlx import).

``--dtype`` accepts the names of :data:`COMPUTE_DTYPES` and their short
spellings; a checkpoint's stored precision (``Checkpoint.file_type``) names a
compute dtype when it is one of :data:`STORED`. A backend maps the canonical
name to its own dtype object (``getattr(torch, name)``, ``getattr(mx, name)``)
and back.
"""

from __future__ import annotations

#: The activation dtypes, canonical names.
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
#: ``--dtype`` spellings and the dtype each names.
SPELLINGS = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
             "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: A checkpoint's stored precision that is itself a compute dtype.
STORED = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
#: Bytes per element.
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def dtype_name(spelling: str) -> str:
    """The canonical name of a ``--dtype`` spelling; ``ValueError`` for anything else."""
    if spelling not in SPELLINGS:
        raise ValueError(f"dtype {spelling!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    return SPELLINGS[spelling]


def backend_dtypes(lookup) -> dict[str, object]:
    """Every spelling mapped to the backend dtype ``lookup(canonical name)`` returns
    (e.g. ``backend_dtypes(lambda name: getattr(torch, name))``)."""
    native = {name: lookup(name) for name in COMPUTE_DTYPES}
    return {spelling: native[name] for spelling, name in SPELLINGS.items()}
