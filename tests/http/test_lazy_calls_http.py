"""tool_choice "auto" with strict tools through the HTTP API.

The scripted executor writes the free part of each output (the text before a
tool call opens, and a call that breaks its schema); where the activated call
grammar forbids the scripted token it draws an allowed id instead (seeded),
so everything after that point comes from the grammar alone."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server, scripted_plugin_env

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
FREE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
BAD_CALL = ('<atem:function_calls>\n<atem:invoke name="get_weather.get_weather">\n'
            '<atem:parameter name="days">99</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')
LONG_CITY = ('<atem:function_calls>\n<atem:invoke name="get_weather.get_weather">\n'
             '<atem:parameter name="city">A city with a very long name</atem:parameter>\n'
             '</atem:invoke>\n</atem:function_calls>')
FREE_CALL = ('<atem:function_calls>\n<atem:invoke name="free.free">\n\n  '
             '<atem:parameter name="a">2</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')
SCRIPT = [
    {"when": "header call", "reply": "Let me check.<|eom|><|start|>assistant to=get_weather.get_weather<|message|>"
                                     + BAD_CALL + "<|eot|>"},
    {"when": "inline call", "reply": " to=user<|message|>Checking.\n" + LONG_CITY + "<|eot|>"},
    {"when": "free call", "reply": " to=free.free<|message|>" + FREE_CALL + "<|eot|>"},
]


def tools(strict: bool) -> list[dict]:
    return [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": strict}},
            {"type": "function", "function": {"name": "free", "parameters": FREE}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    with scripted_plugin_env(tmp_path_factory.mktemp("lazy"), SCRIPT):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", max_context=2048,
                             tool_parser="atem")
        with running_server(config) as running:
            yield running


def chat(server, prompt: str, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 300, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def streamed_calls(server, prompt: str, **extra) -> tuple[str, list]:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 300, "stream": True,
            **extra}
    content, calls = "", {}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    content += choice["delta"].get("content") or ""
                    for call in choice["delta"].get("tool_calls") or []:
                        entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                        entry["name"] += call.get("function", {}).get("name") or ""
                        entry["arguments"] += call.get("function", {}).get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def test_without_strict_the_scripted_calls_break_their_schema(server):
    for prompt in ("header call", "inline call"):
        response = chat(server, prompt, tools=tools(False))
        assert response.status_code == 502, response.text  # invalid_tool_output: validated after generation


@pytest.mark.parametrize("prompt, content", [("header call", "Let me check."), ("inline call", "Checking.\n")])
def test_strict_calls_satisfy_their_schema_and_the_text_before_stays_free(server, prompt, content):
    for seed in range(4):
        response = chat(server, prompt, tools=tools(True), seed=seed)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == content
        calls = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER)
        streamed_content, streamed = streamed_calls(server, prompt, tools=tools(True), seed=seed)
        assert streamed_content == content
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
            ("get_weather", json.loads(calls[0]["function"]["arguments"]))]


def test_a_non_strict_tool_next_to_a_strict_one_stays_unconstrained(server):
    # The script's extra whitespace between tags is valid ATEM that the strict
    # grammar (canonical layout) would refuse: the call comes back as scripted.
    response = chat(server, "free call", tools=tools(True))
    assert response.status_code == 200, response.text
    calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("free", {"a": 2})]


def test_a_strict_tool_the_grammar_cannot_express_is_400(server):
    bad = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}}}}]
    response = chat(server, "header call", tools=bad)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"
    assert chat(server, "header call", tools=bad, tool_choice="none").status_code == 200  # tools inactive
