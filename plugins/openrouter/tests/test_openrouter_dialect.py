"""The OpenRouter dialect's wire pieces, without a server."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from musegl_core.engine.errors import ContextTooLong
from musegl_core.errors import ApiError, ConfigError
from musegl_core.http.schemas import ModelList, to_json
from musegl_core.openai import schemas as s
from musegl_core.http.dialect import Dialect, ServedModel
from musegl_core.worker.errors import api_error
from musegl_core.plugins.manager import PluginManager
from musegl_openrouter.dialect import OpenRouterDialect
from musegl_openrouter.overflow import RECOVERABLE_PATTERN, OverflowCounts, overflow_message

#: The pattern OpenRouter clients use to read a recoverable overflow.
CLIENT_PATTERN = re.compile(r"maximum context length is (\d+) tokens.*?(\d+) of text input.*?(\d+) in the output")

dialect = OpenRouterDialect()


def _chunk() -> s.ChatCompletionChunk:
    return s.ChatCompletionChunk("chatcmpl-1", 1700000000, "muse", "musegl-0.1.0-scripted", [])


def _usage() -> s.Usage:
    return s.Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10)


# -- plugin registration ------------------------------------------------------------------
def test_the_entry_point_provides_the_dialect():
    plugins = PluginManager(only=["openrouter"])
    assert isinstance(plugins.get("dialects", "openrouter").create(), OpenRouterDialect)
    assert "openai" in plugins.specs("dialects")


def test_without_the_plugin_the_openai_dialect_remains_and_openrouter_names_the_plugin():
    plugins = PluginManager(only=[])
    assert type(plugins.get("dialects", "openai").create()) is Dialect
    with pytest.raises(ConfigError, match="musegl-openrouter"):
        plugins.get("dialects", "openrouter")


def test_serve_accepts_the_dialect_when_the_plugin_is_loaded():
    from musegl_core.cli.serve import prepare

    config, plugins, _ = prepare(["--plugin", "cuda", "--plugin", "openrouter", "--api-dialect", "openrouter"])
    assert config.api_dialect == "openrouter"
    assert isinstance(plugins.get("dialects", "openrouter").create(), OpenRouterDialect)


def test_serve_without_the_plugin_exits_2_naming_it():
    result = subprocess.run(
        [sys.executable, "-m", "musegl_core.cli.main", "serve", "--plugin", "cuda", "--api-dialect", "openrouter"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "musegl-openrouter" in result.stderr and "openrouter" in result.stderr.splitlines()[-1]


# -- requests -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("payload", "include_usage"),
    [
        ({"usage": {"include": True}}, True),
        ({"usage": {"include": False}}, False),
        ({"usage": {"include": True}, "stream_options": {"include_usage": True}}, True),
        ({"usage": {"include": True}, "stream_options": {}}, True),
    ],
)
def test_legacy_usage_switch_becomes_stream_options(payload, include_usage):
    adapted = dialect.adapt_request({"messages": [], **payload})
    assert "usage" not in adapted
    assert adapted["stream_options"]["include_usage"] is include_usage
    assert s.structure_request(adapted).stream_options.include_usage is include_usage


@pytest.mark.parametrize("payload", [{}, {"usage": None}, {"usage": {}}, {"usage": {"include": None}}])
def test_absent_usage_switch_changes_nothing(payload):
    adapted = dialect.adapt_request({"messages": [], **payload})
    assert "usage" not in adapted and "stream_options" not in adapted


@pytest.mark.parametrize(
    ("usage", "param", "code"),
    [
        ("yes", "usage", None),
        ({"include": "true"}, "usage.include", None),
        ({"include": True, "cost": True}, "usage.cost", "unsupported_parameter"),
    ],
)
def test_malformed_usage_switch_is_a_400_naming_the_field(usage, param, code):
    with pytest.raises(ApiError) as info:
        dialect.adapt_request({"usage": usage})
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_contradicting_usage_switches_are_refused():
    with pytest.raises(ApiError) as info:
        dialect.adapt_request({"usage": {"include": True}, "stream_options": {"include_usage": False}})
    assert info.value.param == "usage.include" and "contradicts" in info.value.message


def test_the_openai_dialect_does_not_know_the_usage_switch():
    payload = {"messages": [], "usage": {"include": True}}
    assert Dialect().adapt_request(payload) is payload
    with pytest.raises(ApiError) as refused:  # unknown to Chat Completions: refused, not ignored (issue 47 item 20)
        s.structure_request(payload)
    assert refused.value.param == "usage" and refused.value.code == "unsupported_parameter"


@pytest.mark.parametrize("field, value", [("provider", {"order": ["x"]}), ("transforms", ["middle-out"]),
                                          ("models", ["a", "b"])])
def test_openrouter_routing_fields_are_refused_not_ignored(field, value):
    """Issue 47 item 20: one server is one provider and one model, and no prompt transform runs."""
    payload = dialect.adapt_request({"messages": [{"role": "user", "content": "x"}], field: value})
    with pytest.raises(ApiError) as refused:
        s.structure_request(payload)
    assert refused.value.param == field and refused.value.code == "unsupported_parameter"


# -- errors ---------------------------------------------------------------------------------
def test_error_body_has_a_numeric_code_and_the_musegl_code_in_metadata():
    error = ApiError(400, "'logprobs' are not supported", "invalid_request_error", "unsupported_parameter", "logprobs")
    body = dialect.error_body(error)
    assert body == {
        "error": {
            "code": 400,
            "message": "'logprobs' are not supported",
            "metadata": {
                "error_code": "unsupported_parameter",
                "error_type": "invalid_request_error",
                "param": "logprobs",
            },
        }
    }


def test_error_without_a_code_reports_its_type_as_error_code():
    body = dialect.error_body(ApiError(503, "loading", "unavailable_error", retry_after=1))
    assert body["error"]["metadata"]["error_code"] == "unavailable_error"
    assert dialect.error_headers(ApiError(503, "loading", "unavailable_error", retry_after=1)) == {"Retry-After": "1"}


def test_mid_stream_error_is_a_chunk_with_a_top_level_error_and_no_done():
    error = ApiError(502, "undeclared tool", "server_error", "invalid_tool_output")
    events = dialect.stream_error(error, _chunk())
    assert len(events) == 1
    text = events[0].decode()
    assert text.startswith("data: ") and text.endswith("\n\n") and "[DONE]" not in text
    payload = json.loads(text.removeprefix("data: "))
    assert payload["id"] == "chatcmpl-1" and payload["object"] == "chat.completion.chunk"
    assert payload["choices"] == [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]
    assert payload["error"] == {
        "code": 502,
        "message": "undeclared tool",
        "metadata": {"error_code": "invalid_tool_output", "error_type": "server_error"},
    }


# -- context overflow -----------------------------------------------------------------------
def test_recoverable_overflow_wording_is_pinned_by_the_clients_pattern():
    body = dialect.error_body(api_error(ContextTooLong(600, 1, 512)))["error"]
    match = CLIENT_PATTERN.search(body["message"])
    assert match is not None
    budget, text_input, output = map(int, match.groups())
    assert (budget, text_input, output) == (511, 600, 0)
    assert text_input + output - budget == 89  # exactly what must be compacted away
    assert body["message"].startswith(
        "This endpoint's maximum context length is 511 tokens. However, you requested about 600 tokens "
        "(600 of text input, 0 in the output)."
    )
    assert body["metadata"] == {
        "error_code": "context_length_exceeded",
        "error_type": "invalid_request_error",
        "param": "messages",
        "context_length": 512,
        "prompt_tokens": 600,
        "max_prompt_tokens": 511,
        "completion_reservation": 1,
        "source": "worker",
    }
    assert RECOVERABLE_PATTERN.pattern.startswith(CLIENT_PATTERN.pattern)


def test_reservation_filling_the_window_keeps_diagnostics_but_is_not_recoverable():
    for reservation in (512, 4096):
        error = api_error(ContextTooLong(12, reservation, 512))
        body = dialect.error_body(error)["error"]
        assert CLIENT_PATTERN.search(body["message"]) is None
        assert "context length" not in body["message"]
        assert f"{reservation} tokens" in body["message"]
        assert body["metadata"]["context_length"] == 512
        assert body["metadata"]["prompt_tokens"] == 12
        assert body["metadata"]["completion_reservation"] == reservation


def test_one_token_short_of_the_window_is_still_recoverable():
    counts = OverflowCounts(context_length=512, prompt_tokens=3, completion_reservation=511)
    assert counts.recoverable and counts.max_prompt_tokens == 1
    assert CLIENT_PATTERN.search(overflow_message(counts)).groups() == ("1", "3", "0")


def test_overflow_without_counts_is_not_recoverable():
    error = ApiError(400, "This model's maximum context length is 512 tokens.", code="context_length_exceeded")
    message = dialect.error_body(error)["error"]["message"]
    assert CLIENT_PATTERN.search(message) is None and "context length" not in message
    assert OverflowCounts.from_metadata({"context_length": 512, "prompt_tokens": "x"}) is None


# -- streams, reasoning, models -------------------------------------------------------------
def test_usage_rides_on_the_finish_chunk_once():
    finish = attrs_finish = s.ChatCompletionChunk(
        "c", 1, "m", "f", [s.ChunkChoice(delta=s.Delta(), finish_reason="stop")]
    )
    (tail,) = dialect.stream_tail(attrs_finish, _usage())
    assert tail.choices == finish.choices and tail.usage == _usage()
    assert dialect.stream_tail(finish, None) == [finish]
    assert len(Dialect().stream_tail(finish, _usage())) == 2  # the openai dialect keeps its usage chunk


def test_reasoning_goes_out_under_both_names():
    assert dialect.reasoning_fields("because") == {"reasoning_content": "because", "reasoning": "because"}
    message = to_json(s.AssistantMessage(content="4", **dialect.reasoning_fields("because")))
    assert message["reasoning"] == message["reasoning_content"] == "because"
    assert "reasoning" not in to_json(s.AssistantMessage(content="4", **dialect.reasoning_fields(None)))


def test_model_entry_has_the_openrouter_shape_around_the_runtime_budget():
    model = ServedModel(name="muse", created=1700000000, context_length=2048, backend="cuda", tool_calling=True,
                        vision=True)
    entry = to_json(ModelList(data=[dialect.model_entry(model)]))["data"][0]
    assert entry["id"] == entry["name"] == "muse"
    assert entry["context_length"] == entry["max_model_len"] == 2048
    assert entry["top_provider"] == {"context_length": 2048, "max_completion_tokens": 2047, "is_moderated": False}
    assert list(entry["architecture"]["input_modalities"]) == ["text", "image"]
    assert set(entry["pricing"].values()) == {"0"}
    assert {"reasoning", "tools", "tool_choice", "max_tokens"} <= set(entry["supported_parameters"])
    assert entry["object"] == "model" and entry["owned_by"] == "musegl"
    plain = to_json(dialect.model_entry(ServedModel(name="m", created=1, context_length=64)))
    assert "tools" not in plain["supported_parameters"]
    # a text-only load (no vision projector) does not advertise image input
    assert list(plain["architecture"]["input_modalities"]) == ["text"]
    assert plain["architecture"]["modality"] == "text->text"
    assert entry["architecture"]["modality"] == "text+image->text"


def test_keepalive_is_an_sse_comment():
    assert dialect.keepalive.startswith(b":") and dialect.keepalive.endswith(b"\n\n")


def test_an_overflow_counted_to_a_lower_bound_says_so_where_the_client_reads_it():
    """Issue 47 item 18: a prompt whose counting stopped at the budget (``exact`` False) was
    reported as "about 93 tokens (93 of text input" though it held 101: clients compacted too little."""
    body = dialect.error_body(api_error(ContextTooLong(93, 1, 64, exact=False)))["error"]
    match = CLIENT_PATTERN.search(body["message"])
    assert match is not None and tuple(map(int, match.groups())) == (63, 93, 0)
    assert "at least 93 tokens (at least 93 of text input" in body["message"]
    assert "about 93" not in body["message"]
    assert body["metadata"]["prompt_tokens_exact"] is False
