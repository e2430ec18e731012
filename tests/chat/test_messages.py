"""Parsing the OpenAI ``messages`` and ``tools`` fields."""

from __future__ import annotations

import base64

import pytest

from musegl_core.chat.messages import ImagePart, Message, TextPart, parse_messages, parse_tools
from musegl_core.chat.tools import resolve_tool_name, tool_aliases
from musegl_core.errors import ApiError

PNG_BYTES = b"\x89PNG\r\n\x1a\n"
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG_BYTES).decode()


def image(url=PNG_URL, **extra):
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def rejects(raw, param, code=None, parse=parse_messages):
    with pytest.raises(ApiError) as info:
        parse(raw)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_roles_and_content_forms():
    """Roles system/developer/user/assistant/tool; content str, null or parts."""
    messages = parse_messages(
        [
            {"role": "developer", "content": "D"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, image()]},
            {"role": "assistant", "content": None, "reasoning": "r"},
            {"role": "tool", "content": "x", "tool_call_id": "c", "name": "n"},
        ]
    )
    assert messages[0] == Message("developer", "D")
    assert messages[1].content == (TextPart("a"), ImagePart(PNG_URL, "image/png", PNG_BYTES))
    assert messages[2].reasoning_content == "r"
    assert (messages[3].tool_call_id, messages[3].name) == ("c", "n")


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        (["hi"], "messages[0]"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": "x", "name": 3}], "messages[0].name"),
        ([{"role": "user", "content": "x", "tool_calls": [{}]}], "messages[0].tool_calls"),
        ([{"role": "assistant", "reasoning_content": 1}], "messages[0].reasoning_content"),
    ],
)
def test_malformed_messages_name_the_field(raw, param):
    """Malformed messages → 400 invalid_request_error naming the field."""
    rejects(raw, param)


def test_tool_call_arguments_parsed_in_order():
    """Arguments JSON string → object with key order; "" counts as {}."""
    raw = [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"z": 1, "a": [2]}'}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}},
            ],
        }
    ]
    calls = parse_messages(raw)[0].tool_calls
    assert list(calls[0].function.arguments.items()) == [("z", 1), ("a", [2])]
    assert calls[1].function.arguments == {}


@pytest.mark.parametrize("arguments", ["[1]", "1", "{bad", "NaN", 5])
def test_tool_call_arguments_must_be_an_object(arguments):
    """Arguments that are not a JSON object → 400."""
    raw = [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": arguments}}]}]
    rejects(raw, "messages[0].tool_calls[0].function.arguments")


def test_tool_call_needs_a_name():
    """A tool call's function name is a non-empty string."""
    raw = [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "", "arguments": "{}"}}]}]
    rejects(raw, "messages[0].tool_calls[0].function.name")


@pytest.mark.parametrize(
    ("part", "param"),
    [
        (image("https://example.com/a.png"), "messages[0].content[0].image_url.url"),
        (image("file:///tmp/a.png"), "messages[0].content[0].image_url.url"),
        (image("data:image/gif;base64,R0lG"), "messages[0].content[0].image_url.url"),
        (image("data:image/png;base64,***"), "messages[0].content[0].image_url.url"),
        (image(detail="medium"), "messages[0].content[0].image_url.detail"),
        (image(detail=1), "messages[0].content[0].image_url.detail"),
    ],
)
def test_image_rules(part, param):
    """Inline PNG/JPEG base64 only, detail auto/low/high → else 400 invalid_image."""
    rejects([{"role": "user", "content": [part]}], param, "invalid_image")


@pytest.mark.parametrize("detail", ["auto", "low", "high", None])
def test_image_detail_is_accepted(detail):
    """OpenAI's detail levels (many clients send "auto" by default); the worker maps them to
    the patch budget (docs/vision.md)."""
    part = image(detail=detail)
    assert parse_messages([{"role": "user", "content": [part]}])[0].content[0].detail == detail


@pytest.mark.parametrize(("url", "named"), [
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "image/gif"),
    ("data:image/webp;base64,UklGRg==", "image/webp"),
    ("data:image/svg+xml;base64,PHN2Zz4=", "image/svg+xml"),
    ("data:application/octet-stream;base64,AAAA", "application/octet-stream"),
])
def test_an_unsupported_format_is_named(url, named):
    with pytest.raises(ApiError) as info:
        parse_messages([{"role": "user", "content": [image(url)]}])
    error = info.value
    assert (error.status, error.code) == (400, "invalid_image")
    assert named in error.message and "PNG or JPEG" in error.message
    assert "not fetched" not in error.message


def test_a_remote_url_says_it_is_not_fetched_and_raw_data_urls_need_base64():
    for url, needle in (("https://example.com/a.png", "not fetched"), ("data:image/png,rawbytes", "base64")):
        with pytest.raises(ApiError) as info:
            parse_messages([{"role": "user", "content": [image(url)]}])
        assert needle in info.value.message


def test_at_most_one_image_across_history():
    """More than one image across the whole history → 400 invalid_image."""
    raw = [{"role": "user", "content": [image()]}, {"role": "user", "content": [{"type": "text", "text": "x"}, image()]}]
    rejects(raw, "messages[1].content[1]", "invalid_image")


def test_jpeg_accepted():
    """JPEG data URLs are accepted."""
    url = "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff").decode()
    assert parse_messages([{"role": "user", "content": [image(url)]}])[0].content[0].media_type == "image/jpeg"


def test_tools_forms():
    """OpenAI and bare tool forms; null and [] are no tools."""
    assert parse_tools(None) == [] and parse_tools([]) == []
    tools = parse_tools(
        [
            {"type": "function", "function": {"name": "a.b", "description": "D", "parameters": {"type": "object"}, "strict": True}},
            {"name": "flat"},
        ]
    )
    assert [(t.name, t.description, t.strict) for t in tools] == [("a.b", "D", True), ("flat", None, None)]


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        ({}, "tools", None),
        ([{"type": "retrieval"}], "tools[0].type", None),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name", None),
        ([{"type": "function", "function": {"name": 'a"b'}}], "tools[0].function.name", "invalid_tool_schema"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters", None),
        ([{"type": "function", "function": {"name": "f", "description": 1}}], "tools[0].function.description", None),
    ],
)
def test_malformed_tools(raw, param, code):
    """Malformed tool declarations → 400 naming the field."""
    rejects(raw, param, code, parse=parse_tools)


def test_alias_helpers():
    """Aliases map back; the flat name is also accepted."""
    aliases = tool_aliases(["get_time", "weather.get_forecast"])
    assert aliases == {"get_time.get_time": "get_time", "weather.get_forecast": "weather.get_forecast"}
    assert resolve_tool_name("get_time.get_time", aliases) == "get_time"
    assert resolve_tool_name("get_time", aliases) == "get_time"
    assert resolve_tool_name("weather", aliases) is None
