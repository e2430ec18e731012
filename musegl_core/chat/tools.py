"""Tool names in the prompt: flat-name aliases and namespaces.

The model addresses tools as ``namespace.function``. A declared tool whose
name has no dot is shown to the model as ``{name}.{name}`` and mapped back to
the declared name in responses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from musegl_core.errors import ApiError


def prompt_name(name: str) -> str:
    """The name a declared tool has in the prompt: ``x`` → ``x.x``."""
    return name if "." in name else f"{name}.{name}"


def namespace_of(name: str) -> str:
    """The namespace of a prompt name: the part before the first dot."""
    return name.split(".", 1)[0]


def tool_aliases(names: Iterable[str]) -> dict[str, str]:
    """Map each declared tool's prompt name to its declared name, in order.

    :raises ApiError: 400 ``invalid_tool_schema`` when two declared tools have
        the same name, or a flat tool ``x`` collides with a dotted tool ``x.x``.
    """
    aliases: dict[str, str] = {}
    for index, name in enumerate(names):
        alias = prompt_name(name)
        if alias in aliases:
            other = aliases[alias]
            detail = (
                f"tool {name!r} is declared twice"
                if other == name
                else f"tools {other!r} and {name!r} are both shown to the model as {alias!r}"
            )
            raise ApiError(
                400,
                f"Tool names collide: {detail}.",
                "invalid_request_error",
                "invalid_tool_schema",
                f"tools[{index}]",
            )
        aliases[alias] = name
    return aliases


def resolve_tool_name(invoked: str, aliases: Mapping[str, str]) -> str | None:
    """The declared name an invoke name selects, or ``None`` (undefined call).

    The prompt name (alias or dotted name) resolves, and so does the original
    flat name itself.
    """
    if invoked in aliases:
        return aliases[invoked]
    if "." not in invoked and prompt_name(invoked) in aliases:
        return invoked
    return None
