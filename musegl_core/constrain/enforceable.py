"""Schemas llguidance compiles but cannot enforce, found before generation.

llguidance builds its automata lazily, token by token, so a grammar that
compiles can still fail mid-generation; its matcher then stops, and a
constraint that silently stopped would let free text through. Two kinds of
schema fail that way every time, and :func:`unenforceable` names them so the
front answers 400 instead (``docs/constrained.md``):

* **no finite instance** — a ``$ref`` cycle with no way out, such as
  ``{"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}`` or an
  object that requires a property whose schema is the object again
  (``{"type": "object", "properties": {"x": {"$ref": "#"}}, "required":
  ["x"]}``): every JSON value the grammar could start is infinite. Found as
  the least fixed point of "has a finite instance" over the schema graph
  (a context-free grammar's productive symbols). Only the structure is
  looked at: a ``$ref`` target, ``allOf``/``anyOf``/``oneOf``, the types a
  node allows, the required properties of an object and the minimum items of
  an array; value constraints (bounds, patterns, ``enum``) count as
  satisfiable here, llguidance reports the impossible ones itself. A schema
  without ``type`` allows every type, so ``{"properties": {"x": {"$ref":
  "#"}}, "required": ["x"]}`` *has* finite instances (``""``, ``0``, ``[]``):
  ``required`` applies to objects only;
* **a** ``pattern`` **that forces more than** :data:`MAX_FORCED_LENGTH`
  **characters** (``^a{100000}$``, ``^((a{100}){100}){10}$``,
  ``^a{20000}b{20000}$``): llguidance spells a forced run out state by state
  and exceeds its per-token lexer budget ("too many expressions
  constructed"; measured with llguidance 1.9: ``a{30000}`` passes,
  ``a{60000}`` fails, and so does ``a{20000}b{20000}c{20000}``). Counted
  repetitions multiply, sequences add up, an alternation counts its longest
  branch (:func:`forced_length`); ``{1,100000}`` forces one character and is
  fine.

What these checks miss, the worker's matcher still catches at run time: a
matcher that fails mid-generation ends the request with an error, never with
unconstrained text (:class:`musegl_core.constrain.matcher.GrammarProcessor`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Iterator
from urllib.parse import unquote

#: The most characters one ``pattern`` may force (:func:`forced_length`).
MAX_FORCED_LENGTH = 10_000

_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
                  "propertyNames", "unevaluatedItems", "unevaluatedProperties")


#: The most ``enum`` members one constrained schema may list [decision]: far above a real
#: schema's (a country list is 250); the grammar engine compiles 10,000 strings in about
#: 0.05 s and refuses somewhere between 30,000 and 60,000, after up to a second's work.
MAX_ENUM_VALUES = 10_000


def unenforceable(schema: Any) -> str | None:
    """Why ``schema`` cannot be enforced (a sentence), or None."""
    if not isinstance(schema, dict):
        return None
    values = 0
    for node in _nodes(schema):
        if isinstance(node.get("enum"), list):
            values += len(node["enum"])
            if values > MAX_ENUM_VALUES:
                return f"its enums list more than {MAX_ENUM_VALUES} values"
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            forced = forced_length(pattern)
            if forced > MAX_FORCED_LENGTH:
                return (f"the pattern {_short(pattern)} forces {forced} characters; the grammar engine "
                        f"enforces at most {MAX_FORCED_LENGTH} (use a smaller count, or maxLength)")
    if not _Finite(schema).root():
        return ("the schema has no finite instance: every value it allows contains itself "
                "(a $ref cycle with no way out)")
    return None


def forced_length(pattern: str) -> int:
    """How many characters every match of ``pattern`` (an ECMA-262 regex as
    JSON Schema uses it) at least spells out, counting a character class or
    ``.`` as one: counted repetitions multiply (``(ab){3}`` is 6), a sequence
    adds up, an alternation takes its longest branch, and ``*``/``?``
    contribute nothing. An upper bound on the forced work, not a parser."""
    stack = [[0, 0]]  # per open group: [longest finished alternative, the current one]
    last = 0  # what the atom just before the scan position contributed
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        frame = stack[-1]
        if char in "^$":
            i += 1
            continue
        if char == "(":
            stack.append([0, 0])
            i += 3 if pattern.startswith(("?:", "?=", "?!"), i + 1) else 1
            continue
        if char == ")" and len(stack) > 1:
            best, current = stack.pop()
            last = max(best, current)
            stack[-1][1] += last
            i += 1
            continue
        if char == "|":
            frame[0], frame[1], last = max(frame[0], frame[1]), 0, 0
            i += 1
            continue
        match = _QUANTIFIER.match(pattern, i) if char == "{" else None
        if match is not None or char in "*?+":
            least = int(match.group(1)) if match is not None else (1 if char == "+" else 0)
            frame[1] += last * (least - 1)
            last = 0  # a lazy "?" after a quantifier changes nothing
            i = match.end() if match is not None else i + 1
            continue
        if char == "\\":
            i += 2
        elif char == "[":
            i = _class_end(pattern, i)
        else:
            i += 1
        frame[1] += 1
        last = 1
    return max(stack[0])


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class that opens at ``start``."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _children(node: dict) -> Iterator[Any]:
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            yield from value
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            yield from value.values()
    for key in _SCHEMA_VALUES:
        value = node.get(key)
        if isinstance(value, list):  # draft 7 tuple items
            yield from value
        elif value is not None:
            yield value


def _nodes(schema: dict, resolve: Any = None) -> Iterator[dict]:
    """Every schema object inside ``schema`` (iterative, each once); with
    ``resolve`` (node -> ``$ref`` target), reference targets too."""
    seen: set[int] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(_children(node))
        if resolve is not None:
            stack.append(resolve(node))


class _Finite:
    """Which schema objects have a finite instance: the least fixed point,
    computed with a work list (each node is re-evaluated when one of the
    nodes it depends on turns out finite)."""

    def __init__(self, root: dict):
        self.root_schema = root
        self.finite: set[int] = set()
        self.dependents: dict[int, list[dict]] = defaultdict(list)
        nodes = list(_nodes(root, self._target))
        for node in nodes:
            for dep in self._depends_on(node):
                self.dependents[id(dep)].append(node)
        work = list(nodes)
        while work:
            node = work.pop()
            if id(node) in self.finite or not self._evaluate(node):
                continue
            self.finite.add(id(node))
            work.extend(self.dependents.get(id(node), ()))

    def root(self) -> bool:
        return self.has(self.root_schema)

    def has(self, schema: Any) -> bool:
        """Whether ``schema`` (a subschema, a boolean, or anything) has a finite instance so far."""
        if schema is False:
            return False
        if not isinstance(schema, dict):
            return True  # True, or something malformed that other checks report
        return id(schema) in self.finite

    def _target(self, node: dict) -> Any:
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#"):
            return True  # no reference, or one resolved elsewhere (and refused there when remote)
        target: Any = self.root_schema
        for part in ref[1:].split("/")[1:] if ref != "#" else ():
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return True  # an unresolvable reference: the schema preflight reports it
        return target

    def _depends_on(self, node: dict) -> Iterator[Any]:
        target = self._target(node)
        if isinstance(target, dict):
            yield target
        yield from (child for child in _children(node) if isinstance(child, dict))

    def _evaluate(self, node: dict) -> bool:
        if "const" in node or isinstance(node.get("enum"), list) and node["enum"]:
            return True  # a literal value
        if not self.has(self._target(node)):
            return False
        if not all(self.has(member) for member in _list(node, "allOf")):
            return False
        for key in ("anyOf", "oneOf"):
            members = _list(node, key)
            if members and not any(self.has(member) for member in members):
                return False
        types = node.get("type", _TYPES)
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list):
            return True
        return any(self._type_finite(node, kind) for kind in types if kind in _TYPES)

    def _type_finite(self, node: dict, kind: str) -> bool:
        if kind == "object":
            properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            extra = node.get("additionalProperties", True)
            patterned = bool(node.get("patternProperties"))
            for name in _list(node, "required"):
                if not isinstance(name, str):
                    continue
                if name in properties:
                    if not self.has(properties[name]):
                        return False
                elif not patterned and not self.has(extra):
                    return False
            return True
        if kind == "array":
            least = node.get("minItems", 0)
            least = least if isinstance(least, int) and not isinstance(least, bool) else 0
            if least <= 0:
                return True  # []
            items = node.get("items", True)
            prefix = _list(node, "prefixItems")
            if isinstance(items, list):  # draft 7 tuple form
                prefix, items = items, node.get("additionalItems", True)
            needed = prefix[:least]
            if not all(self.has(item) for item in needed):
                return False
            return least <= len(prefix) or self.has(items)
        return True


def _list(node: dict, key: str) -> list:
    value = node.get(key)
    return value if isinstance(value, list) else []
