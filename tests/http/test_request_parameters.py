"""Parameters other servers accept that musegl used to accept and ignore
(issue 25 item 10): each is honoured or refused with a 400 naming it, on
chat and on ``/v1/completions``. No model: refusals happen before the
worker, and a request that passes meets the worker that is not running (503)."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from musegl_core.config import ServeConfig
from musegl_core.http.app import create_app
from musegl_core.service.stopping import MAX_STOP_TOKEN_IDS
from musegl_core.plugins.manager import PluginManager
from musegl_core.worker.client import WorkerClient

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client():
    config = ServeConfig(max_image_bytes=1024, max_request_bytes=1 << 20, tool_parser="atem").validate()
    app = create_app(config, PluginManager(only=["atem"]), WorkerClient(config), manage_worker=False)
    with TestClient(app) as c:
        yield c


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, **fields})


def complete(client, **fields):
    return client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, **fields})


def refused(response, param: str, code: str | None = "unsupported_parameter") -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


def passes(response) -> None:
    assert response.status_code == 503, response.text  # valid: only the worker is missing


@pytest.mark.parametrize("name, value", [
    ("best_of", 2), ("best_of", "1"), ("echo", True), ("prompt_logprobs", 0), ("prompt_logprobs", 1),
    ("spaces_between_special_tokens", False), ("include_stop_str_in_output", True), ("n_probs", 3),
    ("n_predict", 16), ("no_stop_trim", True), ("separate_reasoning", False), ("stream_reasoning", False),
    ("return_hidden_states", True),
])
def test_chat_refuses_what_it_does_not_honour(client, name, value):
    refused(chat(client, **{name: value}), name)


@pytest.mark.parametrize("name, value", [("best_of", 1), ("echo", False), ("best_of", None), ("n_probs", None),
                                         ("no_stop_trim", False), ("separate_reasoning", True),
                                         ("stream_reasoning", True), ("return_hidden_states", False)])
def test_chat_accepts_the_values_that_change_nothing(client, name, value):
    passes(chat(client, **{name: value}))


@pytest.mark.parametrize("route", [chat, complete])
def test_skip_special_tokens_is_a_boolean(client, route):
    passes(route(client, skip_special_tokens=True))
    passes(route(client, skip_special_tokens=False))
    refused(route(client, skip_special_tokens="yes"), "skip_special_tokens", code=None)


@pytest.mark.parametrize("name, value", [
    ("session_id", ""), ("session_id", "s1"), ("prompt_logprobs", 1),
    ("spaces_between_special_tokens", True), ("include_stop_str_in_output", False), ("n_probs", 2),
    ("n_predict", 4), ("best_of", 3), ("echo", True),
])
def test_completions_refuses_the_same(client, name, value):
    refused(complete(client, **{name: value}), name)


def test_an_empty_session_id_is_not_anonymous(client):
    refused(chat(client, session_id=""), "session_id", code=None)
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES}, headers={"x-session-id": ""})
    refused(response, "X-Session-Id", code=None)


@pytest.mark.parametrize("route", [chat, complete])
def test_stop_token_ids_and_min_tokens_are_checked(client, route):
    passes(route(client, stop_token_ids=[5, 5, 7], min_tokens=4))
    passes(route(client, min_tokens=8))  # up to max_tokens
    refused(route(client, stop_token_ids=[3, -1]), "stop_token_ids[1]", code=None)
    refused(route(client, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids", code=None)
    refused(route(client, stop_token_ids=["5"]), "stop_token_ids[0]", code=None)
    refused(route(client, min_tokens=9), "min_tokens", code=None)
    refused(route(client, min_tokens=-1), "min_tokens", code=None)


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_object"}},
    {"json_schema": {"type": "integer"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
     "tool_choice": "required"},
])
def test_min_tokens_with_a_whole_output_constraint_is_refused(client, constraint):
    refused(chat(client, min_tokens=2, **constraint), "min_tokens")
    passes(chat(client, min_tokens=0, **constraint))


def test_llama_cpp_json_object_schema_is_honoured_and_other_keys_refused(client):
    # honoured: the schema goes through the same checks as a json_schema (a false schema is refused by name)
    passes(chat(client, response_format={"type": "json_object", "schema": {"const": "42"}}))
    refused(chat(client, response_format={"type": "json_object", "schema": False}), "response_format.schema",
            code=None)
    refused(chat(client, response_format={"type": "json_object", "schema": {"$defs": {"n": {"$ref": "#/$defs/n"}},
                                                                             "$ref": "#/$defs/n"}}),
            "response_format.schema", code="unsupported_schema")
    refused(chat(client, response_format={"type": "json_schema", "json_schema": {"schema": {}}, "schema": {}}),
            "response_format.schema", code=None)
    refused(chat(client, response_format={"type": "json_object", "strict": True}), "response_format.strict")
