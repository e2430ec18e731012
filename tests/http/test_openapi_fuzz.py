"""Fuzz the server through its own OpenAPI document (schemathesis).

The document is the one the app serves (``GET /openapi.json``); schemathesis
generates valid and invalid requests for every operation in it and checks
each answer: never a 5xx, a documented status, a documented content type, a
body that matches the documented schema. A short run is part of the default
suite; ``-m slow`` runs a longer one.

The model is the scripted executor (every prompt gets a short reply), so
the run exercises the real front, worker, engine and tokenizer quickly.
"""

from __future__ import annotations

import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server, scripted_plugin_env

SCRIPT = [{"when": "", "reply": " to=user<|message|>ok<|eot|>"}]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EVERY_ROUTE = {
    "/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/tokenize", "/detokenize",
    "/v1/models", "/models", "/v1/models/{model_id}", "/models/{model_id}", "/health", "/v1/health", "/metrics",
}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    with scripted_plugin_env(tmp_path_factory.mktemp("fuzz"), SCRIPT):
        config = ServeConfig(
            model=str(default_model_path()),
            port=0,
            executor="scripted",
            max_context=256,
            evict_idle_sessions=True,  # fuzzed session ids must not fill the slots
            max_request_bytes=65536,
            max_image_bytes=16384,
        )
        with running_server(config) as running:
            yield running


def app_document(**settings) -> dict:
    """The OpenAPI document generated from the Litestar app (no worker needed), with
    every installed plugin loaded as the server loads them (API surfaces add routes)."""
    from musegl_core.http.app import create_app
    from musegl_core.plugins.manager import PluginManager
    from musegl_core.worker.client import WorkerClient

    config = ServeConfig(**settings).validate()
    app = create_app(config, PluginManager(), WorkerClient(config), manage_worker=False)
    return app.openapi_schema.to_schema()


DOCUMENT = app_document()
schema = schemathesis.openapi.from_dict(DOCUMENT)


def test_with_an_api_key_the_document_requires_the_bearer_token_except_for_health():
    assert "security" not in DOCUMENT
    document = app_document(api_key="secret")
    assert document["security"] == [{"bearer": []}]
    assert document["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert document["paths"]["/health"]["get"]["security"] == [{}]
    assert "security" not in document["paths"]["/v1/models"]["get"]  # the document-wide default applies


def test_the_server_serves_the_fuzzed_document(fuzz_server):
    assert httpx.get(f"{fuzz_server.url}/openapi.json").json() == DOCUMENT


def test_the_document_lists_every_route(fuzz_server):
    document = httpx.get(f"{fuzz_server.url}/openapi.json").json()
    assert set(document["paths"]) >= EVERY_ROUTE
    app_paths = {re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path) for route in fuzz_server.app.routes}
    documented = set(document["paths"])
    assert {p for p in app_paths if not p.startswith("/openapi.json")} <= documented
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method == "post" and not path.endswith("/cancel"):  # POST /v1/responses/{id}/cancel takes no body
                assert operation["requestBody"]["content"]["application/json"]["schema"]["properties"], path
            assert "200" in operation["responses"], (path, method)
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert [p["name"] for p in chat["parameters"]] == ["X-Session-Id"]


def _run(case, server) -> None:
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzz_short(case, fuzz_server):
    _run(case, fuzz_server)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_long(case, fuzz_server):
    _run(case, fuzz_server)
