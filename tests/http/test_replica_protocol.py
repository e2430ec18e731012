"""What a router needs from a replica (docs/scaling.md, "Replicas"), over a real server:
the fields vllm-router and sglang-router add to every body they forward are honoured
(``skip_special_tokens`` true leaves special tokens out of the text), the named
session a request ran in is echoed in ``X-Session-Id``, and ``/metrics`` carries
vLLM's series next to musegl's."""

from __future__ import annotations

import re

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server, scripted_plugin_env

RESERVED = "<|reserved_special_token_5|>"
SCRIPT = [
    {"when": "special please", "reply": f"Hi{RESERVED} there<|patch|>!<|eot|>"},
    {"when": "raw special", "reply": f"one{RESERVED} two<|eom|> three<|eot|>"},
    {"when": "", "reply": "Fine, thanks.<|eot|>"},
]

#: What vllm-router 0.1.17 adds to a Chat Completions body it forwards (sglang-router the same but
#: include_reasoning), captured from the router.
ROUTER_CHAT_FIELDS = {"logprobs": False, "no_stop_trim": False, "continue_final_message": False,
                      "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                      "return_hidden_states": False, "include_reasoning": True}
ROUTER_COMPLETION_FIELDS = {"echo": False, "no_stop_trim": False, "ignore_eos": False,
                            "skip_special_tokens": True, "return_hidden_states": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    with scripted_plugin_env(tmp_path_factory.mktemp("replica"), SCRIPT):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", max_context=1024,
                             max_sessions=4)
        with running_server(config) as running:
            yield running


def chat(server, text: str, headers: dict | None = None, **fields) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 40, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_chat_with_the_routers_fields_leaves_special_tokens_out_of_the_content(server):
    plain = chat(server, "special please")
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["message"]["content"] == f"Hi{RESERVED} there<|patch|>!"
    routed = chat(server, "special please", **ROUTER_CHAT_FIELDS)
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["message"]["content"] == "Hi there!"
    explicit = chat(server, "special please", skip_special_tokens=False)
    assert explicit.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]


def test_raw_completions_with_skip_special_tokens_leave_every_special_token_out(server):
    def text(**fields):
        response = httpx.post(f"{server.url}/v1/completions",
                              json={"model": "m", "prompt": "raw special", "max_tokens": 40, **fields}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    assert text() == f"one{RESERVED} two<|eom|> three"
    assert text(**ROUTER_COMPLETION_FIELDS) == "one two three"


@pytest.mark.parametrize("stream", [False, True])
def test_the_named_session_a_request_ran_in_is_echoed(server, stream):
    name = f"echo-{int(stream)}"
    by_body = chat(server, "hello", session_id=name, stream=stream)
    assert by_body.status_code == 200, by_body.text
    assert by_body.headers["x-session-id"] == name
    by_header = chat(server, "hello", headers={"X-Session-Id": name}, stream=stream)
    assert by_header.headers["x-session-id"] == name
    assert "x-session-id" not in chat(server, "hello", stream=stream).headers  # anonymous
    # a soft session may run anonymously after all (docs/sessions.md): it is not echoed
    assert "x-session-id" not in chat(server, "hello", prompt_cache_key=f"k-{name}", stream=stream).headers
    assert httpx.delete(f"{server.url}/v1/sessions/{name}", timeout=30).status_code == 200
    httpx.delete(f"{server.url}/v1/sessions/codex:k-{name}", timeout=30)


def series(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
    assert match is not None, f"{name} missing from /metrics"
    return float(match.group(1))


def test_metrics_carry_vllms_series_with_the_model_name(server):
    first = chat(server, "hello there, a first turn", session_id="metrics")
    assert first.status_code == 200
    before = httpx.get(f"{server.url}/metrics", timeout=30).text
    history = [{"role": "user", "content": "hello there, a first turn"},
               {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
               {"role": "user", "content": "and a second one"}]
    second = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                        json={"model": "m", "messages": history, "max_tokens": 40, "session_id": "metrics"})
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    after = httpx.get(f"{server.url}/metrics", timeout=30).text
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    assert f'vllm:num_requests_running{{model_name="{model}"}} 0.0' in after
    assert series(after, "vllm:num_requests_waiting") == 0
    usage = series(after, "vllm:kv_cache_usage_perc")
    assert usage == pytest.approx(series(after, "musegl_kv_blocks_used") / series(after, "musegl_kv_blocks"))
    assert 0 < usage <= 1  # the session holds its blocks
    hits = series(after, "vllm:prefix_cache_hits_total") - series(before, "vllm:prefix_cache_hits_total")
    queries = series(after, "vllm:prefix_cache_queries_total") - series(before, "vllm:prefix_cache_queries_total")
    assert hits == cached and queries == second.json()["usage"]["prompt_tokens"]
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert series(after, f"{histogram}_count") > series(before, f"{histogram}_count")
    assert series(after, "vllm:generation_tokens_total") == series(after, "musegl_generated_tokens_total")
    httpx.delete(f"{server.url}/v1/sessions/metrics", timeout=30)


def test_a_delete_naming_another_session_in_x_session_id_is_refused(server):
    assert chat(server, "hello", session_id="kept").status_code == 200
    response = httpx.delete(f"{server.url}/v1/sessions/kept", headers={"X-Session-Id": "other"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Session-Id"
    assert [s["id"] for s in httpx.get(f"{server.url}/v1/sessions", timeout=30).json()["data"]] == ["kept"]
    response = httpx.delete(f"{server.url}/v1/sessions/kept", headers={"X-Session-Id": "kept"}, timeout=30)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("stream", [False, True])
def test_messages_and_responses_echo_the_named_session_too(server, stream):
    name = f"plugin-echo-{int(stream)}"
    messages = httpx.post(f"{server.url}/v1/messages", headers={"X-Session-Id": f"{name}-m"}, timeout=60,
                          json={"model": "m", "max_tokens": 30, "stream": stream,
                                "messages": [{"role": "user", "content": "hello"}]})
    assert messages.status_code == 200, messages.text
    assert messages.headers["x-session-id"] == f"{name}-m"
    responses = httpx.post(f"{server.url}/v1/responses", headers={"X-Session-Id": f"{name}-r"}, timeout=60,
                           json={"model": "m", "max_output_tokens": 30, "stream": stream, "store": False,
                                 "input": "hello"})
    assert responses.status_code == 200, responses.text
    assert responses.headers["x-session-id"] == f"{name}-r"
    anonymous = httpx.post(f"{server.url}/v1/messages", timeout=60,
                           json={"model": "m", "max_tokens": 30, "messages": [{"role": "user", "content": "hi"}]})
    assert "x-session-id" not in anonymous.headers
    for session in (f"{name}-m", f"{name}-r"):
        assert httpx.delete(f"{server.url}/v1/sessions/{session}", timeout=30).status_code == 200


def test_health_says_shutting_down_once_a_shutdown_began():
    """A router's health check on a kept-alive connection sees the drain begin (the listening
    socket is closed by then, so new connections are refused anyway: docs/serving.md)."""
    from litestar.testing import TestClient

    from musegl_core.http.app import create_app
    from musegl_core.plugins.manager import PluginManager
    from musegl_core.worker.client import WorkerClient

    config = ServeConfig().validate()
    app = create_app(config, PluginManager(only=[]), WorkerClient(config), manage_worker=False)
    with TestClient(app) as client:
        assert client.get("/health").json()["error"]["code"] == "model_loading"  # no worker here
        app.state["front"].shutting_down = True  # what SIGTERM's begin_shutdown sets first
        response = client.get("/health")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "server_shutting_down"
