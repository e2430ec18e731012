"""Coercion of ATEM parameter bodies into an argument object.

Every parameter body is a raw string. For each object alternative of the
tool (in order), each parameter gets its *admissible types* from the
subschemas that govern its name in that alternative, and from them a list of
*candidate values*; combinations of candidates (the first parameter varying
slowest) are validated against the **complete** tool schema, and the first
valid object wins. Trying every alternative keeps parameters correlated with
the branch (``oneOf``, ``if``/``then``/``else``) the other parameters select.
At most :data:`MAX_COMBINATIONS` objects are validated per invoke.
"""

from __future__ import annotations

import itertools
import json
import re
from decimal import Decimal, InvalidOperation
from typing import Any

import attrs

from musegl_atem.budget import BudgetExhausted
from musegl_atem.parser import Invoke
from musegl_atem.schemas import MAX_SCHEMA_DEPTH, CompiledTool
from musegl_atem.validate import MAX_ARGUMENT_DEPTH, ToolValidator, ValidationRun

#: Argument objects validated per invoke (at most 1024 alternatives).
MAX_COMBINATIONS = 1024
#: Longest numeric spelling read as a number [decision]; longer digit runs
#: stay strings (no quadratic big-number conversion).
MAX_NUMBER_CHARS = 4000

JSON_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "object", "array"})
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_WS = " \t\r\n"


class CoercionFailed(Exception):
    """No argument object could be built; the message is client-facing."""


@attrs.frozen
class Candidate:
    """One reading of a raw body: ``kind`` names the reading (``null``,
    ``boolean``, ``number``, ``object``, ``array``, ``json``, ``string``)."""

    kind: str
    value: Any


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else "unknown"


def admissible_types(schema: Any, tool: CompiledTool, inlined: frozenset[int] = frozenset(), depth: int = 0) -> frozenset:
    """The JSON types a subschema admits (step 1): ``type`` (``number`` admits
    ``integer``), the types of ``enum``/``const`` values, ``$ref`` targets,
    ``allOf`` (intersection), ``anyOf``/``oneOf`` (union)."""
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return JSON_TYPES
    types = JSON_TYPES
    declared = schema.get("type")
    if declared is not None:
        names = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()
        if "number" in names:
            names.add("integer")
        types &= names
    if isinstance(schema.get("enum"), list):
        types &= {_json_type(value) for value in schema["enum"]} | (
            {"number"} if any(_json_type(v) == "integer" for v in schema["enum"]) else set()
        )
    if "const" in schema:
        kind = _json_type(schema["const"])
        types &= {kind, "number"} if kind == "integer" else {kind}
    if "$ref" in schema:
        target = tool.references.resolve(schema["$ref"])
        if id(target) not in inlined:
            types &= admissible_types(target, tool, inlined | {id(target)}, depth + 1)
    for member in schema.get("allOf") or ():
        types &= admissible_types(member, tool, inlined, depth + 1)
    for keyword in ("anyOf", "oneOf"):
        members = schema.get(keyword)
        if isinstance(members, list) and members:
            union: frozenset = frozenset()
            for member in members:
                union |= admissible_types(member, tool, inlined, depth + 1)
            types &= union
    return types


def governing_subschemas(alternative: tuple[dict, ...], name: str, run: ValidationRun) -> list[Any]:
    """The subschemas that govern parameter ``name`` in one alternative:
    ``properties[name]``, every matching ``patternProperties`` entry, else the
    ``additionalProperties`` projection. Pattern searches are budgeted."""
    found = []
    for subschema in alternative:
        properties = subschema.get("properties")
        patterns = subschema.get("patternProperties")
        governed = False
        if isinstance(properties, dict) and name in properties:
            found.append(properties[name])
            governed = True
        if isinstance(patterns, dict):
            for source, target in patterns.items():
                if run.search(source, name):
                    found.append(target)
                    governed = True
        if not governed and "additionalProperties" in subschema:
            found.append(subschema["additionalProperties"])
    return found


def _measure(value: Any, run: ValidationRun) -> None:
    """Charge one unit per nested value; refuse nesting past the limit."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        run.output.spend(1)
        if depth > MAX_ARGUMENT_DEPTH:
            raise BudgetExhausted(f"an argument nests deeper than {MAX_ARGUMENT_DEPTH} levels")
        if isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str, run: ValidationRun) -> tuple[bool, Any]:
    """Parse ``text`` as strict JSON (no NaN/Infinity); ``(False, None)`` if it is not."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return False, None
    _measure(value, run)
    return True, value


def lenient_number(text: str, integer_only: bool) -> tuple[bool, Any]:
    """A declared number's spelling (``+5``, ``007``, ``.5``, ``5.``, ``1e3``);
    integral values become ``int``. ``NaN``/``Infinity`` are never numbers."""
    if len(text) > MAX_NUMBER_CHARS or not _NUMBER.fullmatch(text):
        return False, None
    try:
        number = Decimal(text)
    except InvalidOperation:
        return False, None
    if abs(number.adjusted()) > MAX_NUMBER_CHARS:
        return False, None
    if number == number.to_integral_value():
        return True, int(number)
    if integer_only:
        return False, None
    value = float(number)
    return (True, value) if value not in (float("inf"), float("-inf")) else (False, None)


class _Readings:
    """The candidate values of one raw body, computed once per type set."""

    def __init__(self, raw: str, run: ValidationRun):
        self.raw = raw
        self.text = raw.strip(_WS)
        self.run = run
        self._json: tuple[bool, Any] | None = None
        self._cache: dict[frozenset, list[Candidate]] = {}

    def parsed(self) -> tuple[bool, Any]:
        if self._json is None:
            self._json = strict_json(self.text, self.run)
        return self._json

    def candidates(self, types: frozenset) -> list[Candidate]:
        """Step 2: typed readings before the literal string."""
        cached = self._cache.get(types)
        if cached is not None:
            return cached
        found: list[Candidate] = []
        if types == JSON_TYPES:  # no typing information
            ok, value = self.parsed()
            if ok:
                found.append(Candidate("json", value))
        else:
            text = self.text
            if "null" in types and text == "null":
                found.append(Candidate("null", None))
            if "boolean" in types and text in ("true", "false"):
                found.append(Candidate("boolean", text == "true"))
            if types & {"integer", "number"}:
                ok, value = lenient_number(text, "number" not in types)
                if ok:
                    found.append(Candidate("number", value))
            if "object" in types and text.startswith("{"):
                ok, value = self.parsed()
                if ok and isinstance(value, dict):
                    found.append(Candidate("object", value))
            if "array" in types and text.startswith("["):
                ok, value = self.parsed()
                if ok and isinstance(value, list):
                    found.append(Candidate("array", value))
        if "string" in types or not found:
            found.append(Candidate("string", self.raw))
        self._cache[types] = found
        return found


def coerce_arguments(invoke: Invoke, tool: CompiledTool, validator: ToolValidator, run: ValidationRun) -> dict:
    """The first valid argument object for ``invoke`` (step 3).

    :raises CoercionFailed: no combination is valid, or more than
        :data:`MAX_COMBINATIONS` would have to be tried.
    :raises BudgetExhausted: a response budget ran out.
    """
    readings = [_Readings(p.value, run) for p in invoke.parameters]
    names = [p.name for p in invoke.parameters]
    tried: set[tuple[str, ...]] = set()
    first_error = None
    for alternative in tool.alternatives:
        options = []
        for name, reading in zip(names, readings):
            run.output.spend(1)
            governing = governing_subschemas(alternative, name, run)
            types = JSON_TYPES
            for subschema in governing:
                types &= admissible_types(subschema, tool)
            options.append(reading.candidates(types))
        for combination in itertools.product(*options):
            key = tuple(candidate.kind for candidate in combination)
            if key in tried:
                continue
            tried.add(key)
            if len(tried) > MAX_COMBINATIONS:
                raise CoercionFailed(
                    f"the arguments of {invoke.name!r} admit more than {MAX_COMBINATIONS} readings; none validated"
                )
            arguments = {name: candidate.value for name, candidate in zip(names, combination)}
            error = validator.first_error(arguments)
            if error is None:
                return arguments
            first_error = first_error or error
    raise CoercionFailed(f"the arguments of {invoke.name!r} do not match its schema: {first_error}")
