"""Validation of argument objects with bounded work.

Each dialect's ``jsonschema`` validator is extended so that

* every keyword check charges the response's :class:`~musegl_atem.budget.OutputBudget`;
* ``pattern``, ``patternProperties``, ``additionalProperties`` (which looks
  up pattern properties) and ``unevaluatedProperties`` (which searches
  patterns for annotations) use the request's patterns compiled with
  ``regex`` and search under the response's
  :class:`~musegl_atem.budget.RegexBudget` — jsonschema's own versions use
  Python's ``re`` without a timeout;
* ``enum``, ``const`` and ``uniqueItems`` compare *canonical keys*: a
  hashable normal form of a JSON value in which booleans differ
  from numbers, ``1`` equals ``1.0`` and objects ignore key order. Computing
  a key costs one unit per nested value; ``uniqueItems`` is a set insertion
  per item, never a pairwise comparison.

The budgets of the response being validated travel in a context variable
(:func:`validation_run`), so one validator, compiled once per request, serves
every call of the response.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterator

import attrs
import jsonschema
import referencing
import referencing.exceptions
import regex
from jsonschema import ValidationError

from musegl_atem.budget import BudgetExhausted, OutputBudget, RegexBudget
from musegl_atem.dialects import BASE_VALIDATORS
from musegl_atem.schemas import CompiledTool

#: Nesting of argument values (arrays and objects) [decision]: deeper values
#: fail with 502 before any validator recursion.
MAX_ARGUMENT_DEPTH = 64


@attrs.define
class ValidationRun:
    """The budgets and compiled patterns in force while validating one response."""

    output: OutputBudget
    regex: RegexBudget
    patterns: dict[str, Any] = attrs.field(factory=dict)
    keys: dict[int, frozenset] = attrs.field(factory=dict)

    def search(self, source: str, text: str) -> bool:
        pattern = self.patterns.get(source)
        if pattern is None:  # compiled in preflight; this is only a fallback
            pattern = self.patterns[source] = regex.compile(source)
        return self.regex.search(pattern, text)


_RUN: contextvars.ContextVar[ValidationRun] = contextvars.ContextVar("musegl_atem_validation_run")


@contextlib.contextmanager
def validation_run(run: ValidationRun) -> Iterator[ValidationRun]:
    """Make ``run`` the budgets of the validations inside the block."""
    token = _RUN.set(run)
    try:
        yield run
    finally:
        _RUN.reset(token)


def _run() -> ValidationRun:
    try:
        return _RUN.get()
    except LookupError:  # validating outside a response: a fresh budget
        return ValidationRun(OutputBudget(), RegexBudget())


# -- canonical keys -------------------------------------------------------------------
def canonical_key(value: Any, budget: OutputBudget | None = None, depth: int = 0) -> Any:
    """A hashable normal form of a JSON value for JSON equality.

    Booleans are tagged apart from numbers; numbers with an integral value
    become ``int`` (so ``1`` and ``1.0`` agree); arrays keep their order and
    objects are sorted by key. One budget unit per value visited.
    """
    if budget is not None:
        budget.spend(1)
    if depth > MAX_ARGUMENT_DEPTH:
        raise BudgetExhausted(f"a value nests deeper than {MAX_ARGUMENT_DEPTH} levels")
    if value is None or isinstance(value, str):
        return ("s", value) if value is not None else ("n",)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        return ("#", value)
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value):
            return ("#", int(value))
        return ("#", value)
    if isinstance(value, list):
        return ("a", tuple(canonical_key(item, budget, depth + 1) for item in value))
    if isinstance(value, dict):
        items = tuple(sorted((key, canonical_key(item, budget, depth + 1)) for key, item in value.items()))
        return ("o", items)
    return ("?", repr(value))


def _keys_of(values: list) -> frozenset:
    """The canonical keys of an ``enum`` list, computed once per request."""
    run = _run()
    found = run.keys.get(id(values))
    if found is None:
        found = run.keys[id(values)] = frozenset(canonical_key(v, run.output) for v in values)
    return found


# -- keyword implementations ----------------------------------------------------------
def _enum(validator, enums, instance, schema):
    if not isinstance(enums, list):
        return
    if canonical_key(instance, _run().output) not in _keys_of(enums):
        yield ValidationError(f"{_short(instance)} is not one of the allowed values")


def _const(validator, const, instance, schema):
    run = _run()
    if canonical_key(instance, run.output) != canonical_key(const, run.output):
        yield ValidationError(f"{_short(const)} was expected")


def _unique_items(validator, unique, instance, schema):
    if not unique or not validator.is_type(instance, "array"):
        return
    budget = _run().output
    seen = set()
    for item in instance:
        key = canonical_key(item, budget)
        if key in seen:
            yield ValidationError(f"{_short(instance)} has non-unique elements")
            return
        seen.add(key)


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _run().search(pattern, instance):
        yield ValidationError(f"{_short(instance)} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    run = _run()
    for source, subschema in patterns.items():
        for name, value in instance.items():
            if run.search(source, name):
                yield from validator.descend(value, subschema, path=name, schema_path=source)


def _additional(instance: dict, schema: dict) -> list[str]:
    properties = schema.get("properties", {})
    patterns = schema.get("patternProperties", {})
    run = _run()
    return [
        name
        for name in instance
        if name not in properties and not any(run.search(source, name) for source in patterns)
    ]


def _additional_properties(validator, additional, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    extras = _additional(instance, schema)
    if validator.is_type(additional, "object"):
        for name in extras:
            yield from validator.descend(instance[name], additional, path=name)
    elif additional is False and extras:
        names = ", ".join(repr(name) for name in sorted(extras)[:10])
        yield ValidationError(f"Additional properties are not allowed ({names} unexpected)")


def _evaluated_keys(validator, instance: dict, schema: Any, depth: int = 0) -> set[str]:
    """Property names some keyword of ``schema`` evaluates (the annotations
    ``unevaluatedProperties`` needs), with budgeted regex searches."""
    if not isinstance(schema, dict) or depth > MAX_ARGUMENT_DEPTH:
        return set()
    run = _run()
    run.output.spend(1)
    keys: set[str] = set()
    ref = schema.get("$ref")
    if ref is not None:
        resolved = validator._resolver.lookup(ref)
        keys |= _evaluated_keys(
            validator.evolve(schema=resolved.contents, _resolver=resolved.resolver), instance, resolved.contents, depth + 1
        )
    properties = schema.get("properties")
    if isinstance(properties, dict):
        keys |= properties.keys() & instance.keys()
    patterns = schema.get("patternProperties")
    if isinstance(patterns, dict):
        keys |= {name for name in instance if any(run.search(source, name) for source in patterns)}
    for keyword in ("additionalProperties", "unevaluatedProperties"):
        if keyword in schema:
            subschema = schema[keyword]
            keys |= {name for name, value in instance.items() if validator.evolve(schema=subschema).is_valid(value)}
    for name, subschema in (schema.get("dependentSchemas") or {}).items():
        if name in instance:
            keys |= _evaluated_keys(validator, instance, subschema, depth + 1)
    for keyword in ("allOf", "oneOf", "anyOf"):
        for subschema in schema.get(keyword) or ():
            if validator.evolve(schema=subschema).is_valid(instance):
                keys |= _evaluated_keys(validator, instance, subschema, depth + 1)
    if "if" in schema:
        if validator.evolve(schema=schema["if"]).is_valid(instance):
            keys |= _evaluated_keys(validator, instance, schema["if"], depth + 1)
            if "then" in schema:
                keys |= _evaluated_keys(validator, instance, schema["then"], depth + 1)
        elif "else" in schema:
            keys |= _evaluated_keys(validator, instance, schema["else"], depth + 1)
    return keys


def _unevaluated_properties(validator, unevaluated, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    evaluated = _evaluated_keys(validator, instance, schema)
    invalid = [
        name
        for name in instance
        if name not in evaluated and any(validator.descend(instance[name], unevaluated, path=name))
    ]
    if invalid:
        names = ", ".join(repr(name) for name in sorted(invalid)[:10])
        yield ValidationError(f"Unevaluated properties are not allowed ({names} unexpected)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_OVERRIDES = {
    "enum": _enum,
    "const": _const,
    "uniqueItems": _unique_items,
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "unevaluatedProperties": _unevaluated_properties,
}


def _charged(keyword_check):
    def check(validator, value, instance, schema):
        _run().output.spend(1)
        errors = keyword_check(validator, value, instance, schema)
        if errors:
            yield from errors

    check.__name__ = getattr(keyword_check, "__name__", "check")
    return check


def _budgeted_validator(base: type) -> type:
    keywords = dict(base.VALIDATORS)
    keywords.update({k: v for k, v in _OVERRIDES.items() if k in keywords or k == "unevaluatedProperties"})
    if base is jsonschema.Draft7Validator:
        keywords.pop("unevaluatedProperties", None)
    return jsonschema.validators.extend(base, {k: _charged(v) for k, v in keywords.items()})


VALIDATORS = {dialect: _budgeted_validator(base) for dialect, base in BASE_VALIDATORS.items()}


def _refuse(uri: str) -> Any:
    raise referencing.exceptions.NoSuchResource(ref=uri)


#: A registry that never retrieves anything.
OFFLINE_REGISTRY = referencing.Registry(retrieve=_refuse)


@attrs.define
class ToolValidator:
    """The validator of one tool, built once per request."""

    tool: CompiledTool
    validator: Any

    @classmethod
    def build(cls, tool: CompiledTool) -> "ToolValidator":
        return cls(tool, VALIDATORS[tool.dialect](tool.schema, registry=OFFLINE_REGISTRY))

    def first_error(self, arguments: dict) -> str | None:
        """``None`` when ``arguments`` is valid, else a description of the first
        error. Budgets of the current :func:`validation_run` apply."""
        try:
            error = next(self.validator.iter_errors(arguments), None)
        except RecursionError:
            raise BudgetExhausted("the arguments nest too deeply to validate") from None
        except referencing.exceptions.Unresolvable as exc:
            return f"unresolvable reference {exc}"
        if error is None:
            return None
        where = "/".join(str(part) for part in error.absolute_path) or "(arguments)"
        return f"at {where}: {error.message}"
