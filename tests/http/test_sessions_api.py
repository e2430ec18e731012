"""Managing named sessions over HTTP (GET/DELETE /v1/sessions, --session-idle-timeout,
API key) and automatic prefix caching with default flags."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.engine.sessions import session_policy
from musegl_core.testing.server import running_server
from musegl_core.testing.server import metric, wait_idle
from tests.support.chat_calls import chat

SHORT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny():
    from musegl_core.tiny import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module")
def default(tiny):
    """Default serving flags (4 slots, persistent sessions, prefix caching on)."""
    with running_server(ServeConfig(model=tiny, port=0)) as running:
        yield running


@pytest.fixture(scope="module")
def variant(tiny):
    config = ServeConfig(model=tiny, port=0, max_context=512, max_sessions=2, api_key="sekrit",
                         prefix_caching=False, session_idle_timeout=1.0)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MUSEGL_API_KEY", "sekrit")  # as `MUSEGL_API_KEY=... musegl serve` would have it
        with running_server(config) as running:
            yield running


KEY = {"Authorization": "Bearer sekrit"}


def sessions(url, headers=None) -> dict:
    r = httpx.get(f"{url}/v1/sessions", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return {s["id"]: s for s in r.json()["data"]}


def test_identical_anonymous_requests_reuse_the_cached_prefix(default):
    messages = [{"role": "user", "content": "prefix caching " * 8}]
    first = chat(default.url, messages, max_tokens=6).json()
    wait_idle(default.url)
    assert metric(default.url, "musegl_kv_blocks_used") == 0  # nothing held, but ...
    assert metric(default.url, "musegl_kv_blocks_cached") > 0  # ... its blocks are kept
    second = chat(default.url, messages, max_tokens=6).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert metric(default.url, "musegl_prefix_cache_hit_tokens") >= cached


def test_four_sessions_fill_a_default_server_until_one_is_deleted(default):
    wait_idle(default.url)
    for name in ("s1", "s2", "s3", "s4"):
        assert chat(default.url, SHORT, session_id=name).status_code == 200
    listed = sessions(default.url)
    assert set(listed) >= {"s1", "s2", "s3", "s4"}
    entry = listed["s4"]
    assert entry["object"] == "session" and entry["state"] == "idle"
    assert entry["cached_tokens"] > 0 and entry["idle_seconds"] >= 0 and entry["queued_requests"] == 0
    refused = chat(default.url, SHORT, session_id="s5")  # a new named session: no slot left
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "session_capacity"
    # anonymous work always finds room: the least recently used idle session (s1) gives way
    assert chat(default.url, SHORT).status_code == 200
    assert "s1" not in sessions(default.url) and "s2" in sessions(default.url)
    r = httpx.delete(f"{default.url}/v1/sessions/s2", timeout=30)
    assert r.status_code == 200 and r.json() == {"id": "s2", "object": "session", "deleted": True}
    assert "s2" not in sessions(default.url)
    assert chat(default.url, SHORT, session_id="s5").status_code == 200
    gone = httpx.delete(f"{default.url}/v1/sessions/s2", timeout=30)
    assert gone.status_code == 404
    assert gone.json()["error"]["type"] == "not_found_error" and gone.json()["error"]["code"] == "session_not_found"
    bad = httpx.delete(f"{default.url}/v1/sessions/no%20spaces", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"
    assert metric(default.url, "musegl_sessions_closed") == 1
    for name in ("s3", "s4", "s5"):
        assert httpx.delete(f"{default.url}/v1/sessions/{name}", timeout=30).status_code == 200
    assert metric(default.url, "musegl_kv_blocks_used") == 0
    assert metric(default.url, "musegl_kv_blocks_reserved") == 0


def test_an_active_session_cannot_be_deleted(default):
    wait_idle(default.url)
    body = {"model": "m", "messages": SHORT, "max_tokens": 300, "ignore_eos": True, "session_id": "busy"}
    done = {}
    thread = threading.Thread(
        target=lambda: done.setdefault("r", httpx.post(f"{default.url}/v1/chat/completions", json=body, timeout=120)))
    thread.start()
    deadline = time.monotonic() + 30
    while sessions(default.url).get("busy", {}).get("state") != "active":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = httpx.delete(f"{default.url}/v1/sessions/busy", timeout=30)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "session_active"
    thread.join()
    assert done["r"].status_code == 200  # the running request was not disturbed
    assert httpx.delete(f"{default.url}/v1/sessions/busy", timeout=30).status_code == 200


def test_sessions_api_takes_the_api_key(variant):
    assert httpx.get(f"{variant.url}/v1/sessions", timeout=30).status_code == 401
    assert httpx.delete(f"{variant.url}/v1/sessions/x", timeout=30).status_code == 401
    assert httpx.get(f"{variant.url}/v1/sessions", headers=KEY, timeout=30).json() == {"object": "list", "data": []}
    assert httpx.delete(f"{variant.url}/v1/sessions/x", headers=KEY, timeout=30).status_code == 404


def test_the_api_key_never_reaches_the_worker(variant):
    """Not in its command line (world-readable), not in its environment, not in its settings."""
    pid = variant.worker.pid
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read()
    assert b"sekrit" not in cmdline and b"--config-json" not in cmdline
    assert b"sekrit" not in environ and b"MUSEGL_API_KEY" not in environ
    assert httpx.get(f"{variant.url}/v1/models", headers=KEY, timeout=30).status_code == 200  # the front checks it


def test_idle_sessions_expire_after_the_timeout(variant):
    assert chat(variant.url, SHORT, headers=KEY, session_id="brief").status_code == 200
    assert "brief" in sessions(variant.url, KEY)
    deadline = time.monotonic() + 10
    while "brief" in sessions(variant.url, KEY):
        assert time.monotonic() < deadline, "the idle session was not closed"
        time.sleep(0.1)
    text = httpx.get(f"{variant.url}/metrics", headers=KEY, timeout=30).text
    assert "musegl_sessions_expired_total 1.0" in text


def test_no_prefix_caching_reuses_nothing_across_requests(variant):
    messages = [{"role": "user", "content": "no caching " * 8}]
    for _ in range(2):
        r = chat(variant.url, messages, headers=KEY)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "musegl_kv_blocks_cached 0.0" in httpx.get(f"{variant.url}/metrics", headers=KEY, timeout=30).text


def test_the_startup_policy_line_names_the_session_rules():
    line = session_policy(ServeConfig())
    assert "4 slots" in line and "persist until DELETE /v1/sessions/{id}" in line and "503 session_capacity" in line
    line = session_policy(ServeConfig(session_idle_timeout=30, evict_idle_sessions=True, prefix_caching=False))
    assert "closed after 30 s idle" in line and "evicted LRU" in line and "prefix caching off" in line


def front_client(**settings):
    from litestar.testing import TestClient

    from musegl_core.http.app import create_app
    from musegl_core.plugins.manager import PluginManager
    from musegl_core.worker.client import WorkerClient

    config = ServeConfig(**settings).validate()
    return TestClient(create_app(config, PluginManager(only=[]), WorkerClient(config), manage_worker=False))


def test_sessions_api_off_removes_both_routes_and_their_documentation():
    with front_client(sessions_api=False) as client:
        for method, path in (("GET", "/v1/sessions"), ("GET", "/sessions"), ("DELETE", "/v1/sessions/s1"),
                             ("DELETE", "/sessions/s1")):
            r = client.request(method, path)
            assert r.status_code == 404, (method, path)
            assert r.json()["error"]["type"] == "not_found_error"
            assert "--sessions-api off" in r.json()["error"]["message"]
        paths = client.get("/openapi.json").json()["paths"]
        assert not [p for p in paths if "sessions" in p]
        assert "/v1/chat/completions" in paths
    with front_client() as client:  # on by default
        assert {"/v1/sessions", "/v1/sessions/{session}"} <= set(client.get("/openapi.json").json()["paths"])
        assert client.get("/v1/sessions").status_code == 503  # routed (the worker is not started here)


def test_with_an_api_key_the_openapi_document_needs_it_too():
    with front_client(api_key="sekrit") as client:
        refused = client.get("/openapi.json")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert client.get("/openapi.json", headers=KEY).json()["info"]["title"] == "musegl"
        assert client.get("/health").status_code == 503  # /health alone stays public
    with front_client() as client:
        assert client.get("/openapi.json").status_code == 200  # no key configured: public
