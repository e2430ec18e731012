"""End to end through the HTTP API: scripted model output → ATEM tool calls.

The scripted executor (``musegl_core/testing/scripted.py``, registered only
for these tests) replays raw output through the real tokenizer, engine,
worker and front; the server runs with ``--tool-parser atem``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.errors import ConfigError
from musegl_core.plugins.manager import PluginManager
from musegl_core.testing.server import running_server, scripted_plugin_env

from atem_support import block

CALL = " to=self<|message|>Need the time.<|eom|><|start|>assistant to=get_time.get_time<|message|>" + block(
    "get_time.get_time", [("tz", "UTC")]
) + "<|eot|>"
BAD = " to=get_time.get_time<|message|>" + block("get_time.get_time", [("tz", "A"), ("tz", "B")]) + "<|eot|>"
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]
FIRST = " to=get_time.get_time<|message|>" + block("get_time.get_time", [("tz", "UTC")])
TWO = FIRST + "<|eom|><|start|>assistant to=get_time.get_time<|message|>" + block("get_time.get_time", [("tz", "CET")]) + "<|eot|>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    script = [{"when": "call please", "reply": CALL}, {"when": "bad please", "reply": BAD}, {"when": "hello", "reply": " to=user<|message|>Hi<|eot|>"},
              {"when": "two calls", "reply": TWO}]
    with scripted_plugin_env(tmp_path_factory.mktemp("scripted"), script):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", tool_parser="atem", max_context=2048)
        with running_server(config) as running:
            yield running


def post(server, text, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "tools": TOOLS, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_tool_call_non_streaming(server):
    reply = post(server, "call please").json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Need the time."
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"]
    assert tool_call["function"]["name"] == "get_time"
    assert json.loads(tool_call["function"]["arguments"]) == {"tz": "UTC"}


def test_tool_call_streaming_reasoning_first_then_calls(server):
    events = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "call please"}], "tools": TOOLS, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    deltas = [e["choices"][0] for e in events if e.get("choices")]
    reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
    assert reasoning == "Need the time."
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_invalid_output_is_502_without_calls(server):
    response = post(server, "bad please")
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "invalid_tool_output"


def test_invalid_output_streaming_is_an_sse_error(server):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "bad please"}], "tools": TOOLS, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert any("invalid_tool_output" in line for line in lines)
    assert not any("tool_calls" in line for line in lines)


def test_truncated_call_set_is_suppressed(server):
    reply = post(server, "call please", max_tokens=30).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")


def test_bad_schema_is_400_before_generation_and_ignored_with_tool_choice_none(server):
    tools = TOOLS + [{"type": "function", "function": {"name": "b", "parameters": {"$schema": "http://json-schema.org/draft-04/schema#"}}}]
    response = post(server, "hello", tools=tools)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_tool_schema"
    assert post(server, "hello", tools=tools, tool_choice="none").status_code == 200


def test_core_works_without_the_plugin():
    with pytest.raises(ConfigError, match="musegl-atem"):
        PluginManager(only=["cuda"]).get("tool_parsers", "atem")
    assert "atem" in PluginManager(only=["atem"]).specs("tool_parsers")


def test_serve_without_the_plugin_exits_2_naming_it():
    done = subprocess.run(
        [sys.executable, "-m", "musegl_core.cli.main", "serve", "--plugin", "cuda", "--tool-parser", "atem"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2 and "musegl-atem" in done.stderr


# -- parallel_tool_calls (issue 25 item 10) -------------------------------------------------------
def calls_and_tokens(server, **extra):
    reply = post(server, "two calls", **extra)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    zones = [json.loads(c["function"]["arguments"])["tz"] for c in choice["message"].get("tool_calls") or []]
    return choice["finish_reason"], zones, reply.json()["usage"]["completion_tokens"]


def streamed_zones(server, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "two calls"}], "tools": TOOLS, "stream": True, **extra}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    calls = [c for e in events for ch in e.get("choices", []) for c in ch["delta"].get("tool_calls") or []]
    return [json.loads(c["function"]["arguments"])["tz"] for c in calls]


def test_parallel_tool_calls_true_or_absent_returns_every_call(server):
    for extra in ({}, {"parallel_tool_calls": True}, {"parallel_tool_calls": None}):
        assert calls_and_tokens(server, **extra)[:2] == ("tool_calls", ["UTC", "CET"])


def test_parallel_tool_calls_false_without_a_grammar_returns_the_first_call_only(server):
    reason, zones, _ = calls_and_tokens(server, parallel_tool_calls=False)
    assert (reason, zones) == ("tool_calls", ["UTC"])
    assert streamed_zones(server, parallel_tool_calls=False) == ["UTC"]
    assert streamed_zones(server) == ["UTC", "CET"]


@pytest.mark.parametrize("extra", [
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    {"tools": [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]},  # the lazy grammar
])
def test_parallel_tool_calls_false_under_a_call_grammar_ends_the_turn_after_one_call(server, extra):
    """The grammar allows exactly one call and then only <|eot|>: the scripted
    second call is never generated (the executor draws the one allowed id)."""
    _, both, all_tokens = calls_and_tokens(server, **extra)
    assert both == ["UTC", "CET"]
    reason, zones, tokens = calls_and_tokens(server, parallel_tool_calls=False, **extra)
    assert (reason, zones) == ("tool_calls", ["UTC"])
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    first = MuseTokenizer.load(str(default_model_path())).encode(FIRST + "<|eot|>", special=True)
    assert tokens == len(first) < all_tokens
