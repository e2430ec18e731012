"""The Anthropic Messages surface end to end: scripted model output through the real
tokenizer, engine, worker, ATEM tool parser and front, read with the official
``anthropic`` SDK (typed) and as raw SSE checked against the stream grammar."""

from __future__ import annotations

import base64
import io
import json

import anthropic
import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.tiny import default_model_path
from musegl_core.testing.server import running_server, scripted_plugin_env

from stream_grammar import check_stream, parse_sse

WRITE = {"name": "Write", "description": "Write a file",
         "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"},
                                                           "content": {"type": "string"}},
                          "required": ["file_path", "content"]}}


def atem(name: str, params: list[tuple[str, str]]) -> str:
    body = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in params)
    return f'<atem:function_calls>\n<atem:invoke name="{name}">\n{body}</atem:invoke>\n</atem:function_calls>'


CALL = (" to=self<|message|>Use Write.<|eom|><|start|>assistant to=Write.Write<|message|>"
        + atem("Write.Write", [("file_path", "hello.txt"), ("content", "hi")]) + "<|eot|>")
TWO = (" to=Write.Write<|message|>" + atem("Write.Write", [("file_path", "a.txt"), ("content", "a")])
       + "<|eom|><|start|>assistant to=Write.Write<|message|>"
       + atem("Write.Write", [("file_path", "b.txt"), ("content", "b")]) + "<|eot|>")
THOUGHT = "Let me think about this step by step."
SCRIPT = [
    {"when": "</tool_output>", "reply": " to=self<|message|>It worked.<|eom|><|start|>assistant to=user<|message|>Done.<|eot|>"},
    {"when": "Create hello.txt", "reply": CALL},
    {"when": "Two files", "reply": TWO},
    {"when": "Say hi", "reply": " to=self<|message|>Greet.<|eom|><|start|>assistant to=user<|message|>Hello there<|eot|>"},
    {"when": "Think in pieces", "pieces": [" to=self<|message|>", *THOUGHT, "<|eom|><|start|>assistant to=user<|message|>",
                                           "Answer.<|eot|>"]},
    {"when": "Count to ten", "reply": " to=user<|message|>one two STOP three four<|eot|>"},
    {"when": "Ramble", "reply": " to=user<|message|>" + "word " * 60 + "<|eot|>"},
    {"when": "Fill the window", "reply": " to=user<|message|>word", "eos": False},
    {"when": "Fail midway", "reply": " to=user<|message|>partial answer that never ends", "fail_after": 6},
    {"when": "Slow start", "reply": " to=user<|message|>late<|eot|>", "prefill_delay": 1.5},
    {"when": "JSON please", "reply": ' to=user<|message|>{"ok": true}<|eot|>'},
    {"when": "", "reply": " to=user<|message|>ok<|eot|>"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with scripted_plugin_env(tmp_path_factory.mktemp("anthropic"), SCRIPT):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", tool_parser="atem",
                             max_context=2048, max_sessions=4)
        with running_server(config) as running:
            yield running


@pytest.fixture(scope="module")
def client(server):
    sdk = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    yield sdk
    sdk.close()


def post(server, body: dict, headers: dict | None = None, path: str = "/v1/messages?beta=true") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers or {}, timeout=60)


def stream_events(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{server.url}/v1/messages?beta=true", json={**body, "stream": True},
                      headers=headers or {}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return parse_sse(response.read().decode())


def ask(text: str, **extra) -> dict:
    return {"model": "claude-sonnet-4-5", "max_tokens": 256, "messages": [{"role": "user", "content": text}], **extra}


#: thinking with a budget needs max_tokens above it
BUDGET = {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1500}


# -- shapes ---------------------------------------------------------------------------------
def test_a_plain_answer_with_the_sdk(client):
    message = client.messages.create(**ask("Say hi"))
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == "claude-sonnet-4-5"  # the client's name comes back: any model name is served
    assert [block.type for block in message.content] == ["text"]  # no thinking asked for: none returned
    assert message.content[0].text == "Hello there"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens > 0 and usage.input_tokens + usage.cache_read_input_tokens > 20
    assert usage.cache_creation_input_tokens == 0


def test_thinking_blocks_come_first_with_a_signature(client):
    message = client.messages.create(**ask("Say hi", **BUDGET))
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Greet." and thinking.signature
    assert text.text == "Hello there"
    adaptive = client.messages.create(**ask("Say hi"), thinking={"type": "adaptive", "display": "omitted"})
    assert adaptive.content[0].type == "thinking" and adaptive.content[0].thinking == ""
    assert adaptive.content[0].signature


def test_system_blocks_inline_system_roles_and_the_billing_nonce(server):
    def prompt(nonce: str) -> str:
        body = ask("Say hi", system=[{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={nonce};"},
                                     {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}])
        body["messages"].insert(0, {"role": "system", "content": "Inline rule."})
        response = post(server, body, path="/v1/messages/count_tokens")
        assert response.status_code == 200, response.text
        return response.json()["input_tokens"]

    assert prompt("a1b2c") == prompt("zz9") > 0  # the nonce does not reach the prompt


def test_the_billing_blocks_conversation_fingerprint_is_normalised():
    from musegl_anthropic.request import normalise_billing

    def line(fingerprint: str, cch: str = "") -> str:
        return f"x-anthropic-billing-header: cc_version=2.1.328.{fingerprint}; cc_entrypoint=sdk-cli;{cch}"

    assert normalise_billing(line("a1f")) == normalise_billing(line("07c")) == (
        "x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=sdk-cli;")
    assert normalise_billing(line("a1f", " cch=5e3d1;")) == normalise_billing(line("b22", " cch=00aa9;"))
    assert normalise_billing("cc_version=2.1.328.a1f;") == "cc_version=2.1.328.a1f;"  # only the billing block
    assert normalise_billing("x-anthropic-billing-header: cc_version=2.1.328;") == (
        "x-anthropic-billing-header: cc_version=2.1.328;")  # a version without a fingerprint stays whole


def test_count_tokens_matches_the_prompt_of_a_generation(client):
    body = ask("Say hi", tools=[WRITE])
    counted = client.messages.count_tokens(model=body["model"], messages=body["messages"], tools=body["tools"])
    message = client.messages.create(**body)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_a_tool_call_and_the_tool_result_round_trip(client):
    first = client.messages.create(**ask("Create hello.txt"), tools=[WRITE])
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "Write" and call.input == {"file_path": "hello.txt", "content": "hi"}
    assert call.id.startswith("toolu_")
    second = client.messages.create(
        model="m", max_tokens=256, tools=[WRITE],
        messages=[{"role": "user", "content": "Create hello.txt"},
                  {"role": "assistant", "content": [block.model_dump() for block in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "ok"}]}])
    assert second.stop_reason == "end_turn" and second.content[-1].text == "Done."


def test_stop_sequences_max_tokens_and_the_context_window(client):
    stopped = client.messages.create(**ask("Count to ten"), stop_sequences=["STOP"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "STOP"
    assert stopped.content[0].text == "one two "
    cut = client.messages.create(**{**ask("Ramble"), "max_tokens": 5})
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 5
    full = client.messages.create(**{**ask("Fill the window"), "max_tokens": 4000})  # the context (2048) ends first
    assert full.stop_reason == "model_context_window_exceeded"
    assert full.usage.input_tokens + full.usage.cache_read_input_tokens + full.usage.output_tokens == 2048


def test_json_schema_output_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    message = client.messages.create(**ask("JSON please"), output_config={"format": {"type": "json_schema",
                                                                                    "schema": schema}})
    assert json.loads(message.content[0].text) == {"ok": True}


def test_an_image_in_base64(client):
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buffer, format="PNG")
    data = base64.b64encode(buffer.getvalue()).decode()
    message = client.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "Say hi"}]}])
    assert message.content[-1].text == "Hello there"


# -- streaming ------------------------------------------------------------------------------
def test_the_stream_grammar_with_thinking_text_and_a_tool_call(server):
    events = stream_events(server, ask("Create hello.txt", tools=[WRITE], thinking={"type": "adaptive"}))
    message = check_stream(events)
    assert [block["type"] for block in message["content"]] == ["thinking", "tool_use"]
    assert message["content"][0]["signature"] and message["stop_reason"] == "tool_use"
    assert message["content"][1]["input"] == {"file_path": "hello.txt", "content": "hi"}
    start = events[0][1]["message"]["usage"]
    final = events[-2][1]["usage"]
    assert start["input_tokens"] == final["input_tokens"] > 0  # exact from the start
    assert final["output_tokens"] > 0


def test_the_sdk_stream_equals_the_message(client):
    with client.messages.stream(**ask("Say hi", **BUDGET)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = client.messages.create(**ask("Say hi", **BUDGET))
    assert text == "Hello there"
    assert [b.type for b in final.content] == [b.type for b in whole.content] == ["thinking", "text"]
    assert final.content[0].thinking == whole.content[0].thinking == "Greet."


def test_pings_while_the_prompt_is_prefilled(server, monkeypatch):
    from musegl_anthropic import surface

    monkeypatch.setattr(surface, "PING_INTERVAL", 0.2)
    events = stream_events(server, ask("Slow start"))
    check_stream(events)
    names = [name for name, _ in events]
    first_block = names.index("content_block_start")
    assert names[0] == "message_start" and names[1:first_block].count("ping") >= 2


def test_an_error_after_the_headers_is_an_error_event(server):
    events = stream_events(server, ask("Fail midway"))
    name, data = events[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "api_error"
    assert "message_stop" not in [n for n, _ in events]


# -- sessions and the reasoning round trip ----------------------------------------------------
def history(first: anthropic.types.Message, call_id: str, text: str) -> list[dict]:
    return [{"role": "user", "content": text},
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "ok"}]}]


def two_turns(client, text: str, headers: dict) -> tuple[int, int]:
    """Turn 1 and turn 2 of a tool loop; ``(positions turn 1 computed, turn 2's cache_read)``."""
    first = client.messages.create(**ask(text), tools=[WRITE], thinking={"type": "adaptive"}, extra_headers=headers)
    call = next(block for block in first.content if block.type == "tool_use")
    second = client.messages.create(model="m", max_tokens=256, tools=[WRITE], thinking={"type": "adaptive"},
                                    messages=history(first, call.id, text), extra_headers=headers)
    computed = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens - 1
    return computed, second.usage.cache_read_input_tokens


def test_turn_two_in_the_client_session_executes_only_its_suffix(client):
    key = {"X-Claude-Code-Session-Id": "5f0e6b1c-2d3a-4b5c-9d8e-7f6a5b4c3d2e"}
    computed, reused = two_turns(client, "Create hello.txt, in a session", key)
    assert reused == computed  # everything turn 1 computed (its prompt, its answer but the last id)
    computed, anonymous = two_turns(client, "Create hello.txt, anonymously", {})
    assert anonymous <= computed // 16 * 16 < computed  # the prefix cache alone: whole blocks only


def test_a_verified_signature_restores_the_generated_ids(client):
    """The reasoning was generated as one id per character: re-rendered as text it
    tokenizes differently, so only the sealed ids let the prefix cache match past it."""
    body = ask("Think in pieces", **BUDGET)
    first = client.messages.create(**body)
    thinking = first.content[0]
    assert thinking.thinking == THOUGHT and thinking.signature

    def turn_two(signature: str) -> anthropic.types.Message:
        blocks = [{"type": "thinking", "thinking": THOUGHT, "signature": signature},
                  {"type": "text", "text": first.content[1].text}]
        return client.messages.create(model="m", **BUDGET, messages=[
            *body["messages"], {"role": "assistant", "content": blocks}, {"role": "user", "content": "Say hi"}])

    sealed = turn_two(thinking.signature)
    plain = turn_two(thinking.signature[:-4] + "AAAA")  # unverifiable: used as text, never an error
    assert plain.content[-1].text == sealed.content[-1].text == "Hello there"
    prompt_one = first.usage.input_tokens + first.usage.cache_read_input_tokens
    # The prefix cache reuses whole 16-id blocks: as text, the match ends within the reasoning's header;
    # sealed, it runs through the reasoning.
    assert plain.usage.cache_read_input_tokens < prompt_one + 16 <= sealed.usage.cache_read_input_tokens


# -- models, probes, auth -------------------------------------------------------------------
def test_models_are_readable_by_both_sdks(client, server):
    import openai

    (model,) = client.models.list().data
    assert model.type == "model" and model.display_name and model.created_at.year >= 2024
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as sdk:
        (entry,) = sdk.models.list().data
    assert entry.id == model.id and entry.object == "model" and entry.created > 0
    assert httpx.head(server.url + "/").status_code == 200


# -- bad input in Anthropic's envelope ---------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({**ask("x"), "temperature": 1.5}, "temperature"),
    ({**ask("x"), "top_k": "5"}, "top_k"),
    ({**ask("x"), "mystery": 1}, "mystery"),
    ({**ask("x"), "container": "c1"}, "container"),
    ({**ask("x"), "thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({**ask("x"), "thinking": {"type": "between_tools"}}, "thinking.type"),
    ({**ask("x"), "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WRITE]}, "tool_choice.name"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
     "messages[0].content[0].source.type"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x"}}]}]}, "messages[0].content[0].type"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"},
                                                  {"role": "assistant", "content": "prefill"}]}, "messages[1]"),
])
def test_bad_input_is_a_400_in_anthropics_envelope(server, body, param):
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]


def test_the_sdk_raises_its_own_error_types(client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**{**ask("x"), "max_tokens": 0})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.post("/v1/messages/batches", cast_to=object, body={})


def test_server_tools_are_left_out_unless_required(client):
    search = {"type": "web_search_20250305", "name": "web_search"}
    message = client.messages.create(**ask("Say hi"), tools=[WRITE, search])
    assert message.content[-1].text == "Hello there"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**ask("Say hi"), tools=[WRITE, search], tool_choice={"type": "tool", "name": "web_search"})


def test_disable_parallel_tool_use_keeps_one_call(client):
    both = client.messages.create(**ask("Two files"), tools=[WRITE])
    assert [b.input["file_path"] for b in both.content if b.type == "tool_use"] == ["a.txt", "b.txt"]
    one = client.messages.create(**ask("Two files"), tools=[WRITE],
                                 tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.input["file_path"] for b in one.content if b.type == "tool_use"] == ["a.txt"]
    assert one.stop_reason == "tool_use"


def test_redacted_thinking_is_used_only_when_this_server_sealed_it(client):
    first = client.messages.create(**ask("Say hi", **BUDGET))
    signature = first.content[0].signature
    for data in (signature, "opaque-data-from-elsewhere"):
        reply = client.messages.create(model="m", **BUDGET, messages=[
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": data},
                                              {"type": "text", "text": "Hello there"}]},
            {"role": "user", "content": "Say hi again"}])
        assert reply.content[-1].text == "Hello there"


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "Write"}])
def test_tool_choice_any_and_tool_force_the_call_through_the_grammar(client, choice):
    message = client.messages.create(**ask("Create hello.txt"), tools=[WRITE], tool_choice=choice)
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "Write" and set(call.input) == {"file_path", "content"}
    assert message.stop_reason == "tool_use"


def test_tool_results_with_an_error_flag_and_an_image(client):
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (0, 0, 255)).save(buffer, format="PNG")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(buffer.getvalue()).decode()}}
    messages = [{"role": "user", "content": "Create hello.txt"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Write",
                                                   "input": {"file_path": "hello.txt", "content": "hi"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                              "content": [{"type": "text", "text": "disk full"}, image]}]}]
    text_only = client.messages.count_tokens(model="m", tools=[WRITE], messages=messages[:2] + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "disk full"}]}])
    counted = client.messages.count_tokens(model="m", tools=[WRITE], messages=messages)
    assert counted.input_tokens > text_only.input_tokens + 1  # the image's rows and the error prefix count
    reply = client.messages.create(model="m", max_tokens=64, tools=[WRITE], messages=messages)
    assert reply.content[-1].text == "Done." and reply.stop_reason == "end_turn"
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens


def test_claude_codes_request_shapes_are_served(server):
    """Shapes Claude Code 2.1.328 sends (issue 49 item 4): each was a 400 it retried without."""
    # thinking display "updates": thinking blocks come as for "omitted" (empty text, a signature)
    events = stream_events(server, ask("Say hi", thinking={"type": "adaptive", "display": "updates"}))
    message = check_stream(events)
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert starts[0]["type"] == "thinking"
    assert not [data for name, data in events if name == "content_block_delta"
                and data["delta"]["type"] == "thinking_delta"], "updates returns no reasoning text"
    assert message is not None
    # a system message in messages with output_config.effort (per-turn control) sets the reasoning strength
    from musegl_core.http.schemas import structure_body
    from musegl_anthropic.request import read_request
    from musegl_anthropic.schemas import MessagesRequest

    def strength(effort: str | None) -> str:
        system = {"role": "system", "content": [{"type": "text", "text": "Env."}]}
        if effort is not None:
            system["output_config"] = {"effort": effort}
        body = ask("Say hi", output_config={"effort": "medium"})
        body["messages"] += [system, {"role": "user", "content": "Go on"}]
        call = read_request(structure_body(body, MessagesRequest), headers={}, seal=None, tokenizer=None)
        return call.conversation.variables.reasoning_strength

    assert [strength(e) for e in (None, "low", "high", "max")] == ["medium", "low", "high", "high"]
    bad = ask("Say hi")
    bad["messages"].append({"role": "system", "content": "x", "output_config": {"effort": "huge"}})
    response = post(server, bad)
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(
        "'messages[1].output_config.effort'")
    # safeguards: no classifier runs here; the answer says so, streamed and not
    guarded = ask("Say hi", safeguards=[{"type": "dangerous_tool_use", "classifier_context": {"allow": []}}])
    unsupported = [{"type": "dangerous_tool_use", "status": {"type": "unsupported"}}]
    response = post(server, guarded)
    assert response.status_code == 200, response.text
    assert response.json()["safeguard_results"] == unsupported
    (delta,) = [data for name, data in stream_events(server, guarded) if name == "message_delta"]
    assert delta["delta"]["safeguard_results"] == unsupported
    assert "safeguard_results" not in post(server, ask("Say hi")).json()
    response = post(server, ask("Say hi", safeguards=[{"type": "bio"}]))
    assert response.status_code == 400 and "safeguards[0].type" in response.json()["error"]["message"]


def test_a_system_message_in_messages_does_not_repeat_the_tool_block(server):
    def counted(inline_role: str) -> int:
        body = ask("Say hi", tools=[WRITE], system="You are terse.")
        body["messages"].insert(1, {"role": "assistant", "content": "ok"})
        body["messages"].insert(2, {"role": inline_role, "content": "Environment: linux."})
        response = post(server, body, path="/v1/messages/count_tokens")
        assert response.status_code == 200, response.text
        return response.json()["input_tokens"]

    no_tools = ask("Say hi", system="You are terse.")
    no_tools["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "system", "content": "Environment: linux."}]
    with_block = post(server, {**no_tools, "tools": [WRITE]}, path="/v1/messages/count_tokens").json()["input_tokens"]
    without = post(server, no_tools, path="/v1/messages/count_tokens").json()["input_tokens"]
    tool_block = with_block - without  # the tool block, shown once, plus the recipients line's namespace
    assert tool_block > 400
    # the inline system block costs its text, reasoning line and recipients line: far less than a tool block
    assert 0 < counted("system") - counted("user") < 60


def test_an_image_for_a_text_only_model_is_refused_in_the_shape_claude_code_handles():
    """Issue 49 item 7: Anthropic's dotted block path and "Could not process image", which Claude Code
    recognises as an unprocessable image block (it drops the image and resends) instead of a failed turn."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (0, 90, 200)).save(buffer, format="PNG")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(buffer.getvalue()).decode()}}
    config = ServeConfig(model=str(default_model_path()), port=0, max_context=1024, max_sessions=2)
    assert config.mmproj is None
    with running_server(config) as text_only:
        in_user = ask("Say hi")
        in_user["messages"][0]["content"] = [{"type": "text", "text": "Look"}, image]
        in_result = {"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "Read it"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "a.png"}, image]}]}]}
        for body, path in ((in_user, "messages.0.content.1.image"),
                           (in_result, "messages.2.content.0.tool_result.content.1.image")):
            for route in ("/v1/messages?beta=true", "/v1/messages/count_tokens?beta=true"):
                response = post(text_only, {**body, "stream": True} if "count" not in route else body, path=route)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert error["message"].startswith(f"{path}: Could not process image: "), error
