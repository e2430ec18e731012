"""The serving endpoints beyond chat (issue 16): model ids, /v1/completions,
/tokenize and /detokenize, CORS, /metrics series, and a conversation that
ends with an assistant message. Scripted model output through the real
tokenizer, engine, worker and HTTP front."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from musegl_core.config import ServeConfig
from musegl_core.http.model_ids import ModelIds, slug
from musegl_core.testing.server import running_server, scripted_plugin_env

RAW = "<|start|>user<|message|>Count?<|eot|><|start|>assistant"
SCRIPT = [
    {"when": "Count?", "reply": " to=user<|message|>one two three<|eot|>"},
    {"when": "391", "reply": " to=user<|message|>closed<|eot|>"},
    {"when": "Hi", "reply": " to=user<|message|>hello<|eot|>"},
]
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    with scripted_plugin_env(tmp_path_factory.mktemp("endpoints"), SCRIPT):
        config = ServeConfig(
            model=str(default_model_path()),
            port=0,
            executor="scripted",
            max_context=512,
            served_model_aliases=("alias-one", "alias-two"),
            cors_allow_origins=(ORIGIN,),
        )
        with running_server(config) as running:
            yield running


@pytest.fixture(scope="module")
def sdk(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def sse_payloads(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


# -- model ids -------------------------------------------------------------------------------
def test_slug():
    assert slug("Tiny Muse Glimmer") == "Tiny-Muse-Glimmer"
    assert slug("Muse Glimmer 30B (Q8_0)") == "Muse-Glimmer-30B-Q8_0"
    assert slug("  ") == "musegl"
    ids = ModelIds.resolve("x", ("y", "x"), None)
    assert ids.listed == ("x", "y") and ids.accepts("musegl") and not ids.accepts("z")


def test_served_id_is_a_slug_of_the_checkpoint_and_aliases_are_listed(server, sdk):
    listed = [m.id for m in sdk.models.list()]
    served = listed[0]
    assert " " not in served and served != "musegl"
    assert listed == [served, "alias-one", "alias-two"]
    for model_id in (served, "alias-two", "musegl"):
        assert sdk.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError) as info:
        sdk.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"
    # the request's model field stays lenient; responses carry the served id
    reply = sdk.completions.create(model="anything", prompt=RAW, max_tokens=4)
    assert reply.model == served


# -- /v1/completions -----------------------------------------------------------------------
def test_completion_from_raw_text(sdk):
    reply = sdk.completions.create(model="m", prompt=RAW, max_tokens=64)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    (choice,) = reply.choices
    assert choice.text == " to=user<|message|>one two three"
    assert choice.finish_reason == "stop"
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_completion_from_token_ids_matches_tokenize(server, sdk):
    ids = post(server, "/tokenize", {"prompt": RAW}).json()["tokens"]
    by_ids = sdk.completions.create(model="m", prompt=ids, max_tokens=64)
    by_text = sdk.completions.create(model="m", prompt=RAW, max_tokens=64)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens


def test_completion_limits_and_stops(sdk):
    short = sdk.completions.create(model="m", prompt=RAW, max_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
    stopped = sdk.completions.create(model="m", prompt=RAW, max_tokens=64, stop=["two"])
    assert stopped.choices[0].text == " to=user<|message|>one "
    assert stopped.choices[0].finish_reason == "stop"


def test_completion_stream(sdk):
    chunks = list(sdk.completions.create(model="m", prompt=RAW, max_tokens=64, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == " to=user<|message|>one two three"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completion_stream_ends_with_done(server):
    body = {"prompt": RAW, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    assert all(json.loads(p)["object"] == "text_completion" for p in payloads[:-1])


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "end"}, "suffix"),
        ({"logprobs": 1}, "logprobs"),
        ({"prompt": ["a", "b"]}, "prompt"),
    ],
)
def test_completion_unsupported_parameters_are_named(server, fields, param):
    response = post(server, "/v1/completions", {"prompt": RAW, **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt[1]"),
        ({"temperature": 3}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_completion_bad_values_are_400(server, fields, param):
    response = post(server, "/v1/completions", {"prompt": RAW, **fields})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_completion_context_overflow_and_bad_ids(server):
    response = post(server, "/v1/completions", {"prompt": RAW, "max_tokens": 100_000})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    response = post(server, "/v1/completions", {"prompt": [1, 10**9]})
    assert response.status_code == 400


# -- /tokenize and /detokenize ----------------------------------------------------------------
def test_tokenize_messages_counts_what_chat_sends(server, sdk):
    messages = [{"role": "user", "content": "Hi"}]
    counted = post(server, "/tokenize", {"messages": messages}).json()
    assert counted["count"] == len(counted["tokens"]) and counted["max_model_len"] == 512
    reply = sdk.chat.completions.create(model="m", messages=messages)
    assert reply.usage.prompt_tokens == counted["count"]
    text = post(server, "/detokenize", {"tokens": counted["tokens"]}).json()["prompt"]
    assert text.startswith("<|begin_of_text|><|start|>system") and text.endswith("Hi<|eot|><|start|>assistant")


def test_tokenize_detokenize_round_trip(server):
    tokens = post(server, "/tokenize", {"prompt": RAW}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": tokens}).json() == {"prompt": RAW}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
    ],
)
def test_tokenize_errors(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


# -- chat: a final assistant message -----------------------------------------------------------
def test_conversation_ending_with_an_assistant_message_is_answered(server, sdk):
    messages = [{"role": "user", "content": "What is 17 * 23?"}, {"role": "assistant", "content": "391"}]
    reply = sdk.chat.completions.create(model="m", messages=messages)
    assert reply.choices[0].message.content == "closed"
    rendered = post(server, "/detokenize",
                    {"tokens": post(server, "/tokenize", {"messages": messages}).json()["tokens"]}).json()
    assert rendered["prompt"].endswith("<|start|>assistant to=user<|message|>391<|eot|><|start|>assistant")
    response = post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"


# -- CORS ----------------------------------------------------------------------------------------
def test_cors_allows_the_configured_origin_only(server):
    preflight = httpx.options(
        f"{server.url}/v1/chat/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"},
    )
    assert preflight.status_code in (200, 204)
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    simple = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_cors_is_off_by_default():
    from litestar.testing import TestClient

    from musegl_core.http.app import create_app
    from musegl_core.plugins.manager import PluginManager
    from musegl_core.worker.client import WorkerClient

    config = ServeConfig().validate()
    app = create_app(config, PluginManager(only=[]), WorkerClient(config), manage_worker=False)
    with TestClient(app) as client:
        response = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert "access-control-allow-origin" not in response.headers
        assert client.options("/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"}
                              ).headers.get("access-control-allow-origin") is None


# -- /metrics --------------------------------------------------------------------------------------
def sample(text: str, name: str, **labels) -> float:
    """The value of one series in Prometheus text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_metrics_count_requests_tokens_and_latencies(server, sdk):
    before = httpx.get(f"{server.url}/metrics").text
    reply = sdk.completions.create(model="m", prompt=RAW, max_tokens=64)
    post(server, "/v1/completions", {"prompt": RAW, "echo": True})
    after = httpx.get(f"{server.url}/metrics").text

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("musegl_http_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("musegl_http_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("musegl_prompt_tokens_total") == reply.usage.prompt_tokens
    assert delta("musegl_generated_tokens_total") == reply.usage.completion_tokens
    assert delta("musegl_time_to_first_token_seconds_count") == 1
    assert delta("musegl_request_latency_seconds_count") == 1
    assert delta("musegl_request_queue_seconds_count") == 1
    assert delta("musegl_inter_token_latency_seconds_count") == reply.usage.completion_tokens - 1
    for name in ("musegl_requests_running", "musegl_requests_waiting", "musegl_cached_prompt_tokens_total"):
        assert name in after
    # every step is counted under one kind; a lone request never shares a step with another's prefill
    kinds = ("decode", "mixed", "prefill")
    assert sum(delta(f"musegl_engine_{kind}_steps_total") for kind in kinds) == delta("musegl_engine_steps_total")
    assert delta("musegl_engine_decode_step_decode_rows_total") == reply.usage.completion_tokens - 1
    assert delta("musegl_engine_mixed_steps_total") == 0
    assert delta("musegl_engine_prefill_step_prefill_rows_total") >= 1  # the prompt (or its uncached end)
