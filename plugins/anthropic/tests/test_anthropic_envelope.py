"""Anthropic's error envelope and credentials, without a model: the app is built
with every installed plugin and a worker that never starts (so generation
requests end in the 'model loading' 503, which Anthropic clients get as 529)."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from musegl_core.config import ServeConfig
from musegl_core.http.app import create_app
from musegl_core.plugins.manager import PluginManager
from musegl_core.worker.client import WorkerClient

BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def client():
    config = ServeConfig(api_key="sesame", max_request_bytes=8192, max_image_bytes=4096).validate()
    app = create_app(config, PluginManager(), WorkerClient(config), manage_worker=False)
    with TestClient(app) as test_client:
        yield test_client


def error_of(response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_a_missing_or_wrong_key_is_an_authentication_error(client):
    error_of(client.post("/v1/messages", json=BODY), 401, "authentication_error")
    error_of(client.post("/v1/messages", json=BODY, headers={"x-api-key": "wrong"}), 401, "authentication_error")


@pytest.mark.parametrize("headers", [{"x-api-key": "sesame"}, {"Authorization": "Bearer sesame"}])
def test_either_credential_passes_and_a_loading_model_is_overloaded_529(client, headers):
    message = error_of(client.post("/v1/messages?beta=true", json=BODY, headers=headers), 529, "overloaded_error")
    assert "loading" in message


def test_unknown_paths_and_methods_under_the_prefix_keep_the_envelope(client):
    key = {"x-api-key": "sesame"}
    error_of(client.post("/v1/messages/batches", json=BODY, headers=key), 404, "not_found_error")
    error_of(client.get("/v1/messages", headers=key), 405, "invalid_request_error")


def test_a_body_over_the_limit_is_request_too_large(client):
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 9000}]}
    error_of(client.post("/v1/messages", json=big, headers={"x-api-key": "sesame"}), 413, "request_too_large")


def test_malformed_json_is_an_invalid_request_error(client):
    response = client.post("/v1/messages", content=b"{not json", headers={"x-api-key": "sesame",
                                                                          "content-type": "application/json"})
    error_of(response, 400, "invalid_request_error")


def test_the_chat_surface_keeps_openai_errors(client):
    response = client.post("/v1/chat/completions", json={"messages": []}, headers={"x-api-key": "sesame"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert "type" not in response.json()  # OpenAI's envelope, not Anthropic's
