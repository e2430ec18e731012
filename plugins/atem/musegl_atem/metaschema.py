"""Fast metaschema check for preflight: a large valid schema is checked in well under a second.

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
    "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "minItems", "maxItems", "uniqueItems", "minProperties",
    "maxProperties", "required", "format",
})


class Unsupported(Exception):
    """The metaschema uses something this compiler does not implement."""


class _Box:
    """Indirection for (recursive) references: filled once compiled."""

    __slots__ = ("check", "parts")

    def __init__(self) -> None:
        self.check: Check = _unfinished
        #: The conjunction the schema compiled to (None while compiling).
        self.parts: list[tuple] | None = None

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
        parts: list[tuple] = []
        for keyword, value in self.applicable(schema):
            if keyword not in self.keywords:
                continue  # an annotation, or unknown: jsonschema ignores it too
            parts += self.keyword(keyword, value, schema, resolver)
        box.parts = parts
        box.check = self.conjunction(parts)
        return box

    @staticmethod
    def parts_of(check: Check) -> list[tuple]:
        """``check`` as conjuncts; a finished schema's are inlined, so an
        ``allOf`` of ``$ref``s becomes one flat conjunction."""
        if check is _always:
            return []
        if isinstance(check, _Box) and check.parts is not None:
            return check.parts
        return [("check", check)]

    def conjunction(self, parts: list[tuple]) -> Check:
        """One predicate for conjuncts (all pure, so order and repetition do
        not matter): identical ``type`` lists are checked once and all
        ``properties`` maps are merged into one pass over the instance."""
        types: list[tuple] = []
        named: dict[str, list[Check]] = {}
        checks: list[Check] = []
        for kind, value in parts:
            if kind == "type":
                if value not in types:
                    types.append(value)
            elif kind == "properties":
                for name, check in value.items():
                    if check is not _always:
                        named.setdefault(name, [])
                        if check not in named[name]:
                            named[name].append(check)
            elif value not in checks:
                checks.append(value)
        is_type = self.is_type
        for names in types:
            if len(names) == 1:
                checks.insert(0, (lambda name: lambda instance: is_type(instance, name))(names[0]))
            else:
                checks.insert(0, (lambda names: lambda instance: any(is_type(instance, n) for n in names))(names))
        if named:
            merged = {name: self.conjunction([("check", c) for c in members]) for name, members in named.items()}
            is_object = self.is_object

            def properties(instance: Any) -> bool:
                if not is_object(instance):
                    return True
                for name, item in instance.items():
                    member = merged.get(name)
                    if member is not None and not member(item):
                        return False
                return True

            checks.append(properties)
        if not checks:
            return _always
        if len(checks) == 1:
            return checks[0]
        checks_tuple = tuple(checks)

        def check(instance: Any) -> bool:
            for one in checks_tuple:
                if not one(instance):
                    return False
            return True

        return check

    def keyword(self, keyword: str, value: Any, schema: dict, resolver: Any) -> list[tuple]:
        """The conjuncts one keyword of a metaschema contributes."""
        if keyword == "type":
            return [("type", self.types(value))]
        if keyword == "properties" and isinstance(value, dict):
            return [("properties", {name: self.schema(sub, resolver) for name, sub in value.items()})]
        if keyword == "$ref":
            resolved = resolver.lookup(value)
            return self.parts_of(self.schema(resolved.contents, resolved.resolver))
        if keyword == "$dynamicRef" and self.cls is jsonschema.Draft202012Validator:
            anchor = value[1:] if isinstance(value, str) else None
            return self.parts_of(self.dynamic(value, "$dynamicAnchor", anchor, resolver))
        if keyword == "$recursiveRef" and self.cls is jsonschema.Draft201909Validator:
            return self.parts_of(self.dynamic(value, "$recursiveAnchor", True, resolver))
        if keyword == "allOf" and isinstance(value, list) and value:
            return [part for member in value for part in self.parts_of(self.schema(member, resolver))]
        return [("check", self.check(keyword, value, schema, resolver))]

    def check(self, keyword: str, value: Any, schema: dict, resolver: Any) -> Check:
        if keyword in _ASSERTIONS:
            return self.assertion(keyword, value, schema)
        if keyword == "anyOf" and isinstance(value, list) and value:
            members = tuple(self.schema(member, resolver) for member in value)
            return lambda instance: any(member(instance) for member in members)
        is_object, is_array = self.is_object, self.is_array
        if keyword == "additionalProperties" and "patternProperties" not in schema:
            declared = schema.get("properties", {})
            if value is True:
                return _always
            if value is False:
                return lambda instance: not is_object(instance) or all(name in declared for name in instance)
            extra = self.schema(value, resolver)
            return lambda instance: not is_object(instance) or all(
                extra(item) for name, item in instance.items() if name not in declared
            )
        if keyword == "propertyNames":
            names = self.schema(value, resolver)
            return lambda instance: not is_object(instance) or all(names(name) for name in instance)
        if keyword == "items" and isinstance(value, (dict, bool)) and "prefixItems" not in schema:
            if value is True:
                return _always
            if value is False:
                return lambda instance: not is_array(instance) or not instance
            member = self.schema(value, resolver)
            return lambda instance: not is_array(instance) or all(member(item) for item in instance)
        raise Unsupported(f"keyword {keyword!r}: {value!r}")

    def types(self, value: Any) -> tuple:
        """jsonschema's ``type``: any of the listed types, per the type
        checker (an unknown type name would raise there: not compiled)."""
        types = tuple(value) if isinstance(value, list) else (value,)
        for name in types:
            try:
                self.is_type(None, name)
            except jsonschema.exceptions.UnknownType:
                raise Unsupported(f"type {name!r}") from None
        return types

    def assertion(self, keyword: str, value: Any, schema: dict) -> Check:
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
        if anchor_keyword == "$recursiveAnchor":
            # 2019-09 stops at the first resource of the scope without the
            # anchor: the top is the answer only if every resource has it.
            family = self.top_uri.rsplit("/", 1)[0] + "/"
            for uri in SPECIFICATIONS:
                contents = SPECIFICATIONS.contents(uri)
                if uri.startswith(family) and isinstance(contents, dict) and contents.get(anchor_keyword) is not True:
                    raise Unsupported(f"{uri} lacks {anchor_keyword}")
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
