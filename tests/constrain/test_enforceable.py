"""Every constraint is enforced or refused (issue 25 item 7): schemas
llguidance compiles but cannot enforce are 400s before generation, and a
matcher that fails during generation fails the request instead of letting
free text through. The HTTP 400s need no model (the front refuses them)."""

from __future__ import annotations

import jsonschema
import numpy as np
import pytest
from litestar.testing import TestClient

from musegl_core.config import ServeConfig
from musegl_core.constrain import grammar as g
from musegl_core.constrain.enforceable import MAX_FORCED_LENGTH, forced_length, unenforceable
from musegl_core.constrain.matcher import compile_grammar
from musegl_core.engine.errors import ConstraintFailed, constraint_failure
from musegl_core.http.app import create_app
from musegl_core.plugins.manager import PluginManager
from musegl_core.tiny import default_model_path
from musegl_core.tokenizer import MuseTokenizer
from musegl_core.worker.client import WorkerClient

LONG_PATTERN = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a{100000}$"}},
                "required": ["s"]}
SELF_REQUIRED = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
SELF_LOOP = {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}


# -- the schema checks --------------------------------------------------------------------------
@pytest.mark.parametrize("schema", [
    SELF_REQUIRED,
    SELF_LOOP,
    {"allOf": [{"$ref": "#"}]},
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
     "required": ["kids"]},
    {"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}]}},
                        "required": ["next"]}}, "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"$ref": "#/properties/a"}},
                                            "required": ["b"]}}, "required": ["a"]},
])
def test_schemas_without_a_finite_instance_are_named(schema):
    assert "no finite instance" in unenforceable(schema)


@pytest.mark.parametrize("schema", [
    {"properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # no "type": "" and 0 are instances
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    {"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                           {"type": "null"}]}},
                        "required": ["next"]}}, "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"x": {"$ref": "#"}}},  # optional: {} is an instance
    {"type": "object", "properties": {"x": {"$ref": "#", "const": 1}}, "required": ["x"]},
    {"type": "string", "pattern": "^[0-9a-f]{64}$"},
    {"type": "string", "pattern": "^[a-z]{1,100000}$"},  # forces one character
    {"type": "string", "pattern": r"^\{100000\}$"},  # an escaped brace is a literal
])
def test_enforceable_schemas_pass(schema):
    assert unenforceable(schema) is None


def test_the_no_type_self_reference_really_has_finite_instances():
    for instance in ("", 0, [], {"x": ""}):
        jsonschema.validate(instance, {"properties": {"x": {"$ref": "#"}}, "required": ["x"]})


@pytest.mark.parametrize("pattern, forced", [
    ("^a{100000}$", 100000), ("^((a{100}){100}){10}$", 100000), ("^a{20000}b{20000}$", 40000),
    ("^(a{3}|b{7})c$", 8), ("^(?:ab){10,20}$", 20), ("a*b+c?", 1), ("[{]{5}", 5), (r"\d{7}", 7),
])
def test_forced_length(pattern, forced):
    assert forced_length(pattern) == forced


def test_a_long_forced_pattern_is_named_with_the_budget():
    reason = unenforceable(LONG_PATTERN)
    assert "100000" in reason and str(MAX_FORCED_LENGTH) in reason


# -- through the front: 400 with param, no model needed -------------------------------------------
@pytest.fixture(scope="module")
def client():
    config = ServeConfig(max_image_bytes=1024, max_request_bytes=1 << 20, tool_parser="atem").validate()
    app = create_app(config, PluginManager(only=["atem"]), WorkerClient(config), manage_worker=False)
    with TestClient(app) as c:
        yield c


def chat(client, **fields):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, **fields}
    return client.post("/v1/chat/completions", json=body)


def refused(response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_schema" and error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("schema", [LONG_PATTERN, SELF_REQUIRED, SELF_LOOP])
def test_response_format_schemas_it_cannot_enforce_are_400(client, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    refused(chat(client, response_format=fmt), "response_format.json_schema.schema")
    refused(chat(client, json_schema=schema), "json_schema")


def weather(parameters, strict=None):
    function = {"name": "get_weather", "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    return [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
            {"type": "function", "function": function}]


UNENFORCEABLE_PARAMETERS = [
    {"type": "object", "properties": {"p": {"$ref": "#"}}, "required": ["p"]},
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "string", "pattern": "^a{50000}$"},
                                              "minItems": 1}}, "required": ["ids"]},
]


@pytest.mark.parametrize("parameters", UNENFORCEABLE_PARAMETERS)
def test_tool_schemas_under_a_call_grammar_go_through_the_same_rule(client, parameters):
    param = "tools[1].function.parameters"
    refused(chat(client, tools=weather(parameters, strict=True)), param)  # strict under "auto": lazy grammar
    refused(chat(client, tools=weather(parameters), tool_choice="required"), param)
    refused(chat(client, tools=weather(parameters),
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}), param)


def test_a_tool_no_grammar_constrains_is_left_to_validation(client):
    parameters = UNENFORCEABLE_PARAMETERS[0]
    response = chat(client, tools=weather(parameters))  # "auto", not strict: validated after generation
    assert response.status_code == 503  # it passed the front; the worker is not running
    # a forced call to the other tool does not involve it either
    response = chat(client, tools=weather(parameters), tool_choice={"type": "function", "function": {"name": "ok"}})
    assert response.status_code == 503


# -- at run time: a failed matcher fails the request --------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return MuseTokenizer.load(default_model_path())


def allowed_ids(mask) -> np.ndarray:
    return np.nonzero(np.unpackbits(np.asarray(mask, dtype=np.uint32).view(np.uint8), bitorder="little"))[0]


def test_a_matcher_that_runs_out_of_budget_reports_a_failure_not_freedom(tokenizer):
    # preflight passes this (no pattern, a finite instance); llguidance's parser gives up at the answer
    schema = {"type": "array", "items": {"const": "a"}, "minItems": 30000}
    assert unenforceable(schema) is None and g.check(g.answer_grammar(schema, 0)) is None
    proc = compile_grammar(g.answer_grammar(schema, 0), tokenizer, tokenizer.vocab_size)
    generated: list[int] = []
    for _ in range(8):
        mask = proc.mask(generated)
        if mask is None:
            break
        generated.append(int(allowed_ids(mask)[-1]))
    assert mask is None and proc.failure
    assert constraint_failure([proc]) == ConstraintFailed(proc.failure)


def test_a_refused_draft_does_not_end_the_constraint(tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    proc = compile_grammar(g.answer_grammar(schema, 0), tokenizer, tokenizer.vocab_size)
    head = tokenizer.encode(' to=user<|message|>{"n": ', special=True)
    digit, letter = tokenizer.encode("7", special=False)[0], tokenizer.encode("x", special=False)[0]
    assert digit in allowed_ids(proc.mask(head))
    # a verify row after a draft the grammar refuses ("x" where a digit must come)
    proc.mask(head + [letter])
    assert proc.failure is None
    # the draft is rejected; the sequence goes on with a digit, still constrained
    mask = proc.mask(head + [digit])
    assert mask is not None and letter not in allowed_ids(mask)
    assert tokenizer.encode("}", special=False)[0] in allowed_ids(mask)
    assert proc.failure is None
