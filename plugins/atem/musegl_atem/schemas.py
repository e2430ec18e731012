"""Preflight: check and compile the active tools' schemas before generation.

Every active tool's
``function.parameters`` goes through :func:`compile_tools`, which raises
:class:`~musegl_core.errors.ApiError` 400 ``invalid_tool_schema`` for

* a dialect other than Draft 7, 2019-09 or 2020-12 (no ``$schema``: 2020-12);
* ``$id``/``$schema`` in a subschema, dynamic or recursive references, a
  ``$ref`` to another document, a local reference that does not resolve;
* a schema that its dialect's metaschema rejects (checked without any format
  checker, so patterns are never compiled with Python's ``re``), or tuple
  ``items`` outside Draft 7;
* a ``pattern``/``patternProperties`` key that the ``regex`` package cannot
  compile;
* more than :data:`MAX_ALTERNATIVES` object alternatives, more than
  :data:`MAX_EXPANDED_NODES` expanded nodes, nesting deeper than
  :data:`MAX_SCHEMA_DEPTH`, a ``$ref`` chain through more than
  :data:`MAX_REFERENCE_HOPS` definitions, or, over all tools together, more than
  :data:`MAX_PREFLIGHT_VISITS` preflight visits.

The structural limits are checked before the metaschema and the regex
compiler see a schema, so hostile schemas fail in milliseconds; the
metaschema check itself runs on predicates compiled from the metaschemas
(:mod:`musegl_atem.metaschema`), a few microseconds per node in every
dialect, so any schema within the limits is checked in a fraction of a
second.
"""

from __future__ import annotations

import json
from typing import Any, Iterator
from urllib.parse import unquote, urldefrag, urljoin

import attrs
import regex
from jsonschema_specifications import REGISTRY as SPECIFICATIONS

from musegl_core.errors import ApiError

from musegl_atem.dialects import BASE_VALIDATORS, DIALECT_URIS, DRAFT7, DRAFT202012
from musegl_atem.metaschema import FAST_METASCHEMAS

#: Object alternatives one tool may have (more are rejected).
MAX_ALTERNATIVES = 1023
#: Subschemas of one tool with every local ``$ref`` inlined.
MAX_EXPANDED_NODES = 4096
#: Preflight visits over all active tools of a request.
MAX_PREFLIGHT_VISITS = 65_536
#: Nesting of subschemas and of combinators while expanding alternatives
#: [decision]: deep enough for any real tool, shallow enough that the
#: metaschema check and the validators never exhaust Python's stack.
MAX_SCHEMA_DEPTH = 64
#: Definitions one chain of ``$ref`` may pass through while expanding alternatives (each a
#: Python frame there, with the nesting's: well under the interpreter's limit).
MAX_REFERENCE_HOPS = 256

_FORBIDDEN = ("$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor")
#: Keywords whose value is one subschema.
_ONE = (
    "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
    "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema", "items",
)
#: Keywords whose value is a list of subschemas.
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
#: Keywords whose value maps names to subschemas.
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")

DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class SchemaRejected(Exception):
    """A tool schema fails preflight; the message is client-facing."""


def _shallow(node: dict) -> dict:
    """``node`` without its immediate subschemas (each gets its own check):
    what the metaschema says about this node alone. Non-schema values stay,
    so a wrongly typed keyword is still reported; an empty list of
    subschemas stays for the same reason."""
    copy = {}
    for key, value in node.items():
        if key in _KEYS:
            if isinstance(value, (dict, bool)) and key in _ONE:
                continue
            if isinstance(value, list) and key in _LIST and value:
                value = [item for item in value if not isinstance(item, (dict, bool))]
                if not value:
                    continue
            elif isinstance(value, dict) and key in _MAP:
                value = {k: v for k, v in value.items() if not isinstance(v, (dict, bool))}
        copy[key] = value
    return copy


def check_metaschema(tool: "CompiledTool") -> None:
    """Validate every subschema against its dialect's metaschema,
    without a format checker (so patterns are not compiled with ``re``).

    Each node is checked on its own with its subschemas removed (they get
    their own check), and identical nodes are checked once: linear in the
    schema. Nodes go through the metaschema compiled to plain predicates
    (:mod:`musegl_atem.metaschema`, a few microseconds a node in every
    dialect); jsonschema itself only describes a node the predicate
    rejects (and decides alone for a dialect that could not be compiled).
    Only the bundled metaschemas are used; nothing is ever retrieved.
    """
    cls = BASE_VALIDATORS[tool.dialect]
    fast = FAST_METASCHEMAS.get(cls)
    metaschema = None
    seen: set[str] = set()
    for node, path in tool.nodes:
        shallow = _shallow(node) if isinstance(node, dict) else node
        key = json.dumps(shallow, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        try:
            if fast is not None and fast(shallow):
                continue
            if metaschema is None:
                metaschema = cls(cls.META_SCHEMA, registry=SPECIFICATIONS)
            error = next(metaschema.iter_errors(shallow), None)
        except RecursionError:
            raise SchemaRejected(f"at {'/'.join(map(str, path)) or '(root)'}: a keyword value nests too deeply") from None
        if error is not None:
            where = "/".join(str(part) for part in (*path, *error.absolute_path)) or "(root)"
            raise SchemaRejected(f"at {where}: {error.message}")


def invalid_tool_schema(message: str, index: int | None = None) -> ApiError:
    """The 400 ``invalid_tool_schema`` error."""
    param = "tools" if index is None else f"tools[{index}].function.parameters"
    return ApiError(400, message, "invalid_request_error", "invalid_tool_schema", param)


def dialect_of(schema: Any) -> str:
    """The dialect a root schema declares."""
    if not isinstance(schema, dict) or "$schema" not in schema:
        return DRAFT202012
    uri = schema["$schema"]
    if not isinstance(uri, str):
        raise SchemaRejected("'$schema' must be a string")
    dialect = DIALECT_URIS.get(uri[:-1] if uri.endswith("#") else uri)
    if dialect is None:
        raise SchemaRejected(
            f"unsupported $schema {uri!r}: use Draft 7, 2019-09 or 2020-12 (Draft 3, 4 and 6 are not accepted)"
        )
    return dialect


_KEYS = frozenset(_ONE) | frozenset(_LIST) | frozenset(_MAP)


def _children(node: dict) -> Iterator[tuple[Any, tuple]]:
    """The immediate subschemas of a schema object (data keywords excluded),
    each with its path below ``node``."""
    for key, value in node.items():
        if key not in _KEYS:
            continue
        if isinstance(value, (dict, bool)) and key in _ONE:
            yield value, (key,)
        elif isinstance(value, list) and key in _LIST:
            yield from ((item, (key, i)) for i, item in enumerate(value) if isinstance(item, (dict, bool)))
        elif isinstance(value, dict) and key in _MAP:
            yield from ((item, (key, name)) for name, item in value.items() if isinstance(item, (dict, bool)))


def subschemas(node: dict) -> Iterator[Any]:
    """The immediate subschemas of a schema object (data keywords excluded)."""
    return (child for child, _ in _children(node))


@attrs.define
class References:
    """Resolves the local references of one document."""

    root: Any
    base: str = ""
    anchors: dict[str, Any] = attrs.field(factory=dict)

    def resolve(self, ref: Any) -> Any:
        """The subschema ``ref`` points to; raises :class:`SchemaRejected`."""
        if not isinstance(ref, str):
            raise SchemaRejected("'$ref' must be a string")
        target, fragment = urldefrag(urljoin(self.base, ref) if self.base else ref)
        if target != self.base:
            raise SchemaRejected(f"external reference {ref!r}: only references inside the tool's schema are allowed")
        fragment = unquote(fragment)
        if not fragment:
            return self.root
        if not fragment.startswith("/"):
            if fragment in self.anchors:
                return self.anchors[fragment]
            raise SchemaRejected(f"reference {ref!r} names no $anchor of the schema")
        node = self.root
        for token in fragment[1:].split("/"):
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                raise SchemaRejected(f"reference {ref!r} does not resolve inside the tool's schema")
        if not isinstance(node, (dict, bool)):
            raise SchemaRejected(f"reference {ref!r} does not point to a schema")
        return node


@attrs.frozen
class CompiledTool:
    """One tool's schema after preflight: what validation and coercion need."""

    name: str
    schema: Any
    dialect: str
    references: References
    #: Each object alternative: the subschemas that contribute properties.
    alternatives: tuple[tuple[dict, ...], ...]
    #: ``pattern`` and ``patternProperties`` sources, compiled with ``regex``.
    patterns: dict[str, Any]
    expanded_nodes: int
    visits: int
    #: Every subschema of the document with its path (for the metaschema check).
    nodes: tuple[tuple[Any, tuple], ...] = ()


def _walk(schema: Any, dialect: str) -> tuple[References, dict[str, Any], list[tuple[Any, tuple]]]:
    """Structural checks over the document (iterative); returns its references
    and compiled patterns."""
    base = ""
    if isinstance(schema, dict) and "$id" in schema:
        if not isinstance(schema["$id"], str):
            raise SchemaRejected("'$id' must be a string")
        base = urldefrag(schema["$id"])[0]
    references = References(schema, base)
    patterns: dict[str, Any] = {}
    refs: list[Any] = []
    nodes: list[tuple[Any, tuple]] = []
    stack: list[tuple[Any, tuple, int]] = [(schema, (), 0)]
    count = 0
    while stack:
        node, path, depth = stack.pop()
        nodes.append((node, path))
        count += 1
        if count > MAX_EXPANDED_NODES:
            raise SchemaRejected(f"the schema has more than {MAX_EXPANDED_NODES} subschemas")
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaRejected(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if not isinstance(node, dict):
            continue
        if depth:
            for key in ("$id", "$schema"):
                if key in node:
                    raise SchemaRejected(f"'{key}' is only allowed at the root of a tool schema")
        for key in _FORBIDDEN:
            if key in node:
                raise SchemaRejected(f"'{key}' is not supported (dynamic and recursive references are rejected)")
        if "$ref" in node:
            refs.append(node["$ref"])
        anchor = node.get("$anchor")
        if isinstance(anchor, str) and dialect != DRAFT7:
            references.anchors[anchor] = node
        if isinstance(node.get("items"), list) and dialect != DRAFT7:
            raise SchemaRejected("tuple-form 'items' (an array) needs an explicit Draft 7 '$schema'; use 'prefixItems'")
        sources = []
        if isinstance(node.get("pattern"), str):
            sources.append(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            sources.extend(node["patternProperties"])
        for source in sources:
            if source not in patterns:
                try:
                    patterns[source] = regex.compile(source)
                except (regex.error, ValueError, OverflowError) as exc:
                    raise SchemaRejected(f"pattern {source!r} does not compile: {exc}") from None
        stack.extend((child, path + where, depth + 1) for child, where in _children(node))
    for ref in refs:
        references.resolve(ref)
    return references, patterns, nodes


#: Keywords that only hold definitions: a definition is expanded where a ``$ref`` reaches it, not here.
_DEFINITIONS = ("$defs", "definitions")


def count_expanded(schema: Any, references: References) -> int:
    """Subschemas with every local ``$ref`` inlined (a reference back into its
    own expansion counts once), from the root: a definition counts where a
    reference inlines it, not also in ``$defs`` (a linear chain of 91
    definitions is 92 nodes, not the 4,186 of every definition's own chain);
    stops just past the limit."""
    count = 0
    stack: list[tuple[Any, frozenset[int]]] = [(schema, frozenset())]
    while stack:
        node, inlined = stack.pop()
        count += 1
        if count > MAX_EXPANDED_NODES:
            raise SchemaRejected(
                f"the schema expands to more than {MAX_EXPANDED_NODES} subschemas once its references are inlined"
            )
        if not isinstance(node, dict):
            continue
        stack.extend((child, inlined) for child, where in _children(node) if where[0] not in _DEFINITIONS)
        if "$ref" in node:
            target = references.resolve(node["$ref"])
            if id(target) not in inlined:
                stack.append((target, inlined | {id(target)}))
    return count


def _product(left: list[tuple], right: list[tuple]) -> list[tuple]:
    if len(left) * len(right) > MAX_ALTERNATIVES:
        raise SchemaRejected(f"the schema has more than {MAX_ALTERNATIVES} object alternatives")
    return [a + b for a in left for b in right]


def object_alternatives(schema: Any, references: References) -> list[tuple[dict, ...]]:
    """Expand the root into its object alternatives:
    ``$ref`` is replaced by its target, ``allOf`` multiplies, ``anyOf``/``oneOf``
    add, ``if``/``then``/``else`` gives two branches."""

    def expand(node: Any, inlined: frozenset[int], depth: int) -> list[tuple]:
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaRejected(f"the schema's combinators nest deeper than {MAX_SCHEMA_DEPTH} levels")
        if len(inlined) > MAX_REFERENCE_HOPS:
            raise SchemaRejected(f"the schema's references chain more than {MAX_REFERENCE_HOPS} definitions")
        if not isinstance(node, dict):
            return [()]
        alternatives: list[tuple] = [(node,)]
        if "$ref" in node:  # a hop along a chain of definitions, not a level of nesting
            target = references.resolve(node["$ref"])
            if id(target) not in inlined:
                alternatives = _product(alternatives, expand(target, inlined | {id(target)}, depth))
        for member in node.get("allOf") or ():
            alternatives = _product(alternatives, expand(member, inlined, depth + 1))
        for key in ("anyOf", "oneOf"):
            members = node.get(key)
            if isinstance(members, list) and members:
                union: list[tuple] = []
                for member in members:
                    union += expand(member, inlined, depth + 1)
                    if len(union) > MAX_ALTERNATIVES:
                        raise SchemaRejected(f"the schema has more than {MAX_ALTERNATIVES} object alternatives")
                alternatives = _product(alternatives, union)
        if "if" in node:
            taken = expand(node["if"], inlined, depth + 1)
            if "then" in node:
                taken = _product(taken, expand(node["then"], inlined, depth + 1))
            other = expand(node["else"], inlined, depth + 1) if "else" in node else [()]
            alternatives = _product(alternatives, taken + other)
        return alternatives

    result = []
    for alternative in expand(schema, frozenset(), 0):
        unique = tuple({id(s): s for s in alternative}.values())
        result.append(unique)
    return result


def declared_parameters(subschema: dict) -> int:
    """Properties, pattern properties and the additionalProperties projection."""
    count = 0
    for key in ("properties", "patternProperties"):
        if isinstance(subschema.get(key), dict):
            count += len(subschema[key])
    if "additionalProperties" in subschema:
        count += 1
    return count


def compile_tool(name: str, parameters: Any, visits_left: int) -> CompiledTool:
    """Preflight one tool's schema; raises :class:`SchemaRejected`."""
    schema = DEFAULT_PARAMETERS if parameters is None else parameters
    if not isinstance(schema, (dict, bool)):
        raise SchemaRejected("'parameters' must be a JSON Schema object")
    dialect = dialect_of(schema)
    references, patterns, nodes = _walk(schema, dialect)
    expanded = count_expanded(schema, references)
    alternatives = object_alternatives(schema, references)
    visits = 0
    for alternative in alternatives:
        visits += 1 + sum(declared_parameters(s) for s in alternative)
        if visits > visits_left:
            raise SchemaRejected(
                f"checking the tools' parameters needs more than {MAX_PREFLIGHT_VISITS} preflight visits "
                "across all tools of the request"
            )
    return CompiledTool(name, schema, dialect, references, tuple(alternatives), patterns, expanded, visits, tuple(nodes))


def compile_tools(tools: list[Any]) -> list[CompiledTool]:
    """Preflight every active tool (``ToolDef`` objects); raises ApiError 400.

    The preflight-visit budget is shared by all tools. Structural
    checks of every tool run before any metaschema check, so an oversized
    request is refused without compiling anything.
    """
    compiled = []
    visits_left = MAX_PREFLIGHT_VISITS
    for index, tool in enumerate(tools):
        try:
            tool_schema = compile_tool(tool.name, tool.parameters, visits_left)
        except SchemaRejected as exc:
            raise invalid_tool_schema(f"Tool {tool.name!r} has an invalid parameters schema: {exc}", index) from None
        visits_left -= tool_schema.visits
        compiled.append(tool_schema)
    for index, tool_schema in enumerate(compiled):
        try:
            check_metaschema(tool_schema)
        except SchemaRejected as exc:
            raise invalid_tool_schema(f"Tool {tool_schema.name!r} has an invalid parameters schema: {exc}", index) from None
    return compiled
