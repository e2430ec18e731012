"""Request validation, error shapes and the model-free endpoints of the HTTP front.

These tests need no model: validation happens before anything is submitted,
and the worker is never started (``/health`` reports 503, a valid chat
request gets 503 ``unavailable_error`` once it has passed every check).
"""

from __future__ import annotations

import asyncio

import pytest
from litestar.testing import TestClient

from musegl_core.config import ServeConfig
from musegl_core.http.schemas import to_json
from musegl_core.openai import schemas as s
from musegl_core.http import sse
from musegl_core.http.app import create_app
from musegl_core.engine.detokenize import IncrementalDetokenizer
from musegl_core.openai.chat import reasoning_tokens
from musegl_core.http.dialect import Dialect, ServedModel
from musegl_core.plugins.manager import PluginManager
from musegl_core.worker.client import WorkerClient

MESSAGES = [{"role": "user", "content": "Hello"}]
ERROR_KEYS = {"message", "type", "param", "code"}


def make_client(**overrides) -> TestClient:
    settings = {"max_image_bytes": 1024, "max_request_bytes": 4096, "max_context": 321, **overrides}
    config = ServeConfig(**settings).validate()
    app = create_app(config, PluginManager(only=[]), WorkerClient(config), manage_worker=False)
    return TestClient(app)


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        yield c


def chat(client: TestClient, **fields):
    return client.post("/v1/chat/completions", json={"messages": MESSAGES, **fields})


def assert_error(response, status: int, type_: str = "invalid_request_error", code=None, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert error["type"] == type_
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


# -- body parsing ---------------------------------------------------------------------------
@pytest.mark.parametrize("body", [b"{not json", b"", b"\xff\xfe", b'{"messages": [}'])
def test_malformed_json_is_400(client, body):
    response = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_error(response, 400)


@pytest.mark.parametrize("body", [b"[]", b'"hello"', b"42", b"null"])
def test_non_object_body_is_400(client, body):
    response = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_error(response, 400)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop[1]"),
        ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
        ({"stream_options": []}, "stream_options"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"session_id": 12}, "session_id"),
        ({"reasoning": "high"}, "reasoning"),
        ({"reasoning": {"exclude": "yes"}}, "reasoning.exclude"),
        ({"include_reasoning": 0}, "include_reasoning"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"model": 3}, "model"),
        ({"chat_template_kwargs": {"current_date": 20260101}}, "chat_template_kwargs.current_date"),
    ],
)
def test_wrong_field_types_name_the_field(client, fields, param):
    assert_error(chat(client, **fields), 400, param=param)


# -- ranges and fixed values ----------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 2**70}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", ""]}, "stop[1]"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"session_id": "has space"}, "session_id"),
        ({"session_id": "x" * 129}, "session_id"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),  # --max-n 8
        ({"n": 5}, "n"),  # never fits --max-inflight-requests 4
        ({"n": 2, "session_id": "s"}, "n"),  # one session, one transcript
    ],
)
def test_out_of_range_values_are_400(client, fields, param):
    assert_error(chat(client, **fields), 400, param=param)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}},
         "response_format.json_schema.extra"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"reasoning": {"enabled": False}}, "reasoning.enabled"),
        ({"reasoning": {"effort": "minimal"}}, "reasoning.effort"),
        ({"reasoning": {"max_tokens": 100}}, "reasoning.max_tokens"),
        ({"reasoning_effort": "none"}, "reasoning_effort"),
        ({"reasoning_effort": "xhigh"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs.enable_thinking"),
        ({"chat_template_kwargs": {"reasoning_strength": "max"}}, "chat_template_kwargs.reasoning_strength"),
    ],
)
def test_unsupported_values_are_400_unsupported_parameter(client, fields, param):
    assert_error(chat(client, **fields), 400, code="unsupported_parameter", param=param)


@pytest.mark.parametrize("field", s.REJECTED_FIELDS)
def test_reject_list(client, field):
    assert_error(chat(client, **{field: "x"}), 400, code="unsupported_parameter", param=field)


@pytest.mark.parametrize(
    "fields",
    [
        {"reasoning_effort": "low", "reasoning": {"effort": "high"}},
        {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_strength": "medium"}},
        {"include_reasoning": True, "reasoning": {"exclude": True}},
        {"include_reasoning": False, "reasoning": {"exclude": False}},
    ],
)
def test_contradictory_reasoning_controls_are_400(client, fields):
    assert_error(chat(client, **fields), 400)


def test_session_header_and_body_must_agree(client):
    response = client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "session_id": "a"},
        headers={"X-Session-Id": "b"},
    )
    assert_error(response, 400, param="session_id")
    bad = client.post("/v1/chat/completions", json={"messages": MESSAGES}, headers={"X-Session-Id": "no/slash"})
    assert_error(bad, 400, param="X-Session-Id")


def test_tools_without_a_tool_parser_are_unsupported(client):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    assert_error(chat(client, tools=tools), 400, code="unsupported_parameter", param="tools")
    assert_error(chat(client, tools=tools, tool_choice="auto"), 400, code="unsupported_parameter", param="tools")


# -- accepted requests reach the (unstarted) worker -----------------------------------------
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {key: None for key in s.REJECTED_FIELDS},
        {"tools": None, "tool_choice": None, "n": None, "logprobs": None, "stop": None, "seed": None},
        {"tools": [], "n": 1, "logprobs": False, "response_format": {"type": "text"}},
        {"n": 4, "seed": 2**64 - 1, "stream": True},
        {"add_generation_prompt": True, "continue_final_message": False, "user": "u", "metadata": {"k": "v"}},
        {"reasoning": {}, "reasoning_effort": "medium", "include_reasoning": False},
        {"reasoning": {"effort": "low", "exclude": None, "enabled": True}, "reasoning_effort": "low"},
        {"reasoning": {"exclude": True}, "include_reasoning": False},
        {"chat_template_kwargs": {"current_date": "2026-02-03", "knowledge_cutoff": "2025-01-01"}},
        {"stop": ["a", "b", "c", "d"], "max_tokens": 4, "max_completion_tokens": 4, "seed": -1},
        {"temperature": 0, "top_p": 1, "top_k": 0, "ignore_eos": True, "stream": True},
        {"session_id": "chat-1:a.b_c", "parallel_tool_calls": True},
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "none",
        },
    ],
)
def test_valid_requests_pass_validation(client, fields):
    # The worker never started: a request that passed every check is refused
    # with 503, not 400.
    assert_error(chat(client, **fields), 503, type_="unavailable_error")


def test_bad_messages_are_400(client):
    assert_error(client.post("/v1/chat/completions", json={}), 400)
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400)
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400)


def test_unprefixed_alias_validates_the_same(client):
    response = client.post("/chat/completions", json={"messages": MESSAGES, "n": 0})
    assert_error(response, 400, param="n")


# -- other endpoints and HTTP-level errors -------------------------------------------------
def test_unknown_path_is_404_in_error_shape(client):
    assert_error(client.get("/v1/responses"), 404, type_="not_found_error")
    assert_error(client.post("/v1/embeddings", json={}), 404, type_="not_found_error")


def test_wrong_method_is_an_error_object(client):
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert set(response.json()["error"]) == ERROR_KEYS


def test_oversized_body_is_413(client):
    response = chat(client, padding="x" * 8192)
    assert_error(response, 413, code="request_too_large")


@pytest.mark.parametrize("path", ["/health", "/v1/health"])
def test_health_is_503_until_the_worker_is_ready(client, path):
    assert_error(client.get(path), 503, type_="unavailable_error")


@pytest.mark.parametrize("path", ["/v1/models", "/models"])
def test_models_lists_the_served_model(path):
    with make_client(served_model_name="muse-test", max_context=321) as c:
        response = c.get(path)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    (entry,) = body["data"]
    assert entry["id"] == "muse-test"
    assert entry["object"] == "model"
    assert entry["owned_by"] == "musegl"
    assert entry["context_length"] == entry["max_model_len"] == 321
    assert "demo" not in entry


def test_models_marks_the_demo_model():
    with make_client(demo=True) as c:
        (entry,) = c.get("/v1/models").json()["data"]
    assert entry["demo"] is True
    assert "random" in entry["description"].lower()


def test_api_key_guards_everything_but_health():
    with make_client(api_key="sekret") as c:
        assert_error(c.get("/v1/models"), 401, type_="authentication_error")
        assert_error(chat(c), 401, type_="authentication_error")
        wrong = c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401, type_="authentication_error")
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/health").status_code == 503  # public, just not ready


# -- wire pieces -------------------------------------------------------------------------
def test_chunk_shapes():
    role = to_json(s.ChatCompletionChunk("c", 1, "m", "fp", [s.ChunkChoice(s.RoleDelta())]))
    assert role["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}
    assert "usage" not in role
    finish = s.ChatCompletionChunk("c", 1, "m", "fp", [s.ChunkChoice(s.Delta(), "stop")])
    assert to_json(finish)["choices"][0]["delta"] == {}
    usage = s.Usage(3, 2, 5)
    tail = Dialect().stream_tail(finish, usage)
    assert [to_json(c)["choices"] for c in tail] == [to_json(finish)["choices"], []]
    assert to_json(tail[1])["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert Dialect().stream_tail(finish, None) == [finish]


def test_openai_stream_error_then_done():
    from musegl_core.errors import ApiError

    events = Dialect().stream_error(ApiError(502, "bad call", "server_error", "invalid_tool_output"), None)
    assert events[0] == sse.data_event(
        {"error": {"message": "bad call", "type": "server_error", "param": None, "code": "invalid_tool_output"}}
    )
    assert events[-1] == sse.DONE


def test_model_entry_for_plain_model():
    entry = to_json(Dialect().model_entry(ServedModel("m", 5, 100)))
    assert entry == {
        "id": "m",
        "created": 5,
        "context_length": 100,
        "max_model_len": 100,
        "input_modalities": ["text"],
        "object": "model",
        "owned_by": "musegl",
        # read by the Anthropic SDK too
        "type": "model",
        "display_name": "m",
        "created_at": "1970-01-01T00:00:05Z",
    }


def test_keepalive_is_sent_while_idle():
    async def slow():
        await asyncio.sleep(0.25)
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    async def collect():
        return [item async for item in sse.with_keepalive(slow(), sse.comment("ka"), interval=0.05)]

    items = asyncio.run(collect())
    assert items[-2:] == [b"data: 1\n\n", b"data: 2\n\n"]
    keepalives = items[:-2]
    assert len(keepalives) >= 2 and set(keepalives) == {b": ka\n\n"}


def test_7_reasoning_tokens_are_exact_ids_of_self_messages():
    """The ids of a ``to=self`` message (header, body,
    terminator) count, whatever the Tokens events' grouping; multi-byte
    characters split over ids and content ids do not count."""
    from musegl_core.chat.channels import ChannelParser
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    tokenizer = MuseTokenizer.load(default_model_path())
    reasoning = " to=self<|message|>Add them, é😀.<|eom|>"
    content = "<|start|>assistant to=user<|message|>4 😀"
    ids = tokenizer.encode(reasoning, special=True)
    expected = len(ids)
    ids += tokenizer.encode(content, special=True) + [tokenizer.eos_id]
    # What the worker reports: per id, the characters its detokenizer added (EOS adds none).
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(i) for i in ids[:-1]] + [""]
    chars = [len(piece) for piece in pieces]
    assert 0 in chars[: len(ids) - 1]  # a multi-byte character split over ids: its first ids add nothing
    for group in (1, 2, 3, 7, len(ids)):  # however the text arrives in Tokens events
        parser = ChannelParser(tools_active=False)
        for i in range(0, len(ids), group):
            parser.feed("".join(pieces[i : i + group]))
        parser.finish("eos")
        assert reasoning_tokens(parser.message_starts, chars) == expected


# -- request rules that need no worker (in-process; a valid request gets 503) --------------
@pytest.mark.parametrize(("salt", "needle"), [
    ("", "1-256 characters"),
    ("x" * 257, "1-256 characters"),
    (7, "expected a string"),
    (["a"], "expected a string"),
])
def test_a_bad_salt_is_a_400_naming_it(client, salt, needle):
    for path, field, value in (("/v1/chat/completions", "messages", MESSAGES), ("/v1/completions", "prompt", "hi")):
        response = client.post(path, json={"model": "m", field: value, "cache_salt": salt})
        error = assert_error(response, 400, param="cache_salt")
        assert needle in error["message"], error


def test_n_with_a_session_or_out_of_range_is_400():
    with make_client(max_n=8, max_inflight_requests=4, max_sessions=8) as client:
        error = assert_error(chat(client, n=2, session_id="s1"), 400, param="n")
        assert "session" in error["message"]
        refused = client.post("/v1/chat/completions", headers={"X-Session-Id": "s2"},
                              json={"model": "m", "messages": MESSAGES, "n": 2})
        assert_error(refused, 400, param="n")
        for n in (0, 5, 9):  # 5: more than --max-inflight-requests 4 can ever run; 9: over --max-n 8
            assert_error(chat(client, n=n), 400, param="n")
        assert_error(chat(client, n=4), 503, "unavailable_error")  # valid: it reaches the (absent) worker
