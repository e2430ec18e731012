"""``supported_parameters`` of the OpenRouter ``/v1/models`` entry: derived from the
request schema, and every listed parameter is accepted by a real server (the
tiny model through the real engine, with and without a tool parser)."""

from __future__ import annotations

import attrs
import httpx
import pytest

from openrouter_servers import FrontSpec, serving

from musegl_core.config import ServeConfig
from musegl_core.openai import schemas as s
from musegl_openrouter.models import CAPABILITIES, NOT_PARAMETERS, TOOL_PARAMETERS, supported_parameters

WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
#: A request that uses each parameter (with what it needs beside it). A parameter
#: added to the schema needs an entry here: the test below fails until it has one.
EXAMPLES = {
    "max_tokens": {"max_tokens": 2},
    "max_completion_tokens": {"max_completion_tokens": 2, "max_tokens": None},  # null is absent
    "temperature": {"temperature": 0.7},
    "top_p": {"top_p": 0.9},
    "top_k": {"top_k": 5},
    "seed": {"seed": 7},
    "stop": {"stop": ["zzz", "qqq"]},
    "ignore_eos": {"ignore_eos": True},
    "reasoning_effort": {"reasoning_effort": "low"},
    "reasoning": {"reasoning": {"effort": "low", "exclude": True}},
    "include_reasoning": {"include_reasoning": False},
    "tools": {"tools": [WEATHER_TOOL]},
    "tool_choice": {"tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": 32},  # room for a call
    "parallel_tool_calls": {"tools": [WEATHER_TOOL], "parallel_tool_calls": False},
    "n": {"n": 2},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 3},
    "response_format": {"response_format": {"type": "json_object"}},
    "json_schema": {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.1},
    "min_p": {"min_p": 0.05},
    "logit_bias": {"logit_bias": {"100": -5}},
    "stop_token_ids": {"stop_token_ids": [100, 101]},
    "min_tokens": {"min_tokens": 2},
    "skip_special_tokens": {"skip_special_tokens": True},
    "prompt_cache_retention": {"prompt_cache_retention": "in_memory"},
    # capabilities: OpenRouter's name for what a field provides
    "structured_outputs": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}}}},
}
#: Sampling and output-format parameters the server implements (docs/protocol.md): all must be listed.
SAMPLING_AND_FORMAT = {
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_p", "logit_bias", "logprobs", "top_logprobs", "response_format",
    "structured_outputs", "reasoning", "include_reasoning", "n",
}


def test_the_list_is_the_schema_less_plumbing():
    fields = {field.name for field in attrs.fields(s.ChatCompletionRequest)}
    assert NOT_PARAMETERS <= fields  # no stale names
    listed = set(supported_parameters(True))
    assert listed == (fields - NOT_PARAMETERS) | set(CAPABILITIES)
    assert set(supported_parameters(False)) == listed - set(TOOL_PARAMETERS)
    assert SAMPLING_AND_FORMAT <= set(supported_parameters(False))
    # structured_outputs is OpenRouter's capability name (response_format json_schema), not vLLM's
    # request field of the same name, which stays refused
    assert not (listed - set(CAPABILITIES)) & set(s.REJECTED_FIELDS)
    assert listed == set(EXAMPLES), "give every listed parameter an example request (EXAMPLES)"


@pytest.fixture(scope="module")
def urls():
    from musegl_core.tiny import default_model_path

    config = ServeConfig(model=str(default_model_path()), port=0, max_context=2048, max_sessions=4,
                         max_inflight_requests=4, max_decode_sequences=4)
    fronts = {
        "tools": FrontSpec("openrouter", ("openrouter", "atem"), tool_parser="atem"),
        "plain": FrontSpec("openrouter", ("openrouter",)),
    }
    with serving(config, fronts) as running:
        yield running


def listed(url: str) -> list[str]:
    entry = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    return entry["supported_parameters"]


def test_every_listed_parameter_is_accepted(urls):
    """Sent one at a time to the front with a tool parser, whose list is the longest."""
    parameters = listed(urls["tools"])
    assert parameters == list(supported_parameters(True))
    for name in parameters:
        body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 4,
                **EXAMPLES[name]}
        response = httpx.post(f"{urls['tools']}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, (name, response.text)


def test_tools_are_listed_only_where_they_are_accepted(urls):
    assert listed(urls["plain"]) == list(supported_parameters(False))
    assert not set(TOOL_PARAMETERS) & set(listed(urls["plain"]))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL]}
    refused = httpx.post(f"{urls['plain']}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
