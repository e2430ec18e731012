"""Which dtype the MLX executor computes in, and why (a pure decision, no MLX import).

:func:`choose_dtype` takes everything the choice depends on as arguments, so
each case can be tested on any machine (the BLAS routing, for instance, is
off on some CPUs and on on others):

1. ``--dtype`` wins;
2. a float32 checkpoint computes in float32 (as mlx-lm keeps a checkpoint's
   dtype: computing a float32 checkpoint in bfloat16 rounds every weight and
   activation, and greedy output drifts from transformers' within a few
   tokens);
3. on MLX's CPU device with the BLAS routing on (:mod:`musegl_mlx.blas`),
   float32: only float32 products go through the routed BLAS, bfloat16 and
   float16 ones are several times slower;
4. otherwise a float16 or bfloat16 checkpoint keeps its dtype, and a
   quantized or mixed one computes in bfloat16 (the model's own precision).
"""

from __future__ import annotations

import attrs

from musegl_core.engine.dtypes import STORED, dtype_name


@attrs.frozen
class DtypeChoice:
    """The compute dtype (``float32``, ``float16`` or ``bfloat16``) and, in words, why."""

    name: str
    reason: str


def choose_dtype(requested: str | None, stored: str | None, *, on_cpu: bool, blas_routed: bool) -> DtypeChoice:
    """The compute dtype for ``--dtype requested`` (None: not given) and a checkpoint
    stored as ``stored`` (``f32``, ``bf16``, ``q8_0``, ``mixed`` ...; None: unknown),
    on MLX's CPU device or not, with the float32 BLAS routing on or not."""
    if requested is not None:
        return DtypeChoice(dtype_name(requested), "--dtype")
    own = STORED.get(stored or "")
    if own == "float32":
        return DtypeChoice("float32", "the checkpoint is float32 and keeps its dtype (--dtype to change it)")
    if on_cpu and blas_routed:
        return DtypeChoice("float32", "MLX's CPU device with float32 products routed to OpenBLAS "
                                      "(bfloat16/float16 products do not use it)")
    where = "on the GPU" if not on_cpu else "on the CPU without the BLAS routing"
    if own is not None:
        return DtypeChoice(own, f"the checkpoint's dtype, {where}")
    kind = f"stored as {stored}" if stored else "of unknown precision"
    return DtypeChoice("bfloat16", f"the checkpoint is {kind}: bfloat16, the model's own precision, {where}")
