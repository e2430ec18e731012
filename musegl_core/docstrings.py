"""Help text from docstrings, for the commands' ``--help`` (``musegl`` and ``musegl worker``)."""

from __future__ import annotations

import re


def summary(doc: str | None) -> str:
    """The first line of a module docstring as plain text for ``--help``: reStructuredText
    markup (````literal````, ``:role:`target```) is taken out."""
    text = (doc or "").strip().splitlines()[0] if (doc or "").strip() else ""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")
