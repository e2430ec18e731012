"""Retention the client asks for, through every API (issue 45 item 5; docs/sessions.md "Retention"):
Chat Completions' and Responses' ``prompt_cache_retention``, Anthropic's ``cache_control.ttl``.
Each value reaches the session it runs in (``GET /v1/sessions`` shows it), the response states
the residency granted, and a value the server cannot honour is said so, never dropped silently."""

from __future__ import annotations

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server
from tests.support.chat_calls import chat

HISTORY = [{"role": "user", "content": "tell me " * 20}]


@pytest.fixture(scope="module")
def server():
    from musegl_core.tiny import default_model_path

    config = ServeConfig(model=str(default_model_path()), port=0, max_context=512, max_sessions=8)
    with running_server(config) as running:
        yield running


def sessions(server) -> dict:
    listed = httpx.get(f"{server.url}/v1/sessions", timeout=30).json()["data"]
    return {s["id"]: s for s in listed}


def anthropic(server, *, headers=None, **cache_control):
    block = {"type": "text", "text": "tell me " * 20}
    if cache_control:
        block["cache_control"] = cache_control
    body = {"model": "m", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [block]}]}
    return httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=120)


def test_chat_in_memory_is_granted_and_reaches_the_session(server):
    reply = chat(server.url, HISTORY, prompt_cache_key="ret-chat", prompt_cache_retention="in_memory")
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-prompt-cache-retention"] == "in_memory"
    (session,) = [s for name, s in sessions(server).items() if name.endswith("ret-chat")]
    assert session["retention"] == "5m"
    plain = chat(server.url, HISTORY, prompt_cache_key="ret-plain")
    assert "x-prompt-cache-retention" not in plain.headers
    assert [s for name, s in sessions(server).items() if name.endswith("ret-plain")][0]["retention"] is None


def test_chat_24h_without_a_disk_tier_is_served_in_memory_and_says_so(server):
    reply = chat(server.url, HISTORY, prompt_cache_key="ret-24h", prompt_cache_retention="24h")
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-prompt-cache-retention"] == "in_memory"
    assert [s for name, s in sessions(server).items() if name.endswith("ret-24h")][0]["retention"] == "5m"


def test_chat_an_unknown_retention_is_a_400(server):
    reply = chat(server.url, HISTORY, prompt_cache_retention="forever")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_cache_retention"


def test_responses_echo_the_granted_retention(server):
    body = {"model": "m", "input": "tell me " * 20, "max_output_tokens": 4, "temperature": 0,
            "prompt_cache_key": "ret-resp", "prompt_cache_retention": "24h", "store": False}
    reply = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["prompt_cache_retention"] == "in_memory"  # no disk tier here
    assert reply.headers["x-prompt-cache-retention"] == "in_memory"
    bad = httpx.post(f"{server.url}/v1/responses", json={**body, "prompt_cache_retention": "1h"}, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_retention"
    plain = httpx.post(f"{server.url}/v1/responses", json={**body, "prompt_cache_retention": None}, timeout=120)
    assert plain.json()["prompt_cache_retention"] is None


def test_anthropic_ttl_1h_keeps_the_claude_code_session_an_hour(server):
    reply = anthropic(server, headers={"X-Claude-Code-Session-Id": "ret-cc"}, type="ephemeral", ttl="1h")
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-prompt-cache-retention"] == "1h"
    assert sessions(server)["claude-code:ret-cc"]["retention"] == "1h"
    default = anthropic(server, headers={"X-Claude-Code-Session-Id": "ret-cc5"}, type="ephemeral")
    assert default.headers["x-prompt-cache-retention"] == "5m"  # cache_control's default ttl
    assert sessions(server)["claude-code:ret-cc5"]["retention"] == "5m"


def test_anthropic_a_bad_ttl_is_a_400_naming_where_it_is(server):
    reply = anthropic(server, type="ephemeral", ttl="24h")
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "'messages[0].content[0].cache_control.ttl' must be '5m' or '1h', got '24h'"


@pytest.fixture(scope="module")
def disk_server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    config = ServeConfig(model=str(default_model_path()), port=0, max_context=512, max_sessions=8,
                         kv_offload_dir=str(tmp_path_factory.mktemp("kv")), kv_offload_disk=64 << 20)
    with running_server(config) as running:
        yield running


def test_24h_with_a_disk_tier_is_granted_and_written_to_disk(disk_server):
    reply = chat(disk_server.url, HISTORY, prompt_cache_key="ret-day", prompt_cache_retention="24h")
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-prompt-cache-retention"] == "24h"
    assert [s for name, s in sessions(disk_server).items() if name.endswith("ret-day")][0]["retention"] == "24h"
    body = {"model": "m", "input": "tell me " * 20, "max_output_tokens": 4, "temperature": 0,
            "prompt_cache_retention": "24h", "store": False}
    response = httpx.post(f"{disk_server.url}/v1/responses", json=body, timeout=120)
    assert response.json()["prompt_cache_retention"] == "24h"
    metrics = httpx.get(f"{disk_server.url}/metrics", timeout=30).text
    blocks = [line for line in metrics.splitlines() if line.startswith("musegl_kv_disk_blocks ")]
    assert blocks and float(blocks[0].split()[1]) > 0  # written through at the end of the request
    assert 'musegl_kv_tier_capacity_bytes{cache_source="disk"} 6.7108864e+07' in metrics
