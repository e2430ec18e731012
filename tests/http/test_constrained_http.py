"""Constrained decoding, logprobs and the sampling fields through the HTTP API
on the random-weight demo model (whose free output is noise)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import pytest

from litestar.testing import TestClient

from musegl_core.config import ServeConfig
from musegl_core.http.app import create_app
from musegl_core.plugins.manager import PluginManager
from musegl_core.testing.server import running_server
from musegl_core.worker.client import WorkerClient

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -5, "maximum": 5},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                           "ok": {"type": "boolean"}},
            "required": ["zip", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "address"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 7},
                       "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "ns.lookup", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2}},
        "required": ["ids"]}}},
]


@pytest.fixture(scope="module")
def server():
    from musegl_core.tiny import default_model_path

    config = ServeConfig(model=str(default_model_path()), port=0, max_context=2048, tool_parser="atem",
                         constrained_reasoning_tokens=4, max_inflight_requests=8, max_sessions=8)
    with running_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def front():
    """The app in-process with the same settings and no worker: requests that pass every check get 503."""
    config = ServeConfig(max_context=2048, tool_parser="atem", constrained_reasoning_tokens=4,
                         max_inflight_requests=8, max_sessions=8).validate()
    with TestClient(create_app(config, PluginManager(only=["atem"]), WorkerClient(config),
                               manage_worker=False)) as client:
        yield client


def chat(server, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)


def stream(server, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True, **extra}
    content, reasoning, calls, logprobs = "", "", [], []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                reasoning += delta.get("reasoning_content") or ""
                calls += delta.get("tool_calls") or []
                logprobs += (choice.get("logprobs") or {}).get("content") or []
    return content, reasoning, calls, logprobs


def test_json_schema_answers_validate_and_stream_identically(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        response = chat(server, response_format=fmt, seed=seed, temperature=1.0)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        content, reasoning, _, _ = stream(server, response_format=fmt, seed=seed, temperature=1.0)
        assert content == choice["message"]["content"]
        assert reasoning == (choice["message"].get("reasoning_content") or "")


def test_greedy_constrained_runs_are_reproducible_and_top_level_json_schema_is_the_same(server):
    first = chat(server, json_schema=SCHEMA, temperature=0).json()["choices"][0]["message"]["content"]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    second = chat(server, response_format=fmt, temperature=0).json()["choices"][0]["message"]["content"]
    assert first == second
    jsonschema.validate(json.loads(first), SCHEMA)


def test_json_object_answers_parse(server):
    # Random weights never end a free string on their own; favouring the quote
    # token (logit_bias) makes every string short, so answers end within max_tokens.
    quote = httpx.post(f"{server.url}/tokenize", json={"prompt": '"'}, timeout=30).json()["tokens"][0]
    for seed in range(3):
        response = chat(server, response_format={"type": "json_object"}, seed=seed, logit_bias={str(quote): 30})
        assert response.status_code == 200, response.text
        assert isinstance(json.loads(response.json()["choices"][0]["message"]["content"]), dict)


def test_tool_choice_required_and_named_always_yield_valid_calls(server):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        for choice, allowed in (("required", set(schemas)),
                                ({"type": "function", "function": {"name": "ns.lookup"}}, {"ns.lookup"})):
            response = chat(server, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=400)
            assert response.status_code == 200, response.text
            result = response.json()["choices"][0]
            assert result["finish_reason"] == "tool_calls"
            assert result["message"]["tool_calls"]
            for call in result["message"]["tool_calls"]:
                assert call["function"]["name"] in allowed
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
            _, _, calls, _ = stream(server, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=400)
            assert [c["function"] for c in calls] == [c["function"] for c in result["message"]["tool_calls"]]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "json_schema": {"type": "object"}}, "json_schema"),
    ({"json_schema": {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object"}}, "json_schema"),
    ({"grammar_lazy": True}, "grammar_lazy"),
    ({"grammar_triggers": [{"type": "word", "value": "x"}]}, "grammar_triggers"),
    ({"grammar": "root ::= \"a\""}, "grammar"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
])
def test_constraints_and_sampling_fields_it_cannot_honour_are_400(front, extra, param):
    """The front refuses these before anything reaches a worker (in-process, no worker)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = front.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_logit_bias_id_outside_the_vocabulary_is_400(server):
    """The worker checks the ids against the served vocabulary."""
    response = chat(server, max_tokens=4, logit_bias={"999999999": 1})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logit_bias"


def test_logprobs_concatenate_to_content_and_are_sorted(server):
    for stream_it in (False, True):
        body = dict(logprobs=True, top_logprobs=3, max_tokens=30, temperature=0.9, seed=7)
        if stream_it:
            content, _, _, entries = stream(server, **body)
        else:
            choice = chat(server, **body).json()["choices"][0]
            content, entries = choice["message"]["content"], choice["logprobs"]["content"]
            reasoning = choice["message"].get("reasoning_content") or ""
            assert "".join(e["token"] for e in choice["logprobs"]["reasoning_content"]) == reasoning
        assert entries and "".join(e["token"] for e in entries) == content
        for entry in entries:
            tops = [t["logprob"] for t in entry["top_logprobs"]]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert entry["logprob"] <= tops[0] + 1e-5
            assert bytes(entry["bytes"]) == entry["token"].encode()
    greedy = chat(server, logprobs=True, top_logprobs=1, max_tokens=10, temperature=0).json()["choices"][0]
    for entry in greedy["logprobs"]["content"]:  # greedy picks the most likely id
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-5)


def completion(server, **extra):
    body = {"model": "m", "prompt": "<|start|>user<|message|>hello<|eot|><|start|>assistant", "max_tokens": 12,
            "temperature": 0, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_each_sampling_field_has_an_effect(server):
    base = completion(server)
    x = httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, timeout=30).json()["tokens"]
    assert len(x) == 1
    assert completion(server, logit_bias={str(x[0]): 100}, max_tokens=5) == "xxxxx"  # a large bias forces an id
    # A moderate bias makes greedy decoding repeat "x"; each penalty breaks the repetition.
    favour = {str(x[0]): 4.0}
    assert completion(server, logit_bias=favour, max_tokens=8) == "x" * 8
    assert completion(server, logit_bias=favour, frequency_penalty=2.0, max_tokens=8) != "x" * 8
    assert completion(server, logit_bias={str(x[0]): 1.5}, presence_penalty=2.0, max_tokens=8) != "x" * 8
    slight = {str(x[0]): 1.0}
    assert completion(server, logit_bias=slight, max_tokens=8) == "x" * 8
    assert completion(server, logit_bias=slight, repetition_penalty=10.0, max_tokens=8).startswith("x")
    assert completion(server, logit_bias=slight, repetition_penalty=10.0, max_tokens=8) != "x" * 8
    # repetition_penalty also counts the prompt's ids: a favoured id of the prompt ("he" of "hello") loses
    he = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello"}, timeout=30).json()["tokens"][0]
    first = completion(server, logit_bias={str(he): 1.0}, max_tokens=1)
    assert first == httpx.post(f"{server.url}/detokenize", json={"tokens": [he]}, timeout=30).json()["prompt"]
    assert completion(server, logit_bias={str(he): 1.0}, repetition_penalty=10.0, max_tokens=1) != first
    # min_p 1 keeps only the most likely id: sampling at temperature 1 becomes greedy.
    assert completion(server, temperature=1.0, min_p=1.0, seed=3, max_tokens=20) == completion(server, max_tokens=20)
    assert completion(server, temperature=1.0, seed=3, max_tokens=20) != completion(server, max_tokens=20)


def test_sampler_logprob_matches_an_independent_computation():
    torch = pytest.importorskip("torch")
    from musegl_core.engine.executor import SamplingParams, SeqChunk
    from musegl_cuda.sampling import SampleRows, sample

    rng = np.random.default_rng(0)
    vocab = 100
    logits = torch.tensor(rng.normal(size=(1, vocab)) * 3, dtype=torch.float32)
    mask = np.zeros(-(-vocab // 32), dtype=np.uint32)
    for i in (3, 17, 40, 99):
        mask[i // 32] |= np.uint32(1 << (i % 32))
    params = SamplingParams(temperature=0.7, seed=1, logit_bias=((17, 2.0),))
    rows = SampleRows()
    rows.add_chunk(SeqChunk(seq=0, tokens=[1], positions=[0], blocks=[0], sample=1, sampling=params,
                            uniforms=[0.3], masks=[mask], logprobs=2))
    ids, lps = sample(logits.clone(), rows)
    z = logits[0].numpy().astype(np.float64).copy()
    z[17] += 2.0
    allowed = np.array([3, 17, 40, 99])
    masked = np.full(vocab, -np.inf)
    masked[allowed] = z[allowed] / 0.7
    expected = masked - np.log(np.exp(masked[allowed]).sum())
    assert ids[0] in allowed
    assert lps[0].logprob == pytest.approx(expected[ids[0]], abs=1e-4)
    assert list(lps[0].top_ids) == list(allowed[np.argsort(-expected[allowed])][:2])


def test_strict_tools_leave_output_without_a_call_free(server):
    # The noise model never opens a tool call here: with strict tools the
    # (lazily activated) call grammar never starts and greedy output is unchanged.
    def greedy(strict):
        tools = [{**t, "function": {**t["function"], "strict": strict}} for t in TOOLS]
        response = chat(server, tools=tools, temperature=0, max_tokens=40)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]

    assert greedy(True) == greedy(False)


def test_a_grammar_that_fails_during_generation_fails_the_request_never_frees_it(server):
    # Preflight cannot see it (a finite instance, no pattern); llguidance's parser gives up
    # at the answer's first token. The request fails with 400 constraint_failed; a stream
    # gets the error event and no answer text (issue 25 item 7).
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "array", "items": {"const": "a"}, "minItems": 30000}}}
    response = chat(server, response_format=fmt, max_tokens=40, temperature=0)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "constraint_failed"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True,
            "temperature": 0, "response_format": fmt}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "constraint_failed"
    assert not "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    # the server goes on: the next constrained request is enforced
    fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"enum": ["yes", "no"]}}}
    response = chat(server, response_format=fmt, max_tokens=40, temperature=0)
    assert response.status_code == 200 and json.loads(response.json()["choices"][0]["message"]["content"]) in (
        "yes", "no")


def test_llama_cpp_json_object_schema_is_enforced(server):
    # issue 25 item 10: {"type": "json_object", "schema": ...} used to answer any object
    for schema, check in (({"const": "42"}, lambda v: v == "42"),
                          ({"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 2},
                           lambda v: isinstance(v, list) and len(v) == 2 and set(v) <= {1, 2})):
        response = chat(server, response_format={"type": "json_object", "schema": schema}, temperature=0, max_tokens=40)
        assert response.status_code == 200, response.text
        value = json.loads(response.json()["choices"][0]["message"]["content"])
        jsonschema.validate(value, schema)
        assert check(value)


FAVOURED = 500  # a token id logit_bias makes the greedy choice at every position


def usage_and_text(response, text_of):
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"], text_of(body["choices"][0])


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_stop_token_ids_end_generation_and_min_tokens_holds_them_off(server, route):
    def run(**extra):
        if route == "chat":
            response = chat(server, temperature=0, max_tokens=8, **extra)
            return usage_and_text(response, lambda c: c["message"]["content"])
        body = {"model": "m", "prompt": "hi", "temperature": 0, "max_tokens": 8, **extra}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        return usage_and_text(response, lambda c: c["text"])

    bias = {"logit_bias": {str(FAVOURED): 100}}
    reason, tokens, text = run(**bias)
    assert (reason, tokens) == ("length", 8) and text  # the favoured id, again and again
    # drawn at once, it ends generation; its text is not part of the answer
    assert run(stop_token_ids=[FAVOURED], **bias) == ("stop", 1, "")
    # min_tokens: it is masked for the first 3 ids, then drawn as the 4th
    reason, tokens, text = run(stop_token_ids=[FAVOURED], min_tokens=3, **bias)
    assert (reason, tokens) == ("stop", 4) and text
    # end-of-generation ids are held off the same way
    eot = httpx.post(f"{server.url}/tokenize", json={"prompt": "<|eot|>"}, timeout=30).json()["tokens"][0]
    assert run(logit_bias={str(eot): 100})[:2] == ("stop", 1)
    assert run(logit_bias={str(eot): 100}, min_tokens=5)[:2] == ("stop", 6)


def test_min_tokens_applies_stop_strings_after_its_first_ids_only(server):
    def greedy(**extra):
        response = chat(server, temperature=0, max_tokens=12, logprobs=True, **extra)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["finish_reason"], [e["token"] for e in choice["logprobs"]["content"]]

    _, pieces = greedy()
    second = pieces[1]  # the text of the 2nd generated id
    assert greedy(stop=[second])[1] == pieces[:1]
    assert greedy(stop=[second], min_tokens=1)[1] == pieces[:1]  # the stop lies in id 2's text: applied
    reason, kept = greedy(stop=[second], min_tokens=2)  # wholly in the first 2 ids' text: not a stop (vLLM)
    assert second not in pieces[2:] and (reason, kept) == ("length", pieces)


def test_parallel_tool_calls_false_with_tool_choice_required_yields_one_call(server):
    # issue 25 item 10: greedy decoding repeated calls until max_tokens ended the
    # turn, and the truncated call set reached the client as no call at all
    def run(**extra):
        response = chat(server, tools=TOOLS[:1], tool_choice="required", temperature=0, max_tokens=512, **extra)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["finish_reason"], choice["message"].get("tool_calls") or [], response.json()["usage"]

    reason, calls, usage = run()
    if reason == "length":  # the whole call set was cut: dropped, and finish_reason says so
        assert not calls and usage["completion_tokens"] == 512
    reason, calls, usage = run(parallel_tool_calls=False)
    assert reason == "tool_calls" and len(calls) == 1 and usage["completion_tokens"] < 512
    arguments = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])
