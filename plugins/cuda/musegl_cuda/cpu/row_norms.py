"""The decoder's RMS norms and residual adds on the CPU in one C call each (``row_norms.c``).

In torch a norm ``x·(mean(x²)+ε)^-½·w`` is seven small ops (square, sum, divide, add,
reciprocal square root, two products), each a dispatch and a fresh tensor: at a decode
step's few rows the dispatching is the cost (8 layers x 4 norms and 2 adds were ~1.3 ms of
a 2-thread step's ~5.6 ms outside the weight products; benchmarks/results/cpu_step_overhead_2026-12-07).
``row_norms.c`` does the same float32 operations in the same order, the sum of squares
included (it follows torch's CPU sum kernel for a contiguous row, read as vectors of
:data:`LANES` floats), so the results are torch's bits. That is checked, not assumed:
:func:`for_width` compares the C norms with the torch expressions of
:mod:`musegl_cuda.model` on random rows of each width before it hands them out, and a width
(or a torch build, or a CPU capability) where any bit differs keeps torch's ops. Where no
compiler or no known vector width is there, the same.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from musegl_core import native

log = logging.getLogger("musegl.cuda")

SOURCE = Path(__file__).with_name("row_norms.c")
FLAGS = ("-O2", "-ffp-contract=off", "-fno-fast-math")
#: Vector widths (floats) torch's CPU sum kernel may read a row in, tried in order: 8 (its
#: AVX2 build, which torch also runs on AVX-512 machines: the sum kernel has no AVX-512 build
#: of its own; measured on torch 2.13), then 16
LANES = (8, 16)

_lib: ctypes.CDLL | None | bool = False  # False: not tried yet
_widths: dict[int, "RowNorms | None"] = {}


def _load() -> ctypes.CDLL | None:
    global _lib
    if _lib is False:
        try:
            lib = ctypes.CDLL(str(native.build(SOURCE, FLAGS, "the row norms")))
        except (native.BuildError, OSError) as exc:
            log.info("row norms in torch ops (%s)", exc)
            lib = None
        if lib is not None:
            p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
            lib.rn_norm.argtypes = [p, i64, i64, p, f32, p, i32]
            lib.rn_norm.restype = i32
            lib.rn_add_norm.argtypes = [p, p, i64, i64, p, f32, p, f32, p, p, p, i32]
            lib.rn_add_norm.restype = i32
            lib.rn_qk_norm_rope.argtypes = [p, i64, i64, i64, i64, f32, f32, p, p, p, p, i32, p, p, p, i64, p, i64]
            lib.rn_qk_norm_rope.restype = i32
        _lib = lib
    return _lib


class RowNorms:
    """The C norms for rows of ``width`` float32 values (see the module docstring)."""

    def __init__(self, lib: ctypes.CDLL, width: int, lanes: int) -> None:
        self.lib, self.width, self.lanes = lib, width, lanes
        self.ones = torch.ones(width, dtype=torch.float32)

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """``(x · (sum(x²)/n + ε)^-½) · w`` per row of ``x (..., width)`` (``w``: 1 where None);
        a new float32 tensor of ``x``'s shape."""
        x = x.contiguous()
        w = self.ones if weight is None else weight
        out = torch.empty_like(x)
        self.lib.rn_norm(x.data_ptr(), x.numel() // self.width, self.width, w.data_ptr(), eps, out.data_ptr(),
                         self.lanes)
        return out

    def add_norm(self, o: torch.Tensor, h: torch.Tensor, add_weight: torch.Tensor, add_eps: float,
                 next_weight: torch.Tensor | None, next_eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``h + norm(o; add_weight)`` and, with ``next_weight``, the norm of that sum
        (None without): rows of ``width``, new tensors."""
        o, h = o.contiguous(), h.contiguous()
        h_out = torch.empty_like(h)
        x_out = torch.empty_like(h) if next_weight is not None else None
        scratch = torch.empty(self.width, dtype=torch.float32)
        self.lib.rn_add_norm(o.data_ptr(), h.data_ptr(), h.numel() // self.width, self.width, add_weight.data_ptr(),
                             add_eps, None if next_weight is None else next_weight.data_ptr(), next_eps,
                             h_out.data_ptr(), None if x_out is None else x_out.data_ptr(), scratch.data_ptr(),
                             self.lanes)
        return h_out, x_out


    def qk_norm_rope(self, qk: torch.Tensor, heads: int, eps: float, q_scale: float,
                     rope: tuple[torch.Tensor, torch.Tensor] | None, store=None) -> torch.Tensor | None:
        """``Attention._qk_norm_rope`` of :mod:`musegl_cuda.model` in one call: ``qk (rows,
        heads + kv_heads, width)`` normed per head, q's heads times ``q_scale``, rotated with
        ``rope`` (``(cos, sin)``, each ``(rows, width)``; None: no RoPE). A new tensor.
        ``store``: ``(k_flat, v_flat, slots, v)``, the flat float32 caches ``(slots, kv_heads,
        width)``, the int64 slot of each row and its V ``(rows, kv_heads * width)`` (rows
        contiguous): each row's K (from the result) and V are stored at its slot, as
        ``index_copy_`` does; None (nothing stored) where a slot lies outside the caches."""
        qk = qk.contiguous()
        rows, total, _ = qk.shape
        out = torch.empty_like(qk)
        cos = sin = None
        if rope is not None:
            cos, sin = (t.contiguous() for t in rope)
        scratch = torch.empty(self.width, dtype=torch.float32)
        k_ptr = v_ptr = slot_ptr = v_src = None
        cache_slots = v_stride = 0
        if store is not None:
            k_flat, v_flat, slots, v = store
            slots = slots.to(torch.int64).contiguous()
            k_ptr, v_ptr, slot_ptr, v_src = k_flat.data_ptr(), v_flat.data_ptr(), slots.data_ptr(), v.data_ptr()
            cache_slots, v_stride = k_flat.shape[0], v.stride(0)
        failed = self.lib.rn_qk_norm_rope(qk.data_ptr(), rows, heads, total - heads, self.width, eps, q_scale,
                                          None if cos is None else cos.data_ptr(),
                                          None if sin is None else sin.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                                          self.lanes, k_ptr, v_ptr, slot_ptr, cache_slots, v_src, v_stride)
        return None if failed else out


def _torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, centered: bool) -> torch.Tensor:
    """The torch expressions of musegl_cuda.model (CenteredRMSNorm, plain_rms_norm with a weight;
    written here, not imported: the model imports this module; test_row_norms.py checks the C
    norms against the model's own functions too)."""
    if centered:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5) * weight


def _agrees(norms: RowNorms) -> bool:
    """The C norms give torch's bits on random rows of this width (magnitudes from 1e-3 to 1e3,
    1 to 17 rows), both norm forms and the add."""
    g = torch.Generator().manual_seed(norms.width)
    n = norms.width
    for rows, scale in ((1, 1.0), (3, 1e-3), (17, 1e3), (2, 30.0)):
        x = torch.randn(rows, n, generator=g) * scale
        o = torch.randn(rows, n, generator=g) * scale
        w = torch.randn(n, generator=g) + 1.0
        w2 = torch.rand(n, generator=g)
        for eps in (1e-6, 1e-5):
            for centered in (True, False):
                if not torch.equal(norms.norm(x, w, eps), _torch_norm(x, w, eps, centered)):
                    return False
            if not torch.equal(norms.norm(x, None, eps), x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)):
                return False
            h_out, x_out = norms.add_norm(o, x, w, eps, w2, eps)
            want_h = x + _torch_norm(o, w, eps, True)
            if not (torch.equal(h_out, want_h) and torch.equal(x_out, _torch_norm(want_h, w2, eps, True))):
                return False
    if n % 2 == 0:  # the QK norm with RoPE (n: a head's width), as model.Attention._qk_norm_rope in torch
        for rows in (1, 3):
            qk = torch.randn(rows, 6, n, generator=g) * 4
            cos, sin = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
            for rope in ((cos, sin), None):
                want = qk * torch.pow(qk.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)  # model.plain_rms_norm
                want[:, :4].mul_(0.37)
                if rope is not None:  # model.apply_rope
                    rotated = torch.cat((-want[..., n // 2:], want[..., :n // 2]), dim=-1)
                    want = want * rope[0][:, None, :] + rotated * rope[1][:, None, :]
                if not torch.equal(norms.qk_norm_rope(qk, 4, 1e-6, 0.37, rope), want):
                    return False
    return True


def for_width(width: int) -> RowNorms | None:
    """The C norms for rows of ``width`` values where they give torch's bits here, else None
    (checked once per width and process)."""
    if width in _widths:
        return _widths[width]
    found = None
    lib = _load()
    if lib is not None:
        found = next((c for c in (RowNorms(lib, width, lanes) for lanes in LANES if width >= lanes) if _agrees(c)),
                     None)
        if found is None:
            log.info("row norms of width %d stay in torch ops (the C sums differ from this torch's)", width)
    _widths[width] = found
    return found
