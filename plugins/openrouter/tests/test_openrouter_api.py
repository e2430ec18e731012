"""The openrouter dialect end to end, driven by the official ``openai`` SDK
configured as an OpenRouter client (base_url, extra_body, attribution headers).

One real worker (tiny checkpoint, scripted executor) serves two fronts: the
``openrouter`` one, and an ``openai`` one whose plugin manager does not load
this plugin, as after ``pip uninstall musegl-openrouter``.
"""

from __future__ import annotations

import base64
import io
import json
import re
from typing import Any

import attrs
import httpx
import openai
import pytest

from openrouter_servers import FrontSpec, scripted_plugin_env, serving

from musegl_core.chat import channels
from musegl_core.config import ServeConfig
from musegl_core.errors import ApiError
from musegl_core.plugins import hookimpl
from musegl_core.plugins.specs import ToolParserSpec

MAX_CONTEXT = 1024
SERVED_NAME = "muse-tiny"
#: A history of this many notes (about 100 tokens each) overflows MAX_CONTEXT.
OVERFLOWING_NOTES = 12
#: How OpenRouter agent clients read a recoverable overflow.
CLIENT_PATTERN = re.compile(r"maximum context length is (\d+) tokens.*?(\d+) of text input.*?(\d+) in the output")
QUESTION = {"role": "user", "content": "Add two and two."}
CUT_REPLY = " to=self<|message|>Plan.<|eom|><|start|>assistant to=user<|message|>Done.<|eot|>"
#: multi-byte characters in reasoning and content: max_tokens cuts land inside them
EURO_REPLY = " to=self<|message|>Plan €.<|eom|><|start|>assistant to=user<|message|>Price: 5€ 😀 ok<|eot|>"
SCRIPT = [
    {"when": "Cut my header.", "reply": CUT_REPLY},  # before the entries a default system prompt matches
    {"when": "Cut my euro.", "reply": EURO_REPLY},
    {
        "when": "Weather in Paris?",
        "reply": " to=self<|message|>Checking the weather.<|eom|><|start|>assistant to=forecast.forecast"
        '<|message|>{"city": "Paris"}<|eot|>',
    },
    {"when": "Reasoning strength: low.", "reply": " to=self<|message|>Quick.<|eom|><|start|>assistant to=user<|message|>4<|eot|>"},
    {"when": "Reasoning strength: medium.", "reply": " to=self<|message|>Considering.<|eom|><|start|>assistant to=user<|message|>4<|eot|>"},
    {"when": "Reasoning strength: high.", "reply": " to=self<|message|>Thinking hard.<|eom|><|start|>assistant to=user<|message|>4<|eot|>"},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


# -- a test tool parser: calls must address a declared tool ---------------------------------
@attrs.frozen
class DeclaredCall:
    id: str
    name: str
    arguments: str


class DeclaredToolCalls:
    """Each tool message addressed to a declared tool is one call whose body is
    its JSON arguments; a call to an undeclared tool fails the response with
    ``invalid_tool_output``, as a validating parser does."""

    def __init__(self, tools: list[Any], options: dict[str, Any]):
        self.declared = {tool.name for tool in tools}
        self.aliases = dict(options.get("aliases", {}))
        self.messages: list[tuple[str, list[str]]] = []

    def feed(self, event: Any, at_end: bool = False) -> None:
        if not isinstance(event, channels.ToolDelta):
            return  # ToolMessageEnd: the next delta opens a new message anyway
        if not self.messages or self.messages[-1][0] != event.recipient:
            self.messages.append((event.recipient, []))
        self.messages[-1][1].append(event.text)

    def finish(self, end: str) -> list[DeclaredCall]:
        calls = []
        for recipient, parts in self.messages:
            name = self.aliases.get(recipient, recipient)
            if name not in self.declared:
                raise ApiError(502, f"the model called {name!r}, which the request does not declare",
                               "server_error", "invalid_tool_output")
            calls.append(DeclaredCall(f"call_{len(calls)}", name, "".join(parts).strip()))
        return calls


class DeclaredToolsPlugin:
    @hookimpl
    def musegl_tool_parsers(self):
        return [ToolParserSpec("declared", "calls to declared tools only (tests)", DeclaredToolCalls)]


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    config = ServeConfig(
        model=str(default_model_path()), port=0, executor="scripted", plugins=("scripted",),
        served_model_name=SERVED_NAME, max_context=MAX_CONTEXT,
    )
    fronts = {
        "openrouter": FrontSpec("openrouter", ("openrouter",), (("declared", DeclaredToolsPlugin()),), "declared"),
        "openai": FrontSpec("openai", ()),
    }
    with scripted_plugin_env(tmp_path_factory.mktemp("scripted"), SCRIPT):
        with serving(config, fronts) as running:
            yield running


@pytest.fixture(scope="module")
def client(urls) -> openai.OpenAI:
    """An OpenAI SDK client set up the way OpenRouter's quick-start does."""
    return openai.OpenAI(
        base_url=f"{urls['openrouter']}/v1",
        api_key="sk-or-v1-test",
        max_retries=0,
        default_headers={"HTTP-Referer": "https://example.org/muse-agent", "X-Title": "Muse agent"},
    )


@pytest.fixture(scope="module")
def openai_client(urls) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{urls['openai']}/v1", api_key="sk-test", max_retries=0)


def notes(count: int) -> list[dict[str, str]]:
    """A history of ``count`` user notes and acknowledgements (about 100 tokens a turn)."""
    text = "The quick brown fox jumps over the lazy dog near the river bank today. " * 2
    history = []
    for i in range(count):
        history += [{"role": "user", "content": f"Note {i}: {text}"}, {"role": "assistant", "content": "Noted."}]
    return history


def png_data_url() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 40, 40)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def sse_events(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of a stream (``"[DONE]"`` kept as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- a client-side compaction loop, as Muse-style agents run it -------------------------------
class OverflowNotRecoverable(Exception):
    """The server's overflow message does not say how much to compact."""


def compact(messages: list[dict[str, Any]], keep: float) -> list[dict[str, Any]]:
    """Drop the oldest turns (never system messages nor the last message) until at
    most ``keep`` of the text remains."""

    def size(items: list[dict[str, Any]]) -> int:
        return sum(len(json.dumps(item["content"])) for item in items)

    target = keep * size(messages)
    out = list(messages)
    while size(out) > target:
        index = next((i for i, m in enumerate(out[:-1]) if m["role"] != "system"), None)
        if index is None:
            break
        del out[index]
    return out


def create_with_compaction(client: openai.OpenAI, messages: list[dict[str, Any]], attempts: int = 4, **kwargs):
    """Send; on a parseable overflow shrink the history by the reported ratio (with
    a 10 % margin) and retry. Returns the response and the parsed overflows."""
    overflows: list[tuple[int, int, int]] = []
    while True:
        try:
            response = client.chat.completions.create(model="muse", messages=messages, **kwargs)
            if kwargs.get("stream"):
                response = list(response)
            return response, overflows
        except openai.BadRequestError as exc:
            match = CLIENT_PATTERN.search(exc.body.get("message", "")) if isinstance(exc.body, dict) else None
            if match is None:
                raise OverflowNotRecoverable(exc.body) from exc
            if len(overflows) == attempts:
                raise
            budget, text_input, output = map(int, match.groups())
            overflows.append((budget, text_input, output))
            messages = compact(messages, 0.9 * (budget - output) / text_input)


# -- /v1/models --------------------------------------------------------------------------------
def test_models_report_the_runtime_context_budget_in_the_openrouter_shape(client, urls):
    (model,) = client.models.list().data
    assert model.id == SERVED_NAME
    assert model.model_extra["context_length"] == MAX_CONTEXT
    entry = httpx.get(f"{urls['openrouter']}/v1/models").json()["data"][0]
    assert entry["top_provider"]["context_length"] == MAX_CONTEXT
    assert entry["top_provider"]["max_completion_tokens"] == MAX_CONTEXT - 1
    assert {"tools", "reasoning"} <= set(entry["supported_parameters"])


# -- reasoning ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("request_fields", "reasoning"),
    [
        ({"extra_body": {"reasoning": {"effort": "low"}}}, "Quick."),
        ({"reasoning_effort": "medium"}, "Considering."),
        ({}, "Thinking hard."),  # the template's default strength is high
    ],
)
def test_reasoning_effort_sets_the_strength_and_reasoning_has_both_names(client, request_fields, reasoning):
    reply = client.chat.completions.create(model="muse", messages=[QUESTION], **request_fields)
    message = reply.choices[0].message
    assert message.content == "4"
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == reasoning
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0


def test_hidden_reasoning_drops_both_names(client):
    reply = client.chat.completions.create(
        model="muse", messages=[QUESTION], extra_body={"reasoning": {"exclude": True}}
    )
    extra = reply.choices[0].message.model_extra or {}
    assert "reasoning" not in extra and "reasoning_content" not in extra


# -- stream usage --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "usage_request",
    [{"stream_options": {"include_usage": True}}, {"extra_body": {"usage": {"include": True}}}],
    ids=["stream_options", "legacy_usage_include"],
)
def test_stream_usage_rides_on_the_finish_chunk_exactly_once(client, usage_request):
    chunks = list(
        client.chat.completions.create(
            model="muse", messages=[QUESTION], stream=True, extra_headers={"X-Session-Id": "usage"}, **usage_request
        )
    )
    with_usage = [chunk for chunk in chunks if chunk.usage is not None]
    assert len(with_usage) == 1
    last = chunks[-1]
    assert last is with_usage[0]
    assert last.choices[0].finish_reason == "stop"
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(chunk.choices for chunk in chunks)  # no usage-only chunk with choices: []
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning") or "" for c in chunks)
    reasoning_content = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    assert reasoning == reasoning_content == "Thinking hard."
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "4"


def test_stream_without_a_usage_request_carries_no_usage(client, urls):
    chunks = list(client.chat.completions.create(model="muse", messages=[QUESTION], stream=True))
    assert all(chunk.usage is None for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_raw_stream_ends_with_the_finish_chunk_then_done(urls):
    body = {"model": "m", "messages": [QUESTION], "stream": True, "usage": {"include": True}}
    with httpx.stream("POST", f"{urls['openrouter']}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    finish = events[-2]
    assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert set(finish["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert sum("usage" in event for event in events[:-1]) == 1


# -- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_errors_before_headers_have_the_openrouter_shape(client, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="muse", messages=[QUESTION], stream=stream,
                                       extra_body={"grammar": 'root ::= "a"'})
    body = info.value.body
    assert body["code"] == 400 and isinstance(body["message"], str)
    assert body["metadata"]["error_code"] == "unsupported_parameter"
    assert body["metadata"]["param"] == "grammar"


def test_malformed_legacy_usage_switch_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="muse", messages=[QUESTION], extra_body={"usage": {"include": "yes"}})
    assert info.value.body["metadata"]["param"] == "usage.include"


def test_a_failure_after_headers_is_an_error_chunk_and_ends_the_stream(client, urls):
    request = {"model": "muse", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]}
    reasoning = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client.chat.completions.create(stream=True, **request):
            reasoning.append(chunk.choices[0].delta.model_extra.get("reasoning") or "")
    assert "".join(reasoning) == "Checking the weather."  # delivered before the failure
    assert info.value.body["code"] == 502
    assert info.value.body["metadata"]["error_code"] == "invalid_tool_output"

    with httpx.stream("POST", f"{urls['openrouter']}/v1/chat/completions", json={**request, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        events = sse_events(response)
    error = events[-1]
    assert "[DONE]" not in events
    assert error["object"] == "chat.completion.chunk" and error["id"] == events[0]["id"]
    assert error["choices"] == [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]
    assert error["error"]["code"] == 502 and "forecast" in error["error"]["message"]


def test_the_same_failure_without_streaming_is_a_502(client):
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(
            model="muse", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL]
        )
    assert info.value.status_code == 502
    assert info.value.body["metadata"]["error_code"] == "invalid_tool_output"


# -- context overflow and reactive compaction ---------------------------------------------------
def test_text_overflow_is_found_before_admission_and_compaction_recovers(client):
    reply, overflows = create_with_compaction(client, notes(OVERFLOWING_NOTES) + [QUESTION])
    assert reply.choices[0].message.content == "4"
    assert overflows and all(budget == MAX_CONTEXT - 1 and output == 0 for budget, _, output in overflows)
    assert overflows[0][1] > MAX_CONTEXT - 1
    assert reply.usage.prompt_tokens <= MAX_CONTEXT - 1

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="muse", messages=notes(OVERFLOWING_NOTES) + [QUESTION])
    metadata = info.value.body["metadata"]
    assert metadata == {
        "error_code": "context_length_exceeded",
        "error_type": "invalid_request_error",
        "param": "messages",
        "context_length": MAX_CONTEXT,
        "prompt_tokens": overflows[0][1],
        "prompt_tokens_exact": False,  # tokenizing stopped once the count passed the budget: a lower bound
        "max_prompt_tokens": MAX_CONTEXT - 1,  # no max_tokens: one token is reserved
        "completion_reservation": 1,
        "source": "worker",
    }


def test_streaming_overflow_is_a_400_before_headers_and_compaction_recovers(client):
    chunks, overflows = create_with_compaction(
        client, notes(OVERFLOWING_NOTES - 1) + [QUESTION], stream=True, max_tokens=64, stream_options={"include_usage": True}
    )
    assert overflows and all(budget == MAX_CONTEXT - 64 for budget, _, _ in overflows)
    assert chunks[-1].usage.prompt_tokens <= MAX_CONTEXT - 64
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "4"


def test_image_prompts_are_counted_by_the_worker_and_compaction_recovers(client):
    image_turn = {
        "role": "user",
        "content": [{"type": "text", "text": "Look at this."}, {"type": "image_url", "image_url": {"url": png_data_url()}}],
    }
    history = [image_turn, {"role": "assistant", "content": "A red square."}] + notes(OVERFLOWING_NOTES)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="muse", messages=history + [QUESTION])
    assert info.value.body["metadata"]["source"] == "worker"
    assert CLIENT_PATTERN.search(info.value.body["message"])
    # The compaction loop keeps the newest turns; the image turn is the oldest.
    reply, overflows = create_with_compaction(client, history + [QUESTION])
    assert overflows and reply.choices[0].message.content == "4"


def test_prompts_are_counted_once_bos_included(client):
    fitting = client.chat.completions.create(model="muse", messages=[QUESTION])
    prompt = fitting.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="muse", messages=[QUESTION], max_tokens=MAX_CONTEXT - prompt + 1)
    metadata = info.value.body["metadata"]
    assert metadata["source"] == "worker" and metadata["prompt_tokens"] == prompt
    assert CLIENT_PATTERN.search(info.value.body["message"]).groups() == (str(prompt - 1), str(prompt), "0")


def test_a_reservation_that_fills_the_window_is_not_retried(client):
    messages = [QUESTION]
    with pytest.raises(OverflowNotRecoverable) as info:
        create_with_compaction(client, messages, max_tokens=MAX_CONTEXT)
    body = info.value.args[0]
    assert CLIENT_PATTERN.search(body["message"]) is None
    assert CLIENT_PATTERN.search(str(body)) is None
    assert body["metadata"]["context_length"] == MAX_CONTEXT
    assert body["metadata"]["completion_reservation"] == MAX_CONTEXT
    assert body["metadata"]["prompt_tokens"] > 0


# -- the openai dialect, with this plugin not loaded ------------------------------------------
def test_openai_dialect_keeps_its_usage_chunk_and_refuses_the_legacy_switch(openai_client):
    chunks = list(
        openai_client.chat.completions.create(
            model="muse", messages=[QUESTION], stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-2].usage is None
    # OpenRouter's switch is not Chat Completions': refused by name, never silently ignored (issue 47 item 20)
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model="muse", messages=[QUESTION], stream=True,
                                              extra_body={"usage": {"include": True}})
    assert info.value.body["param"] == "usage" and info.value.body["code"] == "unsupported_parameter"


def test_openai_dialect_errors_on_overflow(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model="muse", messages=notes(OVERFLOWING_NOTES) + [QUESTION])
    body = info.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == "context_length_exceeded"
    assert body["param"] == "messages" and f"maximum context length is {MAX_CONTEXT} tokens" in body["message"]
    assert "metadata" not in body


# -- generation cut inside a header (issue 25 item 8) ----------------------------------------
def _cut_answer(url: str, max_tokens: int, stream: bool, question: str = "Cut my header.") -> tuple[str, str]:
    body = {"model": "muse", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "stream": stream}
    if not stream:
        message = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        return message.get("content") or "", message.get("reasoning_content") or ""
    content = reasoning = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        for event in sse_events(response):
            for choice in event["choices"] if isinstance(event, dict) else ():
                content += choice["delta"].get("content") or ""
                reasoning += choice["delta"].get("reasoning_content") or ""
    return content, reasoning


def test_a_header_cut_by_max_tokens_never_reaches_the_client(urls):
    """' to', ' to=', ... ' to=user': framing the model did not finish is
    dropped, streamed or not, in both dialects (the openai front loads no plugin)."""
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    tokenizer = MuseTokenizer.load(str(default_model_path()))
    ids = tokenizer.encode(CUT_REPLY, special=True)
    for count in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:count])
        expected = channels.parse_output(text, tools_active=False, end="length")
        want = (expected.content or "", expected.reasoning or "")
        assert " to" not in want[0] and "to=" not in want[0] + want[1], (text, want)
        for url in urls.values():
            for stream in (False, True):
                assert _cut_answer(url, count, stream) == want, (url, count, stream, text)
    assert want == ("Done.", "Plan.")


def test_a_cut_inside_a_multibyte_character_streams_the_same_text(urls):
    """Issue 25 item 11: the bytes of a character that max_tokens cut short
    are U+FFFD in the streamed deltas exactly as in the non-streamed answer."""
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    tokenizer = MuseTokenizer.load(str(default_model_path()))
    ids = tokenizer.encode(EURO_REPLY, special=True)
    cut_inside = 0
    for count in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:count])  # an incomplete character decodes as U+FFFD
        expected = channels.parse_output(text, tools_active=False, end="length")
        want = (expected.content or "", expected.reasoning or "")
        cut_inside += "\ufffd" in "".join(want)
        for url in urls.values():
            assert _cut_answer(url, count, False, "Cut my euro.") == want, (url, count, text)
            assert _cut_answer(url, count, True, "Cut my euro.") == want, (url, count, text)
    assert cut_inside >= 4  # the euro sign in both channels, and the emoji
