"""The Responses surface against a real server (scripted executor, ATEM tools), through the openai SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server, scripted_plugin_env

from stream_check import check_stream

PATCH_GRAMMAR = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change: (change_context | change_line)+
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
%import common.LF
'''
PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAAEklEQVR4nGP8z4AdMOEQH6QSAM1BAQ/"
       "oQeJvAAAAAElFTkSuQmCC")
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"
BAD_PATCH = "*** Begin Patch\nrm -rf hello.txt\n*** End Patch\n"


def block(name: str, params: list[tuple[str, str]]) -> str:
    body = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in params)
    return f'<atem:function_calls>\n<atem:invoke name="{name}">\n{body}</atem:invoke>\n</atem:function_calls>'


def call(name: str, params: list[tuple[str, str]], reasoning: str = "Run it.") -> str:
    return (f" to=self<|message|>{reasoning}<|eom|><|start|>assistant to={name}<|message|>"
            + block(name, params) + "<|eot|>")


SCRIPT = [
    {"when": "sealed follow", "reply": " to=user<|message|>Fine.<|eot|>"},
    # reasoning ids a model may emit that are not the canonical tokenization of their text
    {"when": "sealed reasoning", "pieces": [" to=self<|message|>", *"Think hard.", "<|eom|>",
                                            "<|start|>assistant to=user<|message|>", "Ok", "<|eot|>"]},
    {"when": "fail please", "reply": " to=user<|message|>one two three four five<|eot|>", "fail_after": 8},
    {"when": "ALWAYS ANSWER ARR", "reply": " to=user<|message|>Arr.<|eot|>"},
    {"when": "<|patch|>", "reply": " to=user<|message|>A red square.<|eot|>"},
    {"when": "slow prefill", "reply": " to=user<|message|>late<|eot|>", "prefill_delay": 1.2},
    {"when": "</tool_output>", "reply": " to=self<|message|>Done.<|eom|><|start|>assistant to=user<|message|>All set.<|eot|>"},
    {"when": "bad patch", "reply": call("apply_patch.apply_patch", [("input", BAD_PATCH)], "Patch it.")},
    {"when": "use the patch", "reply": call("apply_patch.apply_patch", [("input", PATCH)], "Patch it.")},
    {"when": "two commands", "reply": " to=exec_command.exec_command<|message|>" + block("exec_command.exec_command", [("cmd", "ls")])
     + "<|eom|><|start|>assistant to=exec_command.exec_command<|message|>" + block("exec_command.exec_command", [("cmd", "pwd")])
     + "<|eot|>"},
    {"when": "list files", "reply": call("exec_command.exec_command", [("cmd", "ls")])},
    {"when": "in the namespace", "reply": call("mcp.lookup", [("q", "x")])},
    {"when": "json please", "reply": ' to=user<|message|>{"a": 1}<|eot|>'},
    {"when": "second question", "reply": " to=self<|message|>Again.<|eom|><|start|>assistant to=user<|message|>Second.<|eot|>"},
    {"when": "long answer", "reply": " to=user<|message|>" + "word " * 40 + "<|eot|>"},
    {"when": "", "reply": " to=self<|message|>Say hi.<|eom|><|start|>assistant to=user<|message|>Hi there<|eot|>"},
]

EXEC = {"type": "function", "name": "exec_command", "description": "run a command", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "apply a patch",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    with scripted_plugin_env(tmp_path_factory.mktemp("responses"), SCRIPT):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", tool_parser="atem",
                             max_context=2048, extra={"responses_keepalive": 0.25})
        with running_server(config) as running:
            yield running


@pytest.fixture(scope="module")
def client(server):
    # strict: every response is validated against the SDK's types
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True)


def stream_events(server, body: dict, headers: dict | None = None) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, headers=headers,
                      timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        kinds = []
        for line in reply.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert kinds == [e["type"] for e in events]  # every event names its type on an event: line too
    return events


def post(server, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json=body, headers=headers, timeout=60)


def test_a_string_input_gives_reasoning_and_a_message(client):
    response = client.responses.create(model="anything", input="hello", store=False)
    assert response.status == "completed" and response.object == "response"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Say hi."
    assert reasoning.summary == []
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == "Hi there"
    usage = response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens > 0


def test_the_stream_follows_the_grammar_and_ends_with_the_same_object(server, client):
    body = {"model": "m", "input": [{"role": "developer", "content": "Be brief."},
                                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
            "reasoning": {"effort": "low", "summary": "auto"}, "store": False}
    events = stream_events(server, body)
    final = check_stream(events)
    assert final["status"] == "completed"
    reasoning = final["output"][0]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Say hi."}]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Say hi."}]
    assert final["usage"]["input_tokens"] > 0
    assert final["reasoning"] == {"effort": "low", "summary": "auto"}
    # the SDK reads the same stream
    with client.responses.stream(model="m", input="hello", store=False) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == "Hi there"


def test_a_function_call_and_its_output_round_trip(server, client):
    first = client.responses.create(model="m", input="list files", tools=[EXEC], store=False)
    call_item = first.output[-1]
    assert call_item.type == "function_call" and call_item.name == "exec_command"
    assert json.loads(call_item.arguments) == {"cmd": "ls"} and call_item.call_id
    events = stream_events(server, {"model": "m", "input": "list files", "tools": [EXEC], "store": False})
    final = check_stream(events)
    assert [i["type"] for i in final["output"]] == ["reasoning", "function_call"]
    # turn 2: the transcript resent, the assistant items without id/status, the output as a string
    history = [{"role": "user", "content": "list files"},
               {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Run it."}]},
               {"type": "function_call", "call_id": call_item.call_id, "name": "exec_command", "arguments": call_item.arguments},
               {"type": "function_call_output", "call_id": call_item.call_id, "output": "a.txt\nb.txt"},
               {"type": "web_search_call", "id": "ws_1", "status": "completed"}]  # an item type musegl leaves out
    second = client.responses.create(model="m", input=history, tools=[EXEC, {"type": "web_search"}], store=False)
    assert second.output_text == "All set."


def test_namespace_tools_are_flattened_and_mapped_back(client):
    tools = [{"type": "namespace", "name": "mcp", "description": "an MCP server",
              "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]}]
    response = client.responses.create(model="m", input="in the namespace", tools=tools, store=False)
    item = response.output[-1]
    assert item.type == "function_call" and item.name == "lookup" and item.namespace == "mcp"


def test_a_freeform_tool_call_comes_back_as_a_custom_tool_call_with_raw_input(server, client):
    response = client.responses.create(model="m", input="use the patch", tools=[EXEC, APPLY_PATCH], store=False)
    item = response.output[-1]
    assert item.type == "custom_tool_call" and item.name == "apply_patch"
    assert item.input == PATCH
    events = stream_events(server, {"model": "m", "input": "use the patch", "tools": [EXEC, APPLY_PATCH], "store": False})
    final = check_stream(events)
    assert final["output"][-1]["input"] == PATCH
    deltas = [e for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(d["delta"] for d in deltas) == PATCH
    # its output comes back as custom_tool_call_output
    history = [{"role": "user", "content": "use the patch"},
               {"type": "custom_tool_call", "call_id": item.call_id, "name": "apply_patch", "input": PATCH},
               {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "Done!"}]
    assert client.responses.create(model="m", input=history, tools=[APPLY_PATCH], store=False).output_text == "All set."


def test_the_freeform_grammar_constrains_the_call_input(client):
    # the script writes an input the grammar refuses: the grammar takes over where it diverges
    response = client.responses.create(model="m", input="bad patch", tools=[EXEC, APPLY_PATCH], store=False,
                                       max_output_tokens=200, extra_body={"seed": 1})
    inputs = [item.input for item in response.output if item.type == "custom_tool_call"]
    assert BAD_PATCH not in inputs
    assert all(text.startswith("*** Begin Patch\n*** ") for text in inputs)


def test_a_grammar_that_cannot_be_embedded_is_a_400_naming_the_tool(server):
    bad = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"a\"\n%ignore \" \"\n"}}
    reply = post(server, {"model": "m", "input": "use the patch", "tools": [bad]})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "unsupported_schema"


def test_json_schema_text_format_is_constrained(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    response = client.responses.create(model="m", input="json please", store=False,
                                       text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert json.loads(response.output_text) == {"a": 1}


def test_max_output_tokens_ends_incomplete(server, client):
    response = client.responses.create(model="m", input="long answer", max_output_tokens=5, store=False)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    final = check_stream(stream_events(server, {"model": "m", "input": "long answer", "max_output_tokens": 5, "store": False}))
    assert final["status"] == "incomplete"


def test_turn_two_of_a_codex_conversation_runs_in_the_prompt_cache_key_session(server):
    headers = {"session-id": "thread-123", "thread-id": "thread-123"}
    base = {"model": "m", "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-123"}
    first = post(server, {**base, "input": [{"role": "user", "content": "hello"}]}, headers).json()
    reasoning, message = first["output"]
    assert reasoning["encrypted_content"]
    history = [{"role": "user", "content": "hello"},
               {"type": "reasoning", "summary": [], "encrypted_content": reasoning["encrypted_content"]},
               {"type": "message", "role": "assistant", "content": message["content"]},
               {"role": "user", "content": "second question"}]
    second = post(server, {**base, "input": history}, headers).json()
    assert second["output"][-1]["content"][0]["text"] == "Second."
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    # everything up to the end of turn 1 was in the session: its prompt and all but its last generated id
    assert cached >= first["usage"]["input_tokens"] + first["usage"]["output_tokens"] - 1
    listed = httpx.get(f"{server.url}/v1/sessions", timeout=30).json()
    assert "codex:thread-123" in json.dumps(listed)


def test_a_tampered_encrypted_content_is_used_as_plain_text(server):
    first = post(server, {"model": "m", "input": "hello", "store": False,
                          "include": ["reasoning.encrypted_content"]}).json()
    token = first["output"][0]["encrypted_content"]
    for echoed in (token[:-2] + ("AA" if token[-2:] != "AA" else "BB"), "not a seal"):
        history = [{"role": "user", "content": "hello"},
                   {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Say hi."}],
                    "encrypted_content": echoed},
                   {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "second question"}]
        reply = post(server, {"model": "m", "input": history, "store": False})
        assert reply.status_code == 200 and reply.json()["output"][-1]["content"][0]["text"] == "Second."


def test_previous_response_id_prefills_only_the_new_input(server, client):
    first = client.responses.create(model="m", input="hello", include=["reasoning.encrypted_content"])
    assert first.store is True
    second = client.responses.create(model="m", previous_response_id=first.id,
                                     input=[{"role": "user", "content": "second question"}])
    assert second.output_text == "Second." and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    # the same conversation sent in full renders the same prompt
    full = [{"role": "user", "content": "hello"},
            {"type": "reasoning", "summary": [], "encrypted_content": first.output[0].encrypted_content},
            {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "second question"}]
    again = client.responses.create(model="m", input=full, store=False)
    assert again.usage.input_tokens == second.usage.input_tokens
    assert again.output_text == second.output_text
    counted = client.responses.input_tokens.count(model="m", previous_response_id=first.id,
                                                  input=[{"role": "user", "content": "second question"}])
    assert counted.input_tokens == second.usage.input_tokens


def test_the_store_serves_gets_input_items_and_deletes(server, client):
    created = client.responses.create(model="m", input="hello", metadata={"k": "v"})
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == "Hi there" and fetched.metadata == {"k": "v"}
    items = client.responses.input_items.list(created.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "hello"
    replay = httpx.get(f"{server.url}/v1/responses/{created.id}", params={"stream": "true"}, timeout=30)
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    unstored = client.responses.create(model="m", input="hello", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_an_unknown_previous_response_id_is_404_previous_response_not_found(server):
    reply = post(server, {"model": "m", "input": "hi", "previous_response_id": "resp_nope"})
    assert reply.status_code == 404
    assert reply.json()["error"] == {"message": reply.json()["error"]["message"], "type": "invalid_request_error",
                                     "param": "previous_response_id", "code": "previous_response_not_found"}


@pytest.mark.parametrize("extra, param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"background": True}, "background"),
    ({"truncation": "middle"}, "truncation"),
    ({"reasoning": {"summary": "concise"}}, "reasoning.summary"),
    ({"reasoning": {"effort": "none"}}, "reasoning.effort"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"temperature": 3}, "temperature"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].image_url.url"),
    ({"conversation": "conv_1"}, "conversation"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_parameter(server, client, extra, param):
    reply = post(server, {"model": "m", "input": "hello", **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_the_sdk_raises_bad_request_in_the_envelope(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="hello", reasoning={"effort": "xhigh"})
    assert caught.value.body["param"] == "reasoning.effort"


def test_a_prompt_over_the_context_fails_the_stream_with_context_length_exceeded(server):
    events = stream_events(server, {"model": "m", "input": "word " * 5000, "store": False})
    final = check_stream(events)
    assert final["status"] == "failed" and final["error"]["code"] == "context_length_exceeded"
    reply = post(server, {"model": "m", "input": "word " * 5000, "store": False})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"


def test_a_long_prefill_repeats_in_progress(server):
    events = stream_events(server, {"model": "m", "input": "slow prefill", "store": False})
    final = check_stream(events)
    assert final["output"][-1]["content"][0]["text"] == "late"
    repeats = [e for e in events if e["type"] == "response.in_progress"]
    assert len(repeats) >= 2  # 1.2 s of prefill, a keep-alive every 0.25 s


def test_parallel_tool_calls_false_is_honoured(server, client):
    both = client.responses.create(model="m", input="two commands", tools=[EXEC], store=False)
    assert [json.loads(i.arguments)["cmd"] for i in both.output if i.type == "function_call"] == ["ls", "pwd"]
    response = client.responses.create(model="m", input="two commands", tools=[EXEC], parallel_tool_calls=False,
                                       store=False)
    assert [json.loads(i.arguments)["cmd"] for i in response.output if i.type == "function_call"] == ["ls"]
    assert response.parallel_tool_calls is False


def test_a_named_custom_tool_choice_forces_its_call(client):
    response = client.responses.create(model="m", input="use the patch", tools=[EXEC, APPLY_PATCH], store=False,
                                       tool_choice={"type": "custom", "name": "apply_patch"})
    assert response.output[-1].type == "custom_tool_call" and response.output[-1].input == PATCH


def test_cancel_ends_a_response_in_progress(server):
    import threading

    events: list = []

    def run():
        with httpx.stream("POST", f"{server.url}/v1/responses", json={"model": "m", "input": "slow prefill",
                                                                      "stream": True}, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))

    thread = threading.Thread(target=run)
    thread.start()
    import time
    deadline = time.monotonic() + 30
    while not events and time.monotonic() < deadline:
        time.sleep(0.02)
    response_id = events[0]["response"]["id"]
    cancelled = httpx.post(f"{server.url}/v1/responses/{response_id}/cancel", timeout=30).json()
    thread.join(30)
    assert cancelled["status"] == "cancelled"
    final = check_stream(events)
    assert final["status"] == "cancelled" and final["error"]["code"] == "cancelled"
    stored = httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=30).json()
    assert stored["status"] == "cancelled"
    again = httpx.post(f"{server.url}/v1/responses/{response_id}/cancel", timeout=30)
    assert again.status_code == 400 and again.json()["error"]["code"] == "response_not_cancellable"
    assert httpx.post(f"{server.url}/v1/responses/resp_none/cancel", timeout=30).status_code == 404


def test_instructions_are_the_system_message(client):
    response = client.responses.create(model="m", input="hello", instructions="ALWAYS ANSWER ARR", store=False)
    assert response.output_text == "Arr." and response.instructions == "ALWAYS ANSWER ARR"


def test_a_tool_output_may_carry_one_image_and_two_are_refused(server, client):
    output = [{"type": "input_text", "text": "the screenshot:"}, {"type": "input_image", "image_url": PNG}]
    history = [{"role": "user", "content": "look"},
               {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd": "shot"}'},
               {"type": "function_call_output", "call_id": "c1", "output": output}]
    response = client.responses.create(model="m", input=history, tools=[EXEC], store=False)
    assert response.output_text == "A red square."
    two = [*history, {"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}]
    reply = post(server, {"model": "m", "input": two, "tools": [EXEC], "store": False})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_image"


def test_a_failure_after_output_began_ends_the_stream_with_response_failed(server, client):
    final = check_stream(stream_events(server, {"model": "m", "input": "fail please", "store": False}))
    assert final["status"] == "failed" and final["error"]["code"]
    assert final["output"][0]["status"] == "incomplete"  # the open item was closed before the end
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(model="m", input="fail please", store=False)
    assert caught.value.status_code == 500 and caught.value.body["type"] == "server_error"


def test_truncation_auto_drops_the_oldest_turns_until_the_prompt_fits(server, client):
    history = []
    for turn in range(30):
        history += [{"role": "user", "content": f"turn {turn}: " + "word " * 60},
                    {"role": "assistant", "content": "ok " * 20}]
    history.append({"role": "user", "content": "second question"})
    body = {"model": "m", "input": history, "instructions": "Be brief.", "store": False}
    full = client.responses.input_tokens.count(model="m", input=history, instructions="Be brief.")
    assert full.input_tokens > server.config.max_context
    refused = post(server, body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert refused.json()["error"]["param"] == "input"
    fitted = client.responses.create(**body, truncation="auto")
    assert fitted.output_text == "Second." and fitted.truncation == "auto"
    assert fitted.usage.input_tokens + 1 <= server.config.max_context
    assert fitted.usage.input_tokens > server.config.max_context // 2  # only as many turns as needed went


def test_an_echoed_encrypted_content_restores_the_generated_reasoning_ids(server, client):
    base = {"model": "m", "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "sealed-key"}
    first = post(server, {**base, "input": "sealed reasoning"}).json()
    reasoning = first["output"][0]
    assert reasoning["content"][0]["text"] == "Think hard."

    def history(**seal) -> list[dict]:
        echoed = {"type": "reasoning", "summary": [], "content": reasoning["content"], **seal}
        return [{"role": "user", "content": "sealed reasoning"}, echoed,
                {"role": "assistant", "content": "Ok"}, {"role": "user", "content": "sealed follow"}]

    def count(items) -> int:
        return client.responses.input_tokens.count(model="m", input=items).input_tokens

    # the script emitted "Think hard." one character per id (11 ids); its text tokenizes to 9
    sealed = count(history(encrypted_content=reasoning["encrypted_content"]))
    assert sealed == count(history()) + 2
    assert count(history(encrypted_content=reasoning["encrypted_content"][:-4] + "AAAA")) == sealed - 2
    second = post(server, {**base, "input": history(encrypted_content=reasoning["encrypted_content"])}).json()
    assert second["output"][-1]["content"][0]["text"] == "Fine." and second["usage"]["input_tokens"] == sealed
    usage = first["usage"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= usage["input_tokens"] + usage["output_tokens"] - 1


def test_a_client_that_leaves_mid_stream_cancels_the_response(server, client):
    with httpx.stream("POST", f"{server.url}/v1/responses", json={"model": "m", "input": "slow prefill",
                                                                  "stream": True}, timeout=60) as reply:
        first = json.loads(next(line for line in reply.iter_lines() if line.startswith("data: "))[6:])
    response_id = first["response"]["id"]
    import time
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=30).status_code != 404:
        assert time.monotonic() < deadline, "the response kept running after its client left"
        time.sleep(0.05)
    assert client.responses.create(model="m", input="hello", store=False).output_text == "Hi there"


def test_a_stored_responses_id_is_not_listed_among_the_sessions(server):
    """Issue 47 item 3: the chain's soft session was listed as responses:resp_<id>, and the id lets
    any key holder read, continue and delete the response."""
    stored = post(server, {"model": "m", "input": "hello"}).json()
    listed = json.dumps(httpx.get(f"{server.url}/v1/sessions", timeout=30).json())
    assert stored["id"] not in listed and stored["id"].removeprefix("resp_") not in listed
    assert "responses:sha256-" in listed
    follow = post(server, {"model": "m", "input": "second question", "previous_response_id": stored["id"]})
    assert follow.status_code == 200
    assert follow.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the chain still finds its KV
