"""The prompt's pieces: what a chat template writes and a worker request carries.

A module of its own, below both the chat package (templates render
:class:`PromptSegment` objects) and the engine (a
:class:`~musegl_core.engine.request.GenerateRequest` carries them), so that
neither imports the other for it.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class PromptSegment:
    """A piece of the prompt: text, or token ids.

    Exactly one of ``text`` and ``token_ids`` is set. With ``special=True`` the
    special-token strings written in ``text`` (``<|start|>``) become their
    single ids; with ``special=False`` (text a client typed) they stay literal
    text, so a user who types ``<|eot|>`` never injects a control token."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    special: bool = True
