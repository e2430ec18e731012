"""End to end through the HTTP API: scripted model output → ATEM tool calls.

The scripted executor (``tests/support/musegl_scripted.py``, registered only
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
from tests.support.server import running_server, scripted_plugin_env

from atem_support import block

CALL = " to=self<|message|>Need the time.<|eom|><|start|>assistant to=get_time.get_time<|message|>" + block(
    "get_time.get_time", [("tz", "UTC")]
) + "<|eot|>"
BAD = " to=get_time.get_time<|message|>" + block("get_time.get_time", [("tz", "A"), ("tz", "B")]) + "<|eot|>"
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    script = [{"when": "call please", "reply": CALL}, {"when": "bad please", "reply": BAD}, {"when": "hello", "reply": " to=user<|message|>Hi<|eot|>"}]
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
