"""Context-overflow messages that OpenRouter clients can act on.

OpenRouter reports an oversized request as::

    This endpoint's maximum context length is N tokens. However, you requested
    about M tokens (X of text input, Y of tool input, Z in the output). ...

and agent clients (the Muse provider among them) parse it with a pattern like
:data:`RECOVERABLE_PATTERN` to decide how much history to compact before they
retry. musegl keeps that wording for overflows that compaction can fix, with
these counts:

* ``N`` is the *prompt budget*: the context window minus the completion
  reservation (``max_tokens``, or one token when absent), i.e. the
  ``max_prompt_tokens`` metadata;
* ``X`` is the prompt's token count, image positions and the numeric BOS
  included (the front counts text prompts; the worker counts image prompts).
  When counting stopped once the prompt passed the budget
  (``prompt_tokens_exact: false``), ``X`` is a lower bound and the message
  says so: "at least X tokens (at least X of text input, ...)";
* ``Z`` is ``0``: the reservation is already taken out of ``N``, so a client
  computing ``X + Z - N`` (the excess) or ``N - Z`` (its input budget) gets
  the right number either way. The full window stays in the metadata
  (``context_length``).

When the reservation alone fills the window no prompt can fit, and a client
that compacts would loop forever (OpenHands issue 9937). That message keeps
the diagnostics in the metadata but deliberately avoids the recoverable
wording (it never says "maximum context length"). So does an overflow whose
counts are unknown.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

#: How OpenRouter clients recognise a recoverable overflow and read its counts:
#: the budget, the text input and the output reservation.
RECOVERABLE_PATTERN = re.compile(
    r"maximum context length is (\d+) tokens.*?(\d+) of text input.*?(\d+) in the output", re.DOTALL
)

#: The musegl error code of an overflow (the worker's and the front's).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@attrs.frozen
class OverflowCounts:
    """The counts of one overflow, read from the error's metadata."""

    context_length: int  # the full model window (the runtime --max-context)
    prompt_tokens: int  # image positions and BOS included
    completion_reservation: int  # max_tokens, or 1 when absent
    exact: bool = True  # False: counting stopped once the prompt passed the budget (a lower bound)

    @property
    def max_prompt_tokens(self) -> int:
        """The prompt budget after the completion reservation (never negative)."""
        return max(self.context_length - self.completion_reservation, 0)

    @property
    def recoverable(self) -> bool:
        """Whether a shorter prompt could fit: the reservation leaves room for one."""
        return self.completion_reservation < self.context_length

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> OverflowCounts | None:
        """The counts, or ``None`` when an older worker gave none (or bad ones)."""
        values = [metadata.get(key) for key in ("context_length", "prompt_tokens", "completion_reservation")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return None
        return cls(*values, exact=metadata.get("prompt_tokens_exact", True) is not False)


def overflow_message(counts: OverflowCounts | None) -> str:
    """The client-facing message for an overflow with ``counts``."""
    if counts is None:
        return (
            "The prompt does not fit this endpoint's context window, and the server could not "
            "determine the token counts. Shorten the conversation or lower max_tokens."
        )
    if not counts.recoverable:
        return (
            f"The completion reservation of {counts.completion_reservation} tokens (max_tokens) "
            f"fills this endpoint's entire {counts.context_length}-token context window, so no "
            f"prompt can fit; compacting the messages cannot help. Lower max_tokens below "
            f"{counts.context_length}."
        )
    budget = counts.max_prompt_tokens
    if not counts.exact:  # the count is where counting stopped: say so where the client reads it
        return (
            f"This endpoint's maximum context length is {budget} tokens. However, you requested "
            f"at least {counts.prompt_tokens} tokens (at least {counts.prompt_tokens} of text input, 0 in the "
            f"output; counting stopped once the prompt passed the budget, so the prompt is longer). Please "
            f"reduce the length of the messages by more than the difference. (Model window: "
            f"{counts.context_length} tokens; completion reservation: {counts.completion_reservation} tokens.)"
        )
    return (
        f"This endpoint's maximum context length is {budget} tokens. However, you requested "
        f"about {counts.prompt_tokens} tokens ({counts.prompt_tokens} of text input, 0 in the output). "
        f"Please reduce the length of the messages. (Model window: {counts.context_length} tokens; "
        f"completion reservation: {counts.completion_reservation} tokens.)"
    )
