"""Bodies that Python's ``json`` reads but nothing after it can use: a lone
UTF-16 surrogate escape and nesting past ``MAX_JSON_DEPTH`` are 400s naming the
field on every route that takes a JSON body (issue 25 item 9). No model:
the checks run before anything reaches the worker."""

from __future__ import annotations

import json

import pytest
from litestar.testing import TestClient

from musegl_core.config import ServeConfig
from musegl_core.http.app import create_app
from musegl_core.http.body import MAX_JSON_DEPTH, deep_field, load_json_object
from musegl_core.errors import ApiError
from musegl_core.plugins.manager import PluginManager
from musegl_core.worker.client import WorkerClient

ROUTES = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
CHAT = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'


@pytest.fixture(scope="module")
def client():
    config = ServeConfig(max_image_bytes=1024, max_request_bytes=1 << 20).validate()
    app = create_app(config, PluginManager(only=[]), WorkerClient(config), manage_worker=False)
    with TestClient(app) as c:
        yield c


def post(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def error_of(response, code: str, param):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] == param, error
    return error


@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfffb"}]}]}',
     "messages[0].content[0].text"),
    (CHAT + b', "stop": ["ok", "\\uDBFF"]}', "stop[1]"),
    (CHAT + b', "x": {"y": "\\ud800"}}', "x.y"),  # an unknown field too
])
def test_lone_surrogate_in_a_chat_body_is_400_naming_the_string(client, raw, param):
    error_of(post(client, "/v1/chat/completions", raw), "invalid_unicode", param)


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["\\ud800"], "max_tokens": 2}', "prompt[0]"),
    ("/tokenize", b'{"prompt": "x\\ud800"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/detokenize", b'{"tokens": [1], "model": "\\ud800"}', "model"),
])
def test_lone_surrogate_on_every_json_route_is_400(client, path, raw, param):
    error_of(post(client, path, raw), "invalid_unicode", param)


def test_surrogate_pairs_are_characters_and_pass(client):
    raw = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    response = post(client, "/v1/chat/completions", raw)
    assert response.status_code == 503  # valid: it only meets the worker that is not running
    assert load_json_object(raw)["messages"][0]["content"] == "\U0001F600"


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH, 974, 5000])
def test_deep_nesting_is_400_on_every_route_even_in_an_unknown_field(client, path, levels):
    raw = b'{"model": "m", "deep": ' + b"[" * levels + b"]" * levels + b"}"
    error = error_of(post(client, path, raw), "json_too_deep", "deep")
    assert str(MAX_JSON_DEPTH) in error["message"]


def test_nesting_up_to_the_limit_passes_the_body_check():
    inner = MAX_JSON_DEPTH - 1  # the body object is level 1
    raw = b'{"deep": ' + b"[" * inner + b"]" * inner + b"}"
    assert deep_field(load_json_object(raw)) is None
    with pytest.raises(ApiError) as refused:
        load_json_object(b'{"deep": ' + b"{\"a\": " * (inner + 1) + b"1" + b"}" * (inner + 1) + b"}")
    assert refused.value.param == "deep"


def test_a_deep_top_level_array_is_400_without_a_param(client):
    raw = b"[" * 3000 + b"]" * 3000
    error_of(post(client, "/v1/chat/completions", raw), "json_too_deep", None)


def test_a_long_flat_prompt_is_not_mistaken_for_depth():
    raw = json.dumps({"prompt": list(range(200_000)), "stop": ["\u00e9"]}).encode()
    assert len(load_json_object(raw)["prompt"]) == 200_000
