"""Per-response work budgets: bounded work whatever the model wrote.

Two budgets bound what one response may cost after generation, whatever the
model wrote:

* :class:`OutputBudget` counts abstract work units: one per keyword check the
  validator makes, one per nested value visited (parsing, canonical keys) and
  one per element touched by deep comparisons (``enum``, ``const``,
  ``uniqueItems``). All invokes of a response share it.
* :class:`RegexBudget` bounds the wall-clock time of every regular-expression
  search made for the response (``pattern``, ``patternProperties``, the
  annotation searches of ``unevaluatedProperties`` and the property
  projections coercion looks up). Searches run with the ``regex`` package's
  ``timeout`` argument, so a catastrophic pattern is interrupted, not awaited.

Exhausting either raises :class:`BudgetExhausted`, which the parser turns into
502 ``invalid_tool_output``.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

#: Work units one response may spend validating and coercing its tool calls.
#: Ordinary calls (hundreds of parameters, kilobytes of arguments) use a few
#: thousand; the limit is reached only by tens of megabytes of nested values
#: or by tens of thousands of keyword checks per call.
OUTPUT_BUDGET_UNITS = 2_000_000

#: Seconds of regular-expression search one response may spend (100 ms).
REGEX_BUDGET_SECONDS = 0.1


class BudgetExhausted(Exception):
    """A per-response budget ran out; the message says which."""


@attrs.define
class OutputBudget:
    """Counts work units; :meth:`spend` raises once ``limit`` is exceeded."""

    limit: int = OUTPUT_BUDGET_UNITS
    spent: int = 0

    def spend(self, units: int = 1) -> None:
        """Charge ``units``; raises :class:`BudgetExhausted` past the limit."""
        self.spent += units
        if self.spent > self.limit:
            raise BudgetExhausted(
                f"validating the tool calls needed more than {self.limit} units of work "
                "(too many calls, parameters or nested values)"
            )


@attrs.define
class RegexBudget:
    """Wall-clock budget shared by every regex search of one response."""

    seconds: float = REGEX_BUDGET_SECONDS
    used: float = 0.0

    def search(self, pattern: Any, text: str) -> bool:
        """Whether compiled ``pattern`` (from :mod:`regex`) matches anywhere in
        ``text``; the search is interrupted when the budget runs out."""
        remaining = self.seconds - self.used
        if remaining <= 0:
            raise BudgetExhausted(self._message())
        started = time.perf_counter()
        try:
            found = pattern.search(text, timeout=remaining) is not None
        except TimeoutError:
            self.used = self.seconds
            raise BudgetExhausted(self._message()) from None
        finally:
            self.used += time.perf_counter() - started
        return found

    def _message(self) -> str:
        return (
            f"regular-expression searches for the tool calls exceeded their "
            f"{int(self.seconds * 1000)} ms budget"
        )
