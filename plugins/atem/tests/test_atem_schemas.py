"""Preflight checks of tool schemas: dialects, references, metaschema, limits."""

from __future__ import annotations

import gc
import time
from unittest import mock

import pytest

from musegl_core.chat.messages import ToolDef

from musegl_atem import schemas

from atem_support import args, schema_error

D7 = "http://json-schema.org/draft-07/schema#"
D2019 = "https://json-schema.org/draft/2019-09/schema"
D2020 = "https://json-schema.org/draft/2020-12/schema"


def tool(parameters, name="t"):
    return ToolDef(name, parameters=parameters)


def props(n, extra=None):
    return {"type": "object", "properties": {f"p{i}": dict(extra or {"type": "string"}) for i in range(n)}}


def rejected(parameters) -> bool:
    error = schema_error([tool(parameters)])
    return error is not None and error.status == 400 and error.code == "invalid_tool_schema"


def test_tv01_every_active_tool_is_checked_even_if_never_called():
    error = schema_error([tool(props(1), "a"), tool({"$schema": "http://json-schema.org/draft-04/schema#"}, "b")])
    assert error.status == 400 and error.code == "invalid_tool_schema" and error.param == "tools[1].function.parameters"


def test_tv03_missing_parameters_mean_an_empty_object_schema():
    assert schema_error([ToolDef("t", parameters=None)]) is None
    assert args(ToolDef("t"), []) == {}


def test_tv04_validators_never_fetch(monkeypatch):
    import urllib.request

    monkeypatch.setattr(urllib.request, "urlopen", mock.Mock(side_effect=AssertionError("network")))
    assert rejected({"type": "object", "properties": {"x": {"$ref": "https://example.com/unit.json"}}})


@pytest.mark.parametrize("uri", [None, D7, D7[:-1], D2019, D2019 + "#", D2020, D2020 + "#"])
def test_tv05_tv06_accepted_dialects(uri):
    schema = props(2)
    if uri:
        schema["$schema"] = uri
    assert schema_error([tool(schema)]) is None


def test_tv05_default_dialect_is_2020_12():
    assert schemas.dialect_of({}) == schemas.DRAFT202012


@pytest.mark.parametrize(
    "uri",
    [
        "http://json-schema.org/draft-03/schema#",
        "http://json-schema.org/draft-04/schema#",
        "http://json-schema.org/draft-06/schema#",
        "https://example.com/my-dialect",
    ],
)
def test_tv07_other_dialects_are_rejected(uri):
    assert rejected({"$schema": uri, "type": "object"})


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"x": {"type": "string", "required": True}}},
        {"type": "object", "properties": {"x": {"type": "strng"}}},
        {"type": "object", "properties": {"x": {"type": "array", "items": [{}, {}]}}},
        {"$schema": D2019, "type": "object", "properties": {"x": {"items": [{}, {}]}}},
        {"type": "object", "properties": {"x": {"minimum": 1, "exclusiveMinimum": True}}},
        {"$schema": D7, "type": "object", "properties": {"x": {"minimum": 1, "exclusiveMinimum": True}}},
        {"allOf": []},
    ],
    ids=["required-true", "strng", "tuple-2020", "tuple-2019", "bool-exclusive-2020", "bool-exclusive-d7", "empty-allOf"],
)
def test_tv08_metaschema_violations_are_rejected(parameters):
    assert rejected(parameters)


def test_tv08_draft7_tuple_items_are_validated_positionally():
    t = tool({"$schema": D7, "type": "object", "properties": {"p": {"type": "array", "items": [{"type": "integer"}, {"type": "string"}]}}})
    assert args(t, [("p", '[1, "a"]')]) == {"p": [1, "a"]}
    assert args(t, [("p", '["a", 1]')]).code == "invalid_tool_output"


def test_tv09_tv20_patterns_use_the_regex_package():
    schema = {"type": "object", "properties": {"u": {"type": "string", "pattern": r"^\p{Lu}"}, "y": {"type": "string", "pattern": r"(?<year>\d{4})"}}}
    assert schema_error([tool(schema)]) is None
    assert args(tool(schema), [("u", "Ölfass"), ("y", "in 2024")]) == {"u": "Ölfass", "y": "in 2024"}
    assert rejected({"type": "object", "properties": {"x": {"pattern": "(unclosed"}}})


def test_tv10_unknown_formats_are_annotations():
    t = tool({"type": "object", "properties": {"x": {"type": "string", "format": "made-up"}}})
    assert schema_error([t]) is None and args(t, [("x", "anything")]) == {"x": "anything"}


@pytest.mark.parametrize("ref", ["#", "#/$defs/X", "#/definitions/X", "#/properties/a/items"])
def test_tv11_local_json_pointer_references(ref):
    schema = {
        "type": "object",
        "$defs": {"X": {"type": "integer"}},
        "definitions": {"X": {"type": "integer"}},
        "properties": {"a": {"type": "array", "items": {"type": "integer"}}, "r": {"$ref": ref}},
    }
    assert schema_error([tool(schema)]) is None


def test_tv12_root_id_plus_fragment_is_local():
    schema = {"$id": "https://example.com/tool.json", "type": "object", "$defs": {"N": {"type": "integer"}},
              "properties": {"n": {"$ref": "https://example.com/tool.json#/$defs/N"}, "m": {"$ref": "#/$defs/N"}}}
    assert args(tool(schema), [("n", "+3"), ("m", "4")]) == {"n": 3, "m": 4}


@pytest.mark.parametrize(
    "sub",
    [
        {"$ref": "https://example.com/unit.json"},
        {"$ref": "unit.json#/U"},
        {"$id": "nested"},
        {"$schema": D7},
        {"$dynamicRef": "#meta"},
        {"$dynamicAnchor": "meta"},
        {"$recursiveRef": "#"},
        {"$recursiveAnchor": True},
    ],
)
def test_tv13_external_nested_and_dynamic_references_are_rejected(sub):
    assert rejected({"type": "object", "properties": {"x": sub}})


def test_tv14_unresolved_local_reference_is_rejected():
    assert rejected({"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}})


def test_tv15_object_alternatives_limit():
    branch = lambda i: {"type": "object", "properties": {f"k{i}": {"type": "string"}}}  # noqa: E731
    assert rejected({"anyOf": [branch(i) for i in range(1024)]})
    assert not rejected({"anyOf": [branch(i) for i in range(1023)]})
    assert rejected({"allOf": [{"anyOf": [{"type": "object"}, {"required": ["a"]}]} for _ in range(10)]})


def test_tv16_expanded_node_limit():
    assert rejected(props(5000))
    assert not rejected(props(3000))
    inlined = {"type": "object", "$defs": {"D": props(100)}, "properties": {f"p{i}": {"$ref": "#/$defs/D"} for i in range(60)}}
    assert rejected(inlined)


def test_tv17_shared_preflight_visit_budget():
    many = [tool(props(3500), f"t{i}") for i in range(20)]
    error = schema_error(many)
    assert error is not None and error.code == "invalid_tool_schema"
    assert schema_error(many[:1]) is None


def test_tv18_hostile_schemas_fail_fast():
    deep = {"type": "object"}
    for _ in range(100_000):
        deep = {"properties": {"a": deep}}
    hostile = [
        deep,
        props(200_000),
        {"anyOf": [{"anyOf": [{"type": "object"}] * 40}] * 40},
        {"allOf": [{"anyOf": [{}, {}]}] * 500},
        {"type": "object", "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "properties": {"x": {"$ref": "#/$defs/A"}}},
    ]
    for schema in hostile:
        # CPU time of this process: the bound is about the work preflight does, not about
        # how busy the machine is (wall time on a shared 2-core CI machine varies 10x). Still,
        # a busy sibling hyperthread and the collector walking a full run's heap inflate it:
        # the widest case (200,000 properties) takes 0.1-0.4 s of CPU alone and took 1.1 s late
        # in a CI run, so the bound is 2 s, with the collector paused. Without preflight's
        # limits these schemas take minutes.
        gc.collect()
        gc.disable()
        try:
            started = time.process_time()
            schema_error([tool(schema)])
            spent = time.process_time() - started
        finally:
            gc.enable()
        assert spent < 2.0


def test_tv08_tv18_compiled_metaschemas_agree_with_jsonschema():
    """The fast metaschema predicates (musegl_atem.metaschema) are compiled
    for all three dialects and accept exactly what jsonschema accepts, on
    valid nodes with random mutations (shallow, as preflight checks them)."""
    import json
    import random

    from jsonschema_specifications import REGISTRY

    from musegl_atem.metaschema import FAST_METASCHEMAS
    from musegl_atem.validate import BASE_VALIDATORS

    assert set(FAST_METASCHEMAS) == set(BASE_VALIDATORS.values())
    rng = random.Random(18)
    keywords = sorted({k for uri in REGISTRY for k in (REGISTRY.contents(uri) or {}).get("properties", {})} | {"x-extra"})
    scalars = [None, True, False, 0, 1, -1, 1.0, 1.5, -0.5, 2**70, "", "a", "string", "integer", "null", "array", "any", "#", "#/a", "_x", "a b", "^a$"]

    def value(depth=0):
        r = rng.random()
        if depth > 2 or r < 0.5:
            return rng.choice(scalars)
        if r < 0.75:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(keywords + ["a", "b"]): value(depth + 1) for _ in range(rng.randint(0, 3))}

    base = [
        {"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": False, "minProperties": 1, "propertyNames": {}},
        {"type": ["string", "null"], "minLength": 0, "maxLength": 9, "pattern": "^x", "format": "email", "enum": ["a", None], "const": "a", "default": 1, "examples": []},
        {"type": "array", "items": {}, "minItems": 1, "maxItems": 2, "uniqueItems": True, "contains": {}, "minContains": 1, "prefixItems": [{}], "additionalItems": True},
        {"type": "number", "minimum": 0, "maximum": 1.5, "exclusiveMinimum": -1, "exclusiveMaximum": 2, "multipleOf": 0.5},
        {"$ref": "#/$defs/a", "$defs": {"a": {}}, "definitions": {}, "$anchor": "x", "$comment": "c", "deprecated": False, "readOnly": True},
        {"dependentRequired": {"a": ["b"]}, "dependentSchemas": {}, "dependencies": {"a": ["b"]}, "if": {}, "then": {}, "not": {}, "anyOf": [{}]},
        {"contentMediaType": "text/plain", "contentEncoding": "base64", "unevaluatedProperties": {}, "patternProperties": {}, "$vocabulary": {"urn:x": True}},
        {"$recursiveAnchor": True, "$recursiveRef": "#", "$dynamicAnchor": "meta", "$dynamicRef": "#meta"},
    ]
    counts = {True: 0, False: 0}
    for cls, fast in FAST_METASCHEMAS.items():
        slow = cls(cls.META_SCHEMA, registry=REGISTRY)
        assert fast(True) and fast(False) and not fast(5)
        for _ in range(1500):
            node = json.loads(json.dumps(rng.choice(base)))
            for _ in range(rng.randint(0, 2)):
                key = rng.choice(list(node) + keywords)
                if rng.random() < 0.2:
                    node.pop(key, None)
                else:
                    node[key] = value()
            node = schemas._shallow(node)
            expected = slow.is_valid(node)
            counts[expected] += 1
            assert fast(node) is expected, (cls.__name__, node)
    assert min(counts.values()) > 500  # both outcomes are exercised


def test_tv51_alias_collisions_are_rejected():
    from musegl_core.chat.tools import tool_aliases
    from musegl_core.errors import ApiError

    for names in (["x", "x.x"], ["f", "f"]):
        with pytest.raises(ApiError) as info:
            tool_aliases(names)
        assert info.value.status == 400 and info.value.code == "invalid_tool_schema"


def test_a_tool_set_is_compiled_once_and_kept_for_the_next_turns():
    """Agents declare the same tools every turn: the second prepare of an equal set is the first's
    compiled result; any changed field compiles anew; a set that fails preflight is not kept."""
    from musegl_core.errors import ApiError
    from musegl_atem import calls

    def tools(description="Reads a file."):
        return [ToolDef("Read", description, {"type": "object", "properties": {"path": {"type": "string"}},
                                              "required": ["path"]}),
                ToolDef("Bash", "Runs a command.", {"type": "object", "properties": {"cmd": {"type": "string"}}})]

    first = calls.prepare(tools())
    assert calls.prepare(tools()) is first
    assert calls.prepare(tools("Reads a file, in full.")) is not first
    with mock.patch.object(calls, "compile_tools", wraps=calls.compile_tools) as compiled:
        calls.prepare(tools())
        assert compiled.call_count == 0
    bad = [ToolDef("Read", "x", {"type": "object", "properties": {"path": {"type": "no-such-type"}}})]
    for _ in range(2):
        with pytest.raises(ApiError):
            calls.prepare(bad)
    assert calls._tools_key(bad) not in calls._kept
    for n in range(calls.PREPARED_KEPT + 5):
        calls.prepare(tools(f"variant {n}"))
    assert len(calls._kept) == calls.PREPARED_KEPT
