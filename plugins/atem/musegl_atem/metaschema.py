"""Fast metaschema check for preflight (tool-validation.md TV-08, TV-18).

jsonschema validates a schema against the 2019-09 and 2020-12 metaschemas
through their dynamic references (``$recursiveRef``/``$dynamicRef``), which
it resolves by walking the dynamic scope on every use, and it builds a new
validator object for every subschema it descends into: a few hundred
microseconds per node of a tool schema, so a valid 4000-node schema took
seconds. This module compiles each dialect's metaschema once, at import, into
plain Python predicates:

* the metaschema documents are the ones jsonschema itself uses (the
  ``jsonschema_specifications`` registry; nothing is ever retrieved);
* ``$ref`` is resolved statically; ``$dynamicRef: "#meta"`` (2020-12) and
  ``$recursiveRef: "#"`` (2019-09) always end at the dialect's top metaschema
  when validation starts there (the user schema is the *instance*, so its own
  anchors play no part), and are compiled as static references to it;
* assertion keywords (``type``, ``enum``, ``minimum``, ``pattern``,
  ``uniqueItems``, ``format`` without a checker, …) call jsonschema's own
  keyword implementations, so types and equality mean exactly what they mean
  to jsonschema;
* the applicators the metaschemas use (``allOf``, ``anyOf``, ``properties``,
  ``additionalProperties``, ``items``, ``propertyNames``) are implemented
  here with jsonschema's semantics, including Draft 7's "``$ref`` ignores its
  siblings".

A keyword the compiler does not know makes the whole dialect fall back to
jsonschema (fail closed: never a weaker check). The predicate only answers
valid/invalid; the caller asks jsonschema for the message of a node the
predicate rejects, so error messages are unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import jsonschema
import referencing.exceptions
import referencing.jsonschema
from jsonschema_specifications import REGISTRY as SPECIFICATIONS

Check = Callable[[Any], bool]

#: Keywords that assert something about the instance itself; jsonschema's own
#: implementations are called (they never descend).
_ASSERTIONS = frozenset({
    "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "minItems", "maxItems", "uniqueItems", "minProperties",
    "maxProperties", "required", "format",
})


class Unsupported(Exception):
    """The metaschema uses something this compiler does not implement."""


class _Box:
    """Indirection for (recursive) references: filled once compiled."""

    __slots__ = ("check",)

    def __init__(self) -> None:
        self.check: Check = _unfinished

    def __call__(self, instance: Any) -> bool:
        return self.check(instance)


def _unfinished(instance: Any) -> bool:  # pragma: no cover - never called after compile
    raise AssertionError("metaschema predicate used before it was compiled")


def _never(instance: Any) -> bool:
    return False


def _always(instance: Any) -> bool:
    return True


class _Compiler:
    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.keywords = cls.VALIDATORS
        self.applicable = cls._APPLICABLE_VALIDATORS
        self.specification = referencing.jsonschema.specification_with(cls.META_SCHEMA["$schema"])
        #: Only ``is_type`` and ``format_checker`` (None) of it are used.
        self.leaf = cls({}, registry=SPECIFICATIONS)
        self.top_uri = cls.META_SCHEMA["$id"].rstrip("#")
        self.top_resolver = SPECIFICATIONS.resolver(base_uri=self.top_uri)
        self.top = self.top_resolver.lookup(self.top_uri)
        self.memo: dict[int, _Box] = {}
        is_type = cls.TYPE_CHECKER.is_type
        self.is_type = is_type
        self.is_object = lambda value: is_type(value, "object")
        self.is_array = lambda value: is_type(value, "array")

    def build(self) -> Check:
        return self.schema(self.top.contents, self.top.resolver)

    def schema(self, schema: Any, resolver: Any) -> Check:
        """Like jsonschema's ``descend``: booleans, then every applicable keyword."""
        if schema is True:
            return _always
        if schema is False:
            return _never
        if not isinstance(schema, dict):
            raise Unsupported(f"subschema {schema!r}")
        box = self.memo.get(id(schema))
        if box is not None:
            return box
        box = self.memo[id(schema)] = _Box()
        resolver = resolver.in_subresource(self.specification.create_resource(schema))
        checks = []
        for keyword, value in self.applicable(schema):
            if keyword not in self.keywords:
                continue  # an annotation, or unknown: jsonschema ignores it too
            checks.append(self.keyword(keyword, value, schema, resolver))
        checks = tuple(check for check in checks if check is not _always)

        def check(instance: Any) -> bool:
            for one in checks:
                if not one(instance):
                    return False
            return True

        box.check = checks[0] if len(checks) == 1 else check if checks else _always
        return box

    def keyword(self, keyword: str, value: Any, schema: dict, resolver: Any) -> Check:
        if keyword in _ASSERTIONS:
            return self.assertion(keyword, value, schema)
        if keyword == "$ref":
            resolved = resolver.lookup(value)
            return self.schema(resolved.contents, resolved.resolver)
        if keyword == "$dynamicRef" and self.cls is jsonschema.Draft202012Validator:
            return self.dynamic(value, "$dynamicAnchor", value[1:] if isinstance(value, str) else None, resolver)
        if keyword == "$recursiveRef" and self.cls is jsonschema.Draft201909Validator:
            return self.dynamic(value, "$recursiveAnchor", True, resolver)
        if keyword in ("allOf", "anyOf") and isinstance(value, list) and value:
            members = tuple(self.schema(member, resolver) for member in value)
            if keyword == "allOf":
                return lambda instance: all(member(instance) for member in members)
            return lambda instance: any(member(instance) for member in members)
        if keyword == "properties" and isinstance(value, dict):
            named = {name: self.schema(sub, resolver) for name, sub in value.items()}

            def properties(instance: Any) -> bool:
                if not self.is_object(instance):
                    return True
                for name, item in instance.items():
                    member = named.get(name)
                    if member is not None and not member(item):
                        return False
                return True

            return properties
        if keyword == "additionalProperties" and "patternProperties" not in schema:
            declared = schema.get("properties", {})
            if value is True:
                return _always
            if value is False:
                return lambda instance: not self.is_object(instance) or all(name in declared for name in instance)
            extra = self.schema(value, resolver)
            return lambda instance: not self.is_object(instance) or all(
                extra(item) for name, item in instance.items() if name not in declared
            )
        if keyword == "propertyNames":
            names = self.schema(value, resolver)
            return lambda instance: not self.is_object(instance) or all(names(name) for name in instance)
        if keyword == "items" and isinstance(value, (dict, bool)) and "prefixItems" not in schema:
            if value is True:
                return _always
            if value is False:
                return lambda instance: not self.is_array(instance) or not instance
            member = self.schema(value, resolver)
            return lambda instance: not self.is_array(instance) or all(member(item) for item in instance)
        raise Unsupported(f"keyword {keyword!r}: {value!r}")

    def assertion(self, keyword: str, value: Any, schema: dict) -> Check:
        if keyword == "type":
            # jsonschema's ``type``: any of the listed types, per the type
            # checker (an unknown type name would raise there: not compiled).
            types = tuple(value) if isinstance(value, list) else (value,)
            for name in types:
                try:
                    self.is_type(None, name)
                except jsonschema.exceptions.UnknownType:
                    raise Unsupported(f"type {name!r}") from None
            is_type = self.is_type
            if len(types) == 1:
                (name,) = types
                return lambda instance: is_type(instance, name)
            return lambda instance: any(is_type(instance, name) for name in types)
        implementation = self.keywords[keyword]
        leaf = self.leaf
        return lambda instance: next(iter(implementation(leaf, value, instance, schema) or ()), None) is None

    def dynamic(self, value: Any, anchor_keyword: str, anchor: Any, resolver: Any) -> Check:
        """A dynamic/recursive reference whose initial target is a dynamic
        anchor of its resource resolves to the outermost resource of the
        dynamic scope with that anchor: the top metaschema, where checking
        starts (it carries the anchor too)."""
        if not isinstance(value, str) or not value.startswith("#") or "/" in value:
            raise Unsupported(f"dynamic reference {value!r}")
        here = resolver.lookup("#").contents
        if not isinstance(here, dict) or here.get(anchor_keyword) != anchor:
            raise Unsupported(f"dynamic reference {value!r} to a resource without {anchor_keyword}")
        if self.top.contents.get(anchor_keyword) != anchor:
            raise Unsupported(f"top metaschema lacks {anchor_keyword} {anchor!r}")
        return self.schema(self.top.contents, self.top.resolver)


def compile_metaschema(cls: type) -> Check:
    """A predicate equal to ``cls(cls.META_SCHEMA).is_valid``; raises
    :class:`Unsupported` if the metaschema uses anything not implemented."""
    return _Compiler(cls).build()


def _compile_all() -> dict[type, Check]:
    compiled = {}
    for cls in (jsonschema.Draft7Validator, jsonschema.Draft201909Validator, jsonschema.Draft202012Validator):
        try:
            compiled[cls] = compile_metaschema(cls)
        except (Unsupported, referencing.exceptions.Unresolvable):
            pass  # that dialect keeps the (slower) jsonschema check
    return compiled


#: Compiled predicates by jsonschema validator class (absent: not compilable).
FAST_METASCHEMAS = _compile_all()
