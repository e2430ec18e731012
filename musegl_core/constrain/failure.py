"""What a failed llguidance matcher says, for the request's ``constraint_failed`` error."""

from __future__ import annotations

from typing import Any


def failure_reason(matcher: Any) -> str:
    """The first line of a failed matcher's error, with its stop reason."""
    error = (matcher.get_error() or "").strip().splitlines()
    first = error[0] if error else "the grammar engine stopped"
    reason = matcher.stop_reason() if hasattr(matcher, "stop_reason") else None
    return f"{first} ({reason})" if reason and reason not in first else first
