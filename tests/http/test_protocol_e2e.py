"""The chat protocol end to end: scripted model output through the real tokenizer,
engine, worker and HTTP front, read with the official ``openai`` SDK and with raw
SSE parsing.

Each test's docstring says the behaviour it checks.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server, scripted_plugin_env

ADD = " to=self<|message|>Add them.<|eom|><|start|>assistant to=user<|message|>4<|eot|>"
SCRIPT = [
    {"when": "What is 2+2?", "reply": ADD},
    {"when": "Greek?", "reply": " to=self<|message|>Plan.<|eom|><|start|>assistant to=user<|message|>alpha beta gamma<|eot|>"},
    {"when": "Quote?", "reply": " to=user<|message|>Quoted: <|start|>assistant to=self<|message|>secret<|eot|>"},
    {"when": "Unicode?", "reply": " to=self<|message|>é😀 ok<|eom|><|start|>assistant to=user<|message|>日本😀<|eot|>"},
    {"when": "Ponder?", "reply": " to=self<|message|>" + "hmm " * 40 + "<|eom|><|start|>assistant to=user<|message|>ok<|eot|>"},
    {"when": "Fail?", "reply": " to=user<|message|>partial answer that never ends", "fail_after": 6},
    {"when": "Slow?", "reply": " to=user<|message|>late<|eot|>", "prefill_delay": 1.5},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    with scripted_plugin_env(tmp_path_factory.mktemp("protocol"), SCRIPT):
        config = ServeConfig(
            model=str(default_model_path()),
            port=0,
            executor="scripted",
            max_context=1024,
            streaming_preflight_timeout=0.5,
        )
        with running_server(config) as running:
            yield running


@pytest.fixture(scope="module")
def tokenizer():
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    return MuseTokenizer.load(default_model_path())


@pytest.fixture(scope="module")
def sdk(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()  # idle keep-alive connections would hold up the server's shutdown


def ask(question: str, **fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": question}], **fields}


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def sse_events(server, body: dict) -> tuple[httpx.Response, list]:
    """Raw SSE: every ``data:`` payload (JSON, or the string ``[DONE]``) in order;
    comment lines (keepalives) are skipped, as SSE requires."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r, []
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
            else:
                assert line == "" or line.startswith(":"), line
        return r, events


def joined(events: list, field: str) -> str:
    return "".join(
        e["choices"][0]["delta"].get(field) or "" for e in events if isinstance(e, dict) and e.get("choices")
    )


# -- reasoning visibility ---------------------------------------
def test_api_2_4_reasoning_shown_by_default_with_sdk(sdk):
    reply = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 2+2?"}])
    message = reply.choices[0].message
    assert message.content == "4"
    assert message.model_extra["reasoning_content"] == "Add them."
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "visibility", [{"reasoning": {"exclude": True}}, {"include_reasoning": False}], ids=["exclude", "include_false"]
)
def test_api_2_4_hidden_reasoning_is_absent_buffered_and_streamed(server, visibility):
    message = post(server, ask("What is 2+2?", **visibility)).json()["choices"][0]["message"]
    assert message["content"] == "4" and "reasoning_content" not in message
    _, events = sse_events(server, ask("What is 2+2?", **visibility))
    assert joined(events, "content") == "4"
    assert not any("reasoning_content" in e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"])


@pytest.mark.parametrize(
    "visibility",
    [{"include_reasoning": True}, {"reasoning": {"exclude": False, "enabled": True}}, {"reasoning": {}}],
)
def test_api_2_4_noop_visibility_options_keep_reasoning(server, visibility):
    message = post(server, ask("What is 2+2?", **visibility)).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Add them."


def test_seed_quoted_self_header_stays_visible_when_reasoning_hidden(server):
    """Hiding filters accepted reasoning messages, not header-shaped text."""
    for stream in (False, True):
        body = ask("Quote?", include_reasoning=False)
        if stream:
            _, events = sse_events(server, body)
            content = joined(events, "content")
        else:
            content = post(server, body).json()["choices"][0]["message"]["content"]
        assert content == "Quoted: <|start|>assistant to=self<|message|>secret"


# -- reasoning usage -----------------------------------------------------------------
def test_api_7_reasoning_tokens_are_the_exact_self_message_ids(server, tokenizer):
    reasoning_ids = len(tokenizer.encode(" to=self<|message|>Add them.<|eom|>", special=True))
    completion_ids = len(tokenizer.encode(ADD, special=True))  # generation ends at <|eot|>
    for visibility in ({}, {"include_reasoning": False}):
        usage = post(server, ask("What is 2+2?", **visibility)).json()["usage"]
        assert usage["completion_tokens"] == completion_ids
        assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning_ids}
        assert usage["total_tokens"] == usage["prompt_tokens"] + completion_ids


def test_api_7_reasoning_tokens_with_multibyte_text_streamed(server, tokenizer):
    expected = len(tokenizer.encode(" to=self<|message|>é😀 ok<|eom|>", special=True))
    _, events = sse_events(server, ask("Unicode?", stream_options={"include_usage": True}))
    assert joined(events, "reasoning_content") == "é😀 ok"
    assert joined(events, "content") == "日本😀"
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens_details"] == {"reasoning_tokens": expected}


def test_api_7_reasoning_tokens_omitted_when_stop_trimmed_or_ignore_eos(server):
    usage = post(server, ask("Greek?", stop=["beta"])).json()["usage"]
    assert "completion_tokens_details" not in usage
    usage = post(server, ask("What is 2+2?", ignore_eos=True, max_tokens=30)).json()["usage"]
    assert usage["completion_tokens"] == 30
    assert "completion_tokens_details" not in usage


def test_api_7_length_cut_inside_reasoning_counts_every_id(server):
    usage = post(server, ask("Ponder?", max_tokens=10)).json()["usage"]
    assert usage["completion_tokens"] == 10
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 10}


# -- stops and finish reasons -----------------------------------
def test_api_2_1_request_stop_is_removed_and_reported_as_stop(server):
    choice = post(server, ask("Greek?", stop=["beta"])).json()["choices"][0]
    assert choice["message"]["content"] == "alpha "
    assert choice["message"]["reasoning_content"] == "Plan."
    assert choice["finish_reason"] == "stop"


def test_seed_earliest_stop_wins_streamed_and_buffered(server):
    body = ask("Greek?", stop=["gamma", "a beta"])
    assert post(server, body).json()["choices"][0]["message"]["content"] == "alph"
    _, events = sse_events(server, body)
    assert joined(events, "content") == "alph"
    assert [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e["choices"]][-1] == "stop"


def test_api_3_finish_reasons_stop_and_length(server, sdk):
    assert post(server, ask("What is 2+2?")).json()["choices"][0]["finish_reason"] == "stop"
    reply = sdk.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Ponder?"}], max_completion_tokens=5
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content in (None, "")


def test_grammar_6_stop_inside_reasoning_keeps_no_partial_header(server):
    choice = post(server, ask("Greek?", stop=["<|eom|>"])).json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "Plan."
    assert choice["message"]["content"] in (None, "")
    assert choice["finish_reason"] == "stop"


# -- streaming semantics --------------------------------------------------------------
def test_api_4_2_raw_sse_chunk_sequence(server):
    response, events = sse_events(server, ask("What is 2+2?", stream_options={"include_usage": True}))
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    body = chunks[1:-2]
    for chunk in body:  # no empty deltas, no structural tokens
        delta = chunk["choices"][0]["delta"]
        assert delta and all(v for v in delta.values())
        assert chunk["choices"][0]["finish_reason"] is None
        assert not any(t in json.dumps(delta) for t in ("<|eom|>", "<|message|>", "<|start|>"))
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert joined(events, "reasoning_content") == "Add them." and joined(events, "content") == "4"


def test_api_5_2_no_usage_chunk_without_include_usage(server):
    _, events = sse_events(server, ask("What is 2+2?"))
    assert not any(isinstance(e, dict) and "usage" in e for e in events)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_api_4_sdk_stream_matches_non_stream(sdk):
    messages = [{"role": "user", "content": "Unicode?"}]
    stream = sdk.chat.completions.create(model="m", messages=messages, stream=True)
    content, reasoning, finish = "", "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        finish = chunk.choices[0].finish_reason or finish
    whole = sdk.chat.completions.create(model="m", messages=messages)
    assert content == whole.choices[0].message.content == "日本😀"
    assert reasoning == whole.choices[0].message.model_extra["reasoning_content"] == "é😀 ok"
    assert finish == whole.choices[0].finish_reason == "stop"


def test_api_4_3_error_after_headers_is_an_sse_error_then_done(server):
    response, events = sse_events(server, ask("Fail?"))
    assert response.status_code == 200
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "failed" in error["message"]
    assert "partial answer".startswith(joined(events, "content"))


def test_api_4_3_sdk_raises_on_the_sse_error(sdk):
    with pytest.raises(openai.APIError):
        for _ in sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "Fail?"}], stream=True):
            pass


def test_api_4_1_streaming_preflight_timeout_is_503_before_headers(server):
    response, _ = sse_events(server, ask("Slow?"))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "preflight_timeout"
    assert response.headers.get("retry-after")
    # Without streaming nothing bounds the wait.
    assert post(server, ask("Slow?")).json()["choices"][0]["message"]["content"] == "late"


def test_api_4_1_validation_errors_keep_their_status_when_streaming(server):
    response, _ = sse_events(server, ask("What is 2+2?", reasoning={"max_tokens": 5}))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "reasoning.max_tokens"
