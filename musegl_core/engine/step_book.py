"""Where the engine's time goes, by step composition.

Every executor step is one of three kinds:

* **decode**: only decoding sequences (one row each, or a verify block of drafts);
* **mixed**: decoding sequences and prefill chunks in the same forward;
* **prefill**: only prefill chunks (nothing was decoding).

:class:`StepBook` counts the steps of each kind, their wall time (the
executor call, block copies included), the decode rows they carried and the
prefill rows they carried. From these counters one reads how much of the
inter-token latency of running decodes comes from prefill sharing their
steps: a decode row in a mixed step waited ``mixed_seconds / mixed_steps``
instead of ``decode_seconds / decode_steps``. ``GET /metrics`` exposes them
(``musegl_engine_{decode,mixed,prefill}_step*``; ``docs/metrics.md``).
"""

from __future__ import annotations

from typing import Iterable

import attrs

from musegl_core.engine.request import Phase, SequenceState

KINDS = ("decode", "mixed", "prefill")


@attrs.define
class StepBook:
    steps: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(KINDS, 0))
    seconds: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(KINDS, 0.0))
    decode_rows: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(KINDS, 0))
    prefill_rows: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(KINDS, 0))

    @staticmethod
    def kind(plan: Iterable[tuple[SequenceState, int]]) -> tuple[str, int, int]:
        """``(kind, decode rows, prefill rows)`` of a planned step (read before the step commits)."""
        decode = prefill = 0
        for seq, rows in plan:
            if seq.phase is Phase.DECODE:
                decode += rows
            else:
                prefill += rows
        kind = "prefill" if not decode else "mixed" if prefill else "decode"
        return kind, decode, prefill

    def record(self, kind: tuple[str, int, int], seconds: float) -> None:
        """Count one step of ``kind`` (:meth:`kind` of its plan) that took ``seconds``."""
        name, decode, prefill = kind
        self.steps[name] += 1
        self.seconds[name] += seconds
        self.decode_rows[name] += decode
        self.prefill_rows[name] += prefill

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name in KINDS:
            out[f"{name}_steps"] = self.steps[name]
            out[f"{name}_step_seconds"] = self.seconds[name]
            if name != "prefill":
                out[f"{name}_step_decode_rows"] = self.decode_rows[name]
            if name != "decode":
                out[f"{name}_step_prefill_rows"] = self.prefill_rows[name]
        return out
