"""How many prompt positions a step may prefill while other sequences decode.

A decoding sequence emits one token per step, so its inter-token latency is
the time of the steps it rides in. A prefill chunk that shares the step makes
it longer: on a GPU a few hundred prompt rows cost little more than the decode
rows (the step reads the weights either way), on a CPU each prompt row costs
real compute and a 512-row chunk can make a step several times longer than a
decode-only step. :class:`PrefillBudget` bounds that stretch.

**The bound.** While ``d >= 1`` sequences decode, a step's prefill rows may
add at most ``(stall_factor - 1) x`` the decode-only step time, so a decoding
sequence waits at most ``stall_factor`` decode steps per token. With ``p``
sequences waiting to prefill, the allowance grows to
``(stall_factor - 1) x max(1, p / d) x`` the decode-only step time: the step
is shared per request, so a burst of arriving turns behind a few decoders is
not starved to protect them (the decoders' bound is then
``1 + (stall_factor - 1) x p / d`` decode steps, and ``p`` is at most the
number of session slots). The rows are ``allowance / cost per prompt row``,
at least :data:`MIN_PREFILL_ROWS` (prefill always progresses) and at most
``--max-prefill-chunk``. With nothing decoding the budget is
``--max-prefill-chunk`` (no one to protect).

**The estimates** come from the steps the engine runs (:meth:`observe`):
the decode-only step time is an exponential moving average over steps that
only decoded. What prefill adds to a step (``step time - decode-only step
time``; for a prefill-only step the decode-only time stands for the fixed part
of the step) is fitted, over the steps that prefilled once a decode-only time
is known, as ``fixed + rows x per-row`` by least squares on decayed sums. The
fixed part matters on a CPU: a step with any prefill rows runs the wide
products (stored weights decoded for the GEMM, small-row GEMMs well below the
throughput of wide ones), 40-60 ms on the bench model against a 44 ms step of
four decodes, so it can eat most of the allowance. The rows of a step are
``(allowance - fixed) / per-row``, but the fixed part takes at most half of
the allowance: past that, chunks small enough to keep the bound would pay the
fixed part for a handful of rows again and again (the bound then stretches by
up to half an allowance; a fixed part larger than the allowance cannot be
bounded by any chunk size). Until two different chunk sizes were seen the
estimate is the ratio (no fixed part). Before a decode-only step was seen the
budget is ``--max-prefill-chunk``; after it, until a prompt row's cost is
known, a probe of :data:`PROBE_ROWS` rows. They follow the hardware and the
load, so one setting bounds the stretch on a GPU (where the budget is usually
the whole chunk) and on a CPU (where it is a few dozen to a few hundred rows).
``stall_factor`` 0 turns the bound off.

Prefill rows go to the prefilling sequences first come first served (the
scheduler's order): sharing them equally would delay every arriving turn's
first token instead of finishing the earliest first.
"""

from __future__ import annotations

import math

import attrs

#: Fewest prompt rows a step with prefill work carries, whatever the estimates say.
MIN_PREFILL_ROWS = 16
#: Prompt rows of the first step that prefills beside decoders, before a row's cost is known.
PROBE_ROWS = 64
#: Weight of the newest decode-only step in the moving average.
DECODE_ALPHA = 0.25
#: Decay of the sums behind the cost per prompt row, per prefilling step.
PREFILL_DECAY = 0.75


@attrs.define
class PrefillBudget:
    """Prompt rows per step while sequences decode (see the module docstring)."""

    stall_factor: float = 6.0
    max_chunk: int = 512
    min_rows: int = MIN_PREFILL_ROWS
    decode_seconds: float | None = None  # moving average of a decode-only step
    # decayed sums over prefilling steps of 1, rows, extra seconds, rows^2 and rows x extra
    _w: float = 0.0
    _r: float = 0.0
    _t: float = 0.0
    _rr: float = 0.0
    _rt: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.stall_factor > 0

    def _fit(self) -> tuple[float, float] | None:
        """``(fixed seconds, seconds per row)`` of what prefill adds to a step."""
        if self._r <= 0:
            return None
        ratio = (0.0, self._t / self._r)
        spread = self._w * self._rr - self._r * self._r
        if spread <= 1e-9 * self._w * self._rr:  # one chunk size so far: no intercept to fit
            return ratio
        per_row = (self._w * self._rt - self._r * self._t) / spread
        fixed = (self._t - per_row * self._r) / self._w
        if per_row <= 0 or fixed < 0:
            return ratio
        return fixed, per_row

    @property
    def row_seconds(self) -> float | None:
        """Estimated seconds one prompt row adds to a step (None until observed)."""
        fit = self._fit()
        return None if fit is None else fit[1]

    @property
    def fixed_seconds(self) -> float | None:
        """Estimated seconds any prefill adds to a step besides its rows (None until observed)."""
        fit = self._fit()
        return None if fit is None else fit[0]

    def observe(self, decode_rows: int, prefill_rows: int, seconds: float) -> None:
        """Learn from one step that carried ``decode_rows`` and ``prefill_rows`` in ``seconds``."""
        if seconds < 0 or (not decode_rows and not prefill_rows):
            return
        if not prefill_rows:
            if self.decode_seconds is None:
                self.decode_seconds = seconds
            else:
                self.decode_seconds += DECODE_ALPHA * (seconds - self.decode_seconds)
            return
        if self.decode_seconds is None:
            return  # the step's fixed part is unknown: its time says little about a row
        extra = max(seconds - self.decode_seconds, 0.0)
        d = PREFILL_DECAY
        self._w = d * self._w + 1.0
        self._r = d * self._r + prefill_rows
        self._t = d * self._t + extra
        self._rr = d * self._rr + prefill_rows * prefill_rows
        self._rt = d * self._rt + prefill_rows * extra

    def rows(self, decoding: int, prefilling: int) -> int:
        """Prompt rows the next step may carry, with ``decoding`` sequences decoding in it
        and ``prefilling`` sequences waiting to prefill."""
        if not self.enabled or decoding <= 0:
            return self.max_chunk
        if self.decode_seconds is None:
            return self.max_chunk
        fit = self._fit()
        if fit is None:
            return min(PROBE_ROWS, self.max_chunk)
        fixed, row = fit
        if row <= 0:
            return self.max_chunk
        allowance = (self.stall_factor - 1.0) * self.decode_seconds * max(1.0, prefilling / decoding)
        rows = math.floor(max(allowance - fixed, allowance / 2) / row)
        return max(min(self.min_rows, self.max_chunk), min(self.max_chunk, rows))
