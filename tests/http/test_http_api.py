"""The HTTP API end to end: a real worker on the tiny random checkpoint, the
Litestar app under uvicorn on a free port, driven by the official ``openai``
SDK and by raw SSE parsing with httpx.

The tiny checkpoint's weights are random, so these tests check the protocol
(shapes, order, usage arithmetic, limits), never the words.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server

MAX_CONTEXT = 1024
SERVED_NAME = "muse-tiny"
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def base_url():
    from musegl_core.tiny import default_model_path

    config = ServeConfig(
        model=str(default_model_path()),
        demo=True,
        port=0,
        served_model_name=SERVED_NAME,
        max_context=MAX_CONTEXT,
        max_inflight_requests=2,
        max_sessions=2,
        max_decode_sequences=2,
    )
    with running_server(config) as running:
        yield running.url


@pytest.fixture(scope="module")
def sdk(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order (comments skipped)."""
    events, data = [], []
    for line in response.iter_lines():
        if line.startswith(":"):
            continue
        if line == "":
            if data:
                events.append("\n".join(data))
                data = []
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        events.append("\n".join(data))
    return events


def stream_raw(base_url: str, **fields) -> tuple[httpx.Response, list[str]]:
    body = {"model": "anything", "messages": MESSAGES, "stream": True, **fields}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return response, []
        return response, sse_events(response)


# -- health and models -------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health", "/v1/health"])
def test_health_ok_once_ready(base_url, path):
    response = httpx.get(base_url + path)
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_models(base_url, sdk):
    body = httpx.get(f"{base_url}/v1/models").json()
    assert body["object"] == "list"
    (entry,) = body["data"]
    assert entry["id"] == SERVED_NAME
    assert entry["context_length"] == entry["max_model_len"] == MAX_CONTEXT
    assert entry["demo"] is True and entry["description"]
    assert httpx.get(f"{base_url}/models").json() == body
    assert [m.id for m in sdk.models.list()] == [SERVED_NAME]


# -- non-streaming -----------------------------------------------------------------------
def test_sdk_non_streaming(sdk):
    result = sdk.chat.completions.create(model="whatever", messages=MESSAGES, max_tokens=8, temperature=0)
    assert result.id.startswith("chatcmpl-")
    assert result.object == "chat.completion"
    assert result.model == SERVED_NAME
    assert result.system_fingerprint.startswith("musegl-")
    (choice,) = result.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.tool_calls is None
    usage = result.usage
    assert 0 < usage.completion_tokens <= 8
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    if choice.finish_reason == "length":
        assert usage.completion_tokens == 8


def test_max_tokens_one_is_length(sdk):
    result = sdk.chat.completions.create(
        model="m", messages=MESSAGES, max_completion_tokens=1, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 1
    # ignore_eos: the reasoning breakdown is omitted.
    assert result.usage.completion_tokens_details is None


def test_greedy_is_deterministic(sdk):
    kwargs = dict(model="m", messages=MESSAGES, max_tokens=12, temperature=0)
    first = sdk.chat.completions.create(**kwargs)
    second = sdk.chat.completions.create(**kwargs)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.completion_tokens == second.usage.completion_tokens


def test_seeded_sampling_is_reproducible(sdk):
    kwargs = dict(model="m", messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    kwargs["extra_body"] = {"top_k": 50}
    first = sdk.chat.completions.create(**kwargs)
    second = sdk.chat.completions.create(**kwargs)
    assert first.choices[0].message.content == second.choices[0].message.content


def test_reasoning_breakdown_counts_within_completion(base_url):
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    usage = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).json()["usage"]
    details = usage.get("completion_tokens_details")
    if details is not None:  # absent only when the worker trimmed a stop
        assert 0 <= details["reasoning_tokens"] <= usage["completion_tokens"]


def test_hidden_reasoning_is_not_returned(base_url):
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0, "include_reasoning": False}
    message = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
    assert "reasoning_content" not in message


def test_errors_keep_their_status_on_the_real_server(base_url, sdk):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model="m", messages=MESSAGES, extra_body={"grammar": "root ::= x"})
    assert caught.value.body["code"] == "unsupported_parameter"
    assert caught.value.body["param"] == "grammar"
    response = httpx.post(f"{base_url}/v1/chat/completions", content=b"{oops", timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{base_url}/v1/nothing-here").status_code == 404


# -- streaming ---------------------------------------------------------------------------
def test_sdk_streaming_with_usage(sdk):
    stream = sdk.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    ids = {chunk.id for chunk in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0].choices[0].finish_reason in ("stop", "length")
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens
    assert 0 < usage_chunk.usage.completion_tokens <= 10

    # The stream carries exactly what the non-streaming response returns.
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10, temperature=0)
    assert text == (whole.choices[0].message.content or "")


def test_raw_sse_sequence(base_url):
    response, events = stream_raw(
        base_url, max_tokens=12, temperature=0, stream_options={"include_usage": True}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]
    finish_at = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["finish_reason"])
    for chunk in chunks[1:finish_at]:
        delta = chunk["choices"][0]["delta"]
        assert "role" not in delta
        assert set(delta) <= {"content", "reasoning_content"} and delta
        assert all(isinstance(v, str) and v for v in delta.values())  # never an empty delta
    finish = chunks[finish_at]
    assert finish["choices"][0]["delta"] == {}
    assert finish_at == len(chunks) - 2
    usage = chunks[-1]
    assert usage["choices"] == [] and set(usage["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == SERVED_NAME
        assert chunk["system_fingerprint"].startswith("musegl-")


def test_no_usage_chunk_without_include_usage(base_url):
    _, events = stream_raw(base_url, max_tokens=4, temperature=0)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert all("usage" not in c and c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_stream_validation_error_is_plain_http(base_url):
    response, events = stream_raw(base_url, max_tokens=0)
    assert response.status_code == 400 and events == []
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["param"] == "max_tokens"


def test_client_disconnect_cancels_generation(base_url, sdk):
    # Abandon more streams than the worker admits at once: if leaving did not
    # cancel them, the worker would still be busy with them and refuse more.
    body = {"messages": MESSAGES, "stream": True, "max_tokens": MAX_CONTEXT // 2, "ignore_eos": True}
    for _ in range(3):
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data:"):
                    break  # the role chunk: walk away
    time.sleep(0.5)
    results = [
        sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0) for _ in range(2)
    ]
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    assert httpx.get(f"{base_url}/health").status_code == 200
