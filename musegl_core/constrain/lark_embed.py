"""A client's Lark grammar inside one of the server's grammars.

OpenAI's freeform (``custom``) tools describe their input with a grammar in
llguidance's Lark dialect (Codex's ``apply_patch``). A tool parser that
constrains calls embeds that grammar as the rule of one raw-text value:

* a JSON Schema string node may carry :data:`LARK_KEY` (the grammar text);
  the value must then be a sentence of that grammar (its ``start`` rule);
* :func:`embed_lark` renames every rule and terminal the grammar defines
  with a prefix (so two grammars, and the server's own rules, never collide)
  and returns the rules plus the name of the renamed ``start``.

An ``%import common.LF`` becomes ``%import common.LF -> PREFIX_LF`` (two
embedded grammars may import the same name). Other directives (``%ignore``,
``%llguidance``, ...) would change the surrounding grammar too and are refused
(:class:`LarkEmbedError`, a surface's 400). Strings, regular expressions and
comments are copied verbatim; only identifiers that name a definition or an
import are renamed (tree aliases after ``->`` stay as written).
"""

from __future__ import annotations

import re

#: The JSON Schema keyword (on a string node) holding a Lark grammar for the string.
LARK_KEY = "x-musegl-lark"

_TOKEN = re.compile(
    r"""(?P<string>"(?:[^"\\\n]|\\.)*"i?)"""
    r"""|(?P<regex>/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*)"""
    r"""|(?P<comment>//[^\n]*)"""
    r"""|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"""
    r"""|(?P<other>\s+|->|%[a-z]+|.)""",
    re.S,
)
_DEFINITION = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)\s*(?:\[[^\]\n]*\])?\s*(?:\.-?\d+)?\s*:", re.M)
_DIRECTIVE = re.compile(r"^\s*(%[a-z]+)", re.M)
_IMPORT = re.compile(r"^[ \t]*%import[ \t]+([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)[ \t]*(?:->[ \t]*([A-Za-z_]\w*))?[ \t]*$", re.M)


class LarkEmbedError(ValueError):
    """The grammar cannot be embedded (the message says why)."""


def defined_names(grammar: str) -> list[str]:
    """The rules and terminals ``grammar`` defines, in order."""
    return list(dict.fromkeys(match.group(1) for match in _DEFINITION.finditer(_strip_comments(grammar))))


def _strip_comments(grammar: str) -> str:
    return "".join("" if m.lastgroup == "comment" else m.group(0) for m in _TOKEN.finditer(grammar))


def embed_lark(grammar: str, prefix: str) -> tuple[str, str]:
    """``(rules, start)``: ``grammar`` with every defined name prefixed
    (lowercase rules with ``prefix``, uppercase terminals with ``prefix.upper()``),
    and the renamed ``start`` rule. Raises :class:`LarkEmbedError`."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise LarkEmbedError("the grammar is empty")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", prefix):
        raise ValueError(f"bad prefix {prefix!r}")
    text = _strip_comments(grammar)
    for match in _DIRECTIVE.finditer(text):
        if match.group(1) != "%import":
            raise LarkEmbedError(f"the directive {match.group(1)} is not allowed in an embedded grammar")
    imports = {}
    for line in text.splitlines():
        if line.strip().startswith("%import"):
            match = _IMPORT.fullmatch(line)
            if match is None or "." not in match.group(1):
                raise LarkEmbedError(f"only '%import module.NAME' imports can be embedded, got {line.strip()!r}")
            imports[match.group(2) or match.group(1).rsplit(".", 1)[1]] = match.group(1)
    text = _IMPORT.sub("", text)
    names = set(defined_names(text)) | set(imports)
    if "start" not in names:
        raise LarkEmbedError("the grammar has no 'start' rule")

    def renamed(name: str) -> str:
        return (prefix.upper() if name.isupper() else prefix) + "_" + name

    out, after_arrow = [], False
    for match in _TOKEN.finditer(text):
        kind, token = match.lastgroup, match.group(0)
        if kind == "other":
            if token == "->":
                after_arrow = True
            elif "\n" in token:
                after_arrow = False
            out.append(token)
        elif kind == "name" and token in names and not after_arrow:
            out.append(renamed(token))
        else:
            if kind == "name":
                after_arrow = False
            out.append(token)
    lines = [f"%import {path} -> {renamed(name)}\n" for name, path in imports.items()]
    return "".join(out).strip() + "\n" + "".join(lines), renamed("start")
