"""The Muse template against the official template's worked examples, its
properties, and musegl's own rules."""

from __future__ import annotations

import datetime
import json

import pytest

from musegl_core.chat.messages import (
    FunctionCall,
    ImagePart,
    Message,
    TextPart,
    ToolCall,
    ToolDef,
    parse_messages,
    parse_tools,
)
from musegl_core.chat.template import (
    MuseTemplate,
    TemplateVariables,
    reasoning_strength_from_request,
    render_value,
)
from musegl_core.errors import ApiError

PNG = "data:image/png;base64,iVBORw0KGgo="

# The official template's output for each request (byte-exact expected outputs).
EXAMPLES = {  # noqa: E501
    'example_1_single_user': ('{"messages": [{"role": "user", "content": "What is 17 * 23?"}]}', '<|begin_of_text|><|start|>system<|message|>You are a helpful AI assistant.\nKnowledge cutoff: 2026-01-04.\nCurrent date: 2026-03-15.\n\nReasoning strength: high.\n\n# Valid recipients: "self", "user".<|eot|><|start|>user<|message|>What is 17 * 23?<|eot|><|start|>assistant'),
    'example_2_system_effort_directive': ('{"messages": [{"role": "system", "content": "You are terse.\\nReasoning effort: low"}, {"role": "user", "content": "Hi"}]}', '<|begin_of_text|><|start|>system<|message|>You are terse.\nReasoning strength: low\n\n# Valid recipients: "self", "user".<|eot|><|start|>user<|message|>Hi<|eot|><|start|>assistant'),
    'example_3_dotted_tool': ('{"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [{"type": "function", "function": {"name": "weather.get_forecast", "description": "Get the forecast for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]}', '<|begin_of_text|><|start|>system<|message|>You are a helpful AI assistant.\nKnowledge cutoff: 2026-01-04.\nCurrent date: 2026-03-15.\n\nReasoning strength: high.\n\nIn this environment you have access to a set of tools you can use to answer the user\'s question.\n\nYou can invoke a function by writing a "<atem:function_calls>" block like the following:\n<atem:function_calls>\n<atem:invoke name="$FUNCTION_NAME">\n<atem:parameter name="$PARAMETER_NAME">$PARAMETER_VALUE</atem:parameter>\n...\n</atem:invoke>\n</atem:function_calls>\n\nString and scalar parameters should be specified as is, while lists and objects should use JSON format. Note that spaces for string values are not stripped. The output is not expected to be valid XML and is parsed with regular expressions.\nHere are the functions available in JSONSchema format:\n// Tool metadata\n{"name": "weather", "description": ""}\n// Function schemas\n{"name": "weather.get_forecast", "description": "Get the forecast for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}\n\nHere\'s an example of how to call a function in the tool set:\n(If the tool namespace is not specified, invoke the function directly as `example_function_name` rather than `example_tool_name.example_function_name`)\n\nto=example_tool_name.example_function_name\n\n<atem:function_calls>\n<atem:invoke name="example_tool_name.example_function_name">\n<atem:parameter name="example_parameter_1">value_1</atem:parameter>\n<atem:parameter name="example_parameter_2">This is the value for the second parameter\nthat can span\n"multiple" lines\n</atem:parameter>\n</atem:invoke>\n</atem:function_calls>\n\n# Valid recipients: "self", "weather.*", "user".<|eot|><|start|>user<|message|>Weather in Oslo?<|eot|><|start|>assistant'),
    'example_4_history_reasoning_medium': ('{"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "reasoning_content": "Simple arithmetic.", "content": "4"}, {"role": "user", "content": "And 3+3?"}], "reasoning_strength": "medium"}', '<|begin_of_text|><|start|>system<|message|>You are a helpful AI assistant.\nKnowledge cutoff: 2026-01-04.\nCurrent date: 2026-03-15.\n\nReasoning strength: medium.\n\n# Valid recipients: "self", "user".<|eot|><|start|>user<|message|>What is 2+2?<|eot|><|start|>assistant to=self<|message|>Simple arithmetic.<|eom|><|start|>assistant to=user<|message|>4<|eot|><|start|>user<|message|>And 3+3?<|eot|><|start|>assistant'),
    'example_5_parallel_calls': ('{"messages": [{"role": "system", "content": "You are a weather bot."}, {"role": "user", "content": "Oslo and Bergen?"}, {"role": "assistant", "reasoning_content": "Two cities, two calls.", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather.get_forecast", "arguments": {"city": "Oslo", "days": 2}}}, {"id": "call_2", "type": "function", "function": {"name": "weather.get_forecast", "arguments": {"city": "Bergen", "days": 1}}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "{\\"temp\\": -3}"}, {"role": "tool", "tool_call_id": "call_2", "content": "{\\"temp\\": 2}"}], "tools": [{"type": "function", "function": {"name": "weather.get_forecast", "description": "Get the forecast for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]}', '<|begin_of_text|><|start|>system<|message|>You are a weather bot.\n\nReasoning strength: high.\n\nIn this environment you have access to a set of tools you can use to answer the user\'s question.\n\nYou can invoke a function by writing a "<atem:function_calls>" block like the following:\n<atem:function_calls>\n<atem:invoke name="$FUNCTION_NAME">\n<atem:parameter name="$PARAMETER_NAME">$PARAMETER_VALUE</atem:parameter>\n...\n</atem:invoke>\n</atem:function_calls>\n\nString and scalar parameters should be specified as is, while lists and objects should use JSON format. Note that spaces for string values are not stripped. The output is not expected to be valid XML and is parsed with regular expressions.\nHere are the functions available in JSONSchema format:\n// Tool metadata\n{"name": "weather", "description": ""}\n// Function schemas\n{"name": "weather.get_forecast", "description": "Get the forecast for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}\n\nHere\'s an example of how to call a function in the tool set:\n(If the tool namespace is not specified, invoke the function directly as `example_function_name` rather than `example_tool_name.example_function_name`)\n\nto=example_tool_name.example_function_name\n\n<atem:function_calls>\n<atem:invoke name="example_tool_name.example_function_name">\n<atem:parameter name="example_parameter_1">value_1</atem:parameter>\n<atem:parameter name="example_parameter_2">This is the value for the second parameter\nthat can span\n"multiple" lines\n</atem:parameter>\n</atem:invoke>\n</atem:function_calls>\n\n# Valid recipients: "self", "weather.*", "user".<|eot|><|start|>user<|message|>Oslo and Bergen?<|eot|><|start|>assistant to=self<|message|>Two cities, two calls.<|eom|><|start|>assistant to=weather.get_forecast<|message|><atem:function_calls>\n<atem:invoke name="weather.get_forecast">\n<atem:parameter name="city">Oslo</atem:parameter>\n<atem:parameter name="days">2</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eom|><|start|>assistant to=weather.get_forecast<|message|><atem:function_calls>\n<atem:invoke name="weather.get_forecast">\n<atem:parameter name="city">Bergen</atem:parameter>\n<atem:parameter name="days">1</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eot|><|start|>tool weather.get_forecast<|message|><tool_output name="weather.get_forecast">\n{"temp": -3}\n</tool_output><|eot|><|start|>tool weather.get_forecast<|message|><tool_output name="weather.get_forecast">\n{"temp": 2}\n</tool_output><|eot|><|start|>assistant'),
    'example_6_image_and_values': ('{"messages": [{"role": "system", "content": "Configure things."}, {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " then set it."}]}, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "cfg.set", "arguments": {"s": "two\\nlines ", "n": 7, "f": 2.5, "b": true, "z": null, "o": {"k": [1, "x"]}}}}]}, {"role": "tool", "tool_call_id": "c", "content": "ok"}], "tools": [{"type": "function", "function": {"name": "cfg.set", "description": "Set config.", "parameters": {"type": "object", "properties": {}}}}]}', '<|begin_of_text|><|start|>system<|message|>Configure things.\n\nReasoning strength: high.\n\nIn this environment you have access to a set of tools you can use to answer the user\'s question.\n\nYou can invoke a function by writing a "<atem:function_calls>" block like the following:\n<atem:function_calls>\n<atem:invoke name="$FUNCTION_NAME">\n<atem:parameter name="$PARAMETER_NAME">$PARAMETER_VALUE</atem:parameter>\n...\n</atem:invoke>\n</atem:function_calls>\n\nString and scalar parameters should be specified as is, while lists and objects should use JSON format. Note that spaces for string values are not stripped. The output is not expected to be valid XML and is parsed with regular expressions.\nHere are the functions available in JSONSchema format:\n// Tool metadata\n{"name": "cfg", "description": ""}\n// Function schemas\n{"name": "cfg.set", "description": "Set config.", "parameters": {"type": "object", "properties": {}}}\n\nHere\'s an example of how to call a function in the tool set:\n(If the tool namespace is not specified, invoke the function directly as `example_function_name` rather than `example_tool_name.example_function_name`)\n\nto=example_tool_name.example_function_name\n\n<atem:function_calls>\n<atem:invoke name="example_tool_name.example_function_name">\n<atem:parameter name="example_parameter_1">value_1</atem:parameter>\n<atem:parameter name="example_parameter_2">This is the value for the second parameter\nthat can span\n"multiple" lines\n</atem:parameter>\n</atem:invoke>\n</atem:function_calls>\n\n# Valid recipients: "self", "cfg.*", "user".<|eot|><|start|>user<|message|>Look: <|patch|> then set it.<|eot|><|start|>assistant to=cfg.set<|message|><atem:function_calls>\n<atem:invoke name="cfg.set">\n<atem:parameter name="s">two\nlines </atem:parameter>\n<atem:parameter name="n">7</atem:parameter>\n<atem:parameter name="f">2.5</atem:parameter>\n<atem:parameter name="b">true</atem:parameter>\n<atem:parameter name="z">null</atem:parameter>\n<atem:parameter name="o">{"k": [1, "x"]}</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eot|><|start|>tool cfg.set<|message|><tool_output name="cfg.set">\nok\n</tool_output><|eot|><|start|>assistant'),
    'example_7_recipient_end_turn': ('{"messages": [{"role": "system", "content": "S."}, {"role": "user", "content": "Go"}, {"role": "assistant", "content": "Working.", "recipient": "user", "end_turn": false}, {"role": "assistant", "content": "Done."}, {"role": "tool", "tool_call_id": "call_zzz", "content": "orphan"}]}', '<|begin_of_text|><|start|>system<|message|>S.\n\nReasoning strength: high.\n\n# Valid recipients: "self", "user".<|eot|><|start|>user<|message|>Go<|eot|><|start|>assistant to=user<|message|>Working.<|eom|><|start|>assistant to=user<|message|>Done.<|eot|><|start|>tool call_zzz<|message|><tool_output name="call_zzz">\norphan\n</tool_output><|eot|><|start|>assistant'),
    'product_6_11_developer_alias_commentary': ('{"messages": [{"role": "developer", "content": "Use tools when useful."}, {"role": "user", "content": "Time in Tokyo?"}, {"role": "assistant", "reasoning_content": "Use the clock tool.", "content": "Checking the clock.", "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "get_time", "arguments": "{\\"tz\\": \\"Asia/Tokyo\\"}"}}]}, {"role": "tool", "tool_call_id": "t1", "content": "09:00"}], "tools": [{"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone.", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}], "reasoning_effort": "low"}', '<|begin_of_text|><|start|>system<|message|>Use tools when useful.\n\nReasoning strength: low.\n\n[TOOL BLOCK]\n\n# Valid recipients: "self", "get_time.*", "user".<|eot|><|start|>user<|message|>Time in Tokyo?<|eot|><|start|>assistant to=self<|message|>Use the clock tool.<|eom|><|start|>assistant to=user<|message|>Checking the clock.<|eom|><|start|>assistant to=get_time.get_time<|message|><atem:function_calls>\n<atem:invoke name="get_time.get_time">\n<atem:parameter name="tz">Asia/Tokyo</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eot|><|start|>tool get_time.get_time<|message|><tool_output name="get_time.get_time">\n09:00\n</tool_output><|eot|><|start|>assistant'),
    'product_6_11_image_url_openrouter_effort': ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "What color is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,...."}}]}], "reasoning": {"effort": "medium"}}', '<|begin_of_text|><|start|>system<|message|>You are a helpful AI assistant.\nKnowledge cutoff: 2026-01-04.\nCurrent date: 2026-03-15.\n\nReasoning strength: medium.\n\n# Valid recipients: "self", "user".<|eot|><|start|>user<|message|>What color is this?<|patch|><|eot|><|start|>assistant'),
}
TOOL_BLOCK_HEAD = 'In this environment you have access to a set of tools you can use to answer the user\'s question.\n\nYou can invoke a function by writing a "<atem:function_calls>" block like the following:\n<atem:function_calls>\n<atem:invoke name="$FUNCTION_NAME">\n<atem:parameter name="$PARAMETER_NAME">$PARAMETER_VALUE</atem:parameter>\n...\n</atem:invoke>\n</atem:function_calls>\n\nString and scalar parameters should be specified as is, while lists and objects should use JSON format. Note that spaces for string values are not stripped. The output is not expected to be valid XML and is parsed with regular expressions.\nHere are the functions available in JSONSchema format:\n// Tool metadata\n'
TOOL_BLOCK_TAIL = '\n\nHere\'s an example of how to call a function in the tool set:\n(If the tool namespace is not specified, invoke the function directly as `example_function_name` rather than `example_tool_name.example_function_name`)\n\nto=example_tool_name.example_function_name\n\n<atem:function_calls>\n<atem:invoke name="example_tool_name.example_function_name">\n<atem:parameter name="example_parameter_1">value_1</atem:parameter>\n<atem:parameter name="example_parameter_2">This is the value for the second parameter\nthat can span\n"multiple" lines\n</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'


def template_messages(raw):
    """Template-level message dicts → Message objects."""
    messages = []
    for item in raw:
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "text":
                    parts.append(TextPart(part["text"]))
                elif part["type"] == "image":
                    parts.append(ImagePart(PNG))
                else:  # OpenAI image_url
                    parts.append(ImagePart(part["image_url"]["url"]))
            content = tuple(parts)
        calls = tuple(
            ToolCall(
                call["id"],
                FunctionCall(
                    call["function"]["name"],
                    call["function"]["arguments"]
                    if isinstance(call["function"]["arguments"], dict)
                    else json.loads(call["function"]["arguments"]),
                ),
            )
            for call in item.get("tool_calls") or ()
        )
        messages.append(
            Message(
                role=item["role"],
                content=content,
                name=item.get("name"),
                tool_call_id=item.get("tool_call_id"),
                tool_calls=calls,
                reasoning_content=item.get("reasoning_content"),
                recipient=item.get("recipient"),
                end_turn=item.get("end_turn"),
            )
        )
    return messages


TEMPLATE = MuseTemplate(today=lambda: datetime.date(2026, 3, 15))


def render(messages, tools=None, **kwargs):
    return TEMPLATE.render(messages, tools, **kwargs)


def text_of(messages, tools=None, **kwargs):
    return render(messages, tools, **kwargs).text


def user(text="Hi"):
    return Message("user", text)


def tool(name, description="d.", parameters=None):
    return ToolDef(name, description, parameters)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_worked_examples_byte_exact(name):
    """Every worked example renders byte-exact
    (clock date 2026-03-15; the elided [TOOL BLOCK] of 6.11 is cut out)."""
    request, expected = EXAMPLES[name]
    request = json.loads(request)
    strength = request.get("reasoning_strength") or reasoning_strength_from_request(
        request.get("reasoning_effort"), request.get("reasoning")
    )
    messages = (
        parse_messages(json.loads(json.dumps(request["messages"]).replace("data:image/png;base64,....", PNG)))
        if name.startswith("product")
        else template_messages(request["messages"])
    )
    out = text_of(messages, parse_tools(request.get("tools")), variables=TemplateVariables(reasoning_strength=strength))
    if "[TOOL BLOCK]" in expected:
        start = out.index(TOOL_BLOCK_HEAD)
        end = out.index(TOOL_BLOCK_TAIL) + len(TOOL_BLOCK_TAIL)
        assert out[start:end] == (
            TOOL_BLOCK_HEAD + '{"name": "get_time", "description": ""}\n// Function schemas\n'
            '{"name": "get_time.get_time", "description": "Current time in a timezone.", "parameters": '
            '{"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}' + TOOL_BLOCK_TAIL
        )
        out = out[:start] + "[TOOL BLOCK]" + out[end:]
    assert out == expected


# -- template properties ---------------------------------------------------------


def test_4_tool_block_once_per_system_block():
    """With two system messages the tool block appears twice."""
    out = text_of([Message("system", "A"), Message("system", "B"), user()], [tool("x.y")])
    assert out.count("In this environment") == 2
    assert out.count('# Valid recipients: "self", "x.*", "user".') == 2


def test_tool_block_once_leaves_later_system_blocks_without_it():
    """musegl's rule for the Anthropic surface (issue 49 item 3): one tool block, in the first system block;
    each later block keeps its text, reasoning line and recipients line."""
    from musegl_core.chat.template import MuseTemplate

    messages = [Message("system", "A"), user(), Message("system", "B")]
    out = MuseTemplate(today=lambda: datetime.date(2026, 1, 1)).render(messages, [tool("x.y")],
                                                                       tool_block_once=True).text
    assert out.count("In this environment") == 1 and out.index("In this environment") < out.index("B")
    assert out.count('# Valid recipients: "self", "x.*", "user".') == 2
    assert '<|start|>system<|message|>B\n\nReasoning strength: high.\n\n# Valid recipients: "self", "x.*", "user".<|eot|>' in out


def test_4_namespaces_first_appearance_and_deduplicated():
    """Namespace order = first appearance; duplicates collapse."""
    out = text_of([user()], [tool("b.one"), tool("a.two"), tool("b.three")])
    assert '{"name": "b", "description": ""}\n{"name": "a", "description": ""}\n// Function' in out
    assert '# Valid recipients: "self", "b.*", "a.*", "user".' in out


def test_4_json_keeps_key_order_and_non_ascii():
    """Client key order, non-ASCII unescaped, no HTML escaping."""
    params = {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}
    out = text_of([user()], [tool("ns.f", "Grüße <b> & 'x'", params)])
    assert (
        '{"name": "ns.f", "description": "Grüße <b> & \'x\'", "parameters": {"type": "object", '
        '"properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}}' in out
    )


def test_4_effort_normalisation_only_four_casings():
    """`Reasoning eFFort` is left alone and the default line is appended."""
    out = text_of([Message("system", "Reasoning eFFort: low"), user()])
    assert "<|message|>Reasoning eFFort: low\n\nReasoning strength: high." in out
    for old, new in [
        ("Reasoning effort", "Reasoning strength"),
        ("Reasoning Effort", "Reasoning Strength"),
        ("reasoning effort", "reasoning strength"),
        ("REASONING EFFORT", "REASONING STRENGTH"),
    ]:
        out = text_of([Message("system", f"{old}: low"), user()])
        assert f"<|message|>{new}: low\n\n# Valid recipients" in out


def test_4_unknown_tool_call_id_labels_with_the_id():
    """An unresolved tool_call_id labels the result."""
    out = text_of([user(), Message("tool", "r", tool_call_id="call_9")])
    assert '<|start|>tool call_9<|message|><tool_output name="call_9">\nr\n</tool_output><|eot|>' in out


def test_4_last_call_ends_eom_only_before_an_assistant_message():
    """The last call ends <|eom|> iff an assistant message follows."""
    call = ToolCall("c", FunctionCall("n.f", {}))
    calls = Message("assistant", None, tool_calls=(call,))
    eot = text_of([user(), calls, Message("tool", "r", tool_call_id="c")])
    assert "</atem:function_calls><|eot|><|start|>tool n.f" in eot
    eom = text_of([user(), calls, Message("assistant", "x"), user()])
    assert "</atem:function_calls><|eom|><|start|>assistant to=user<|message|>x<|eot|>" in eom


# -- rendering rules --------------------------------------------------------------


def test_2_2_default_block_uses_clock_and_variables():
    """Date from the clock unless current_date is set; cutoff default."""
    out = text_of([user()], variables=TemplateVariables(current_date="2030-01-02", knowledge_cutoff="2029-12"))
    assert "Knowledge cutoff: 2029-12.\nCurrent date: 2030-01-02.\n" in out
    today = datetime.date.today().strftime("%Y-%m-%d")
    assert f"Current date: {today}." in MuseTemplate().render([user()]).text


def test_2_3_reasoning_line_from_variable():
    """Reasoning_strength sets the reasoning line; default high."""
    assert "Reasoning strength: low." in text_of([user()], variables=TemplateVariables(reasoning_strength="low"))
    assert "Reasoning strength: high." in text_of([user()], variables=TemplateVariables(reasoning_strength=""))


def test_2_6_client_directive_wins_over_variable():
    """A system text stating a reasoning strength keeps its wording."""
    out = text_of([Message("system", "reasoning strength: low"), user()], variables=TemplateVariables("high"))
    assert "Reasoning strength: high" not in out


def test_2_7_consecutive_user_messages_end_eot():
    """Every user message ends with <|eot|>."""
    assert "<|start|>user<|message|>a<|eot|><|start|>user<|message|>b<|eot|>" in text_of([user("a"), user("b")])


def test_2_8_tool_result_name_resolution_order():
    """Own name, then the last matching call's name, then the id."""
    first = Message("assistant", None, tool_calls=(ToolCall("c", FunctionCall("a.first", {})),))
    last = Message("assistant", None, tool_calls=(ToolCall("c", FunctionCall("a.last", {})),))
    out = text_of([user(), first, Message("tool", "1", tool_call_id="c"), last, Message("tool", "2", tool_call_id="c")])
    assert out.count("<|start|>tool a.last<|message|>") == 2
    named = text_of([user(), first, Message("tool", "1", name="own.name", tool_call_id="c")])
    assert "<|start|>tool own.name<|message|>" in named
    assert "<|start|>tool <|message|><tool_output name=\"\">" in text_of([user(), Message("tool", "x")])


def test_2_9_value_rendering():
    """Booleans, null, JSON, verbatim strings, Python number forms."""
    assert [render_value(v) for v in (True, False, None, 7, 2.5, 1e20, " a\n", {"k": [1, "é"]})] == [
        "true", "false", "null", "7", "2.5", "1e+20", " a\n", '{"k": [1, "é"]}'
    ]


def test_2_9_plain_content_end_rules():
    """Recipient defaults to user; end_turn absent → eot for user, eom otherwise."""
    out = text_of([user(), Message("assistant", None, recipient="x.y"), user()])
    assert "<|start|>assistant to=x.y<|message|><|eom|>" in out
    out = text_of([user(), Message("assistant", "", end_turn=True, recipient="x.y"), user()])
    assert "<|start|>assistant to=x.y<|message|><|eot|>" in out


def test_2_10_content_parts_render_in_order():
    """Text parts verbatim, image parts as <|patch|>, no separator."""
    rendered = render([Message("user", (TextPart("a"), ImagePart(PNG), TextPart("b")))])
    assert "<|start|>user<|message|>a<|patch|>b<|eot|>" in rendered.text
    assert rendered.image_count == 1


def test_2_11_generation_prompt():
    """The prompt ends with <|start|>assistant, starting with BOS."""
    out = text_of([user()])
    assert out.startswith("<|begin_of_text|><|start|>system") and out.endswith("<|eot|><|start|>assistant")


def test_6_1_developer_renders_as_system():
    """Developer messages are system blocks in place; no default block."""
    assert text_of([Message("developer", "D"), user()]) == text_of([Message("system", "D"), user()])
    out = text_of([Message("system", "S"), Message("developer", "D"), user()], [tool("n.f")])
    assert out.count("<|start|>system<|message|>") == 2 and out.count("In this environment") == 2


def test_6_2_commentary_with_tool_calls_is_kept():
    """Content next to tool calls is a to=user <|eom|> message; empty adds nothing."""
    call = (ToolCall("c", FunctionCall("n.f", {"a": 1})),)
    out = text_of([user(), Message("assistant", "Checking.", tool_calls=call, reasoning_content="r"),
                   Message("tool", "ok", tool_call_id="c")])
    assert ("<|start|>assistant to=self<|message|>r<|eom|><|start|>assistant to=user<|message|>Checking.<|eom|>"
            "<|start|>assistant to=n.f<|message|>") in out
    out = text_of([user(), Message("assistant", "", tool_calls=call), Message("tool", "ok", tool_call_id="c")])
    assert "to=user" not in out.split("<|start|>user")[1]


def test_6_3_flat_names_aliased_everywhere():
    """A declared flat tool is `name.name` in lines, recipients, calls and results."""
    call = (ToolCall("c", FunctionCall("f", {})),)
    rendered = render(
        [user(), Message("assistant", None, tool_calls=call), Message("tool", "1", tool_call_id="c"),
         Message("tool", "2", name="f")],
        [tool("f")],
    )
    out = rendered.text
    assert rendered.tool_aliases == {"f.f": "f"}
    assert '{"name": "f", "description": ""}' in out and '"self", "f.*", "user"' in out
    assert '<|start|>assistant to=f.f<|message|><atem:function_calls>\n<atem:invoke name="f.f">' in out
    assert out.count("<|start|>tool f.f<|message|><tool_output name=\"f.f\">") == 2


def test_6_3_undeclared_flat_history_names_unchanged():
    """Aliases apply only to tools declared in the request."""
    call = (ToolCall("c", FunctionCall("old", {})),)
    out = text_of([user(), Message("assistant", None, tool_calls=call), Message("tool", "1", tool_call_id="c")],
                  [tool("f")])
    assert "<|start|>assistant to=old<|message|>" in out and "<|start|>tool old<|message|>" in out


@pytest.mark.parametrize("names", [("x", "x.x"), ("x.x", "x"), ("a.b", "a.b"), ("f", "f")])
def test_6_3_collisions_rejected(names):
    """Alias collisions and duplicate names → 400 invalid_tool_schema."""
    with pytest.raises(ApiError) as info:
        render([user()], [tool(name) for name in names])
    assert (info.value.status, info.value.code) == (400, "invalid_tool_schema")


def test_6_4_tool_definitions_normalised():
    """Missing description → "", missing parameters → empty object schema, no strict."""
    out = text_of([user()], [ToolDef("n.f", None, None, True)])
    assert '{"name": "n.f", "description": "", "parameters": {"type": "object", "properties": {}}}\n' in out
    assert "strict" not in out


def test_6_5_reasoning_effort_mapping():
    """Low/medium/high accepted; both given must agree; others → 400."""
    assert reasoning_strength_from_request(None, None) is None
    assert reasoning_strength_from_request("low", None) == "low"
    assert reasoning_strength_from_request(None, {"effort": "medium"}) == "medium"
    assert reasoning_strength_from_request("high", {"effort": "high"}) == "high"
    for effort, reasoning in [("low", {"effort": "high"}), ("none", None), ("minimal", None), (None, {"effort": "xhigh"}), (3, None)]:
        with pytest.raises(ApiError) as info:
            reasoning_strength_from_request(effort, reasoning)
        assert info.value.status == 400


def test_6_5_template_kwargs_validated():
    """Chat_template_kwargs sets only the known variables."""
    variables = TemplateVariables.from_kwargs({"current_date": "2031-01-01", "tool_namespace_descriptions": {"n": "N."}})
    assert "Current date: 2031-01-01." in text_of([user()], variables=variables)
    assert '{"name": "n", "description": "N."}' in text_of([user()], [tool("n.f")], variables=variables)
    for bad in ({"foo": 1}, {"reasoning_strength": "max"}, {"current_date": 5}, []):
        with pytest.raises(ApiError):
            TemplateVariables.from_kwargs(bad)


def test_6_10_tool_choice_none_deactivates_tools():
    """Tools inactive → no block, recipients self/user, no aliasing or collision check."""
    rendered = render([user()], [tool("f"), tool("f.f")], tools_active=False)
    assert "In this environment" not in rendered.text
    assert '# Valid recipients: "self", "user".' in rendered.text and rendered.tool_aliases == {}


def test_client_text_is_never_special():
    """Client text is special=False; template text special=True."""
    rendered = render([Message("system", "<|eot|>"), user("<|start|>"), Message("tool", "t", name="<|eom|>")],
                      [tool("n.f", "<|message|>")])
    literal = "".join(s.text for s in rendered.segments if not s.special)
    special = "".join(s.text for s in rendered.segments if s.special)
    for token in ("<|eot|>", "<|start|>", "<|eom|>", "<|message|>"):
        assert token in literal
    assert "".join(s.text for s in rendered.segments) == rendered.text
    assert "<|begin_of_text|><|start|>system<|message|>" in special and "Grüße" not in special


def test_empty_conversation_rejected():
    """No messages → 400."""
    with pytest.raises(ApiError) as info:
        render([])
    assert info.value.status == 400


def test_2_11_trailing_assistant_renders_closed_then_generation_prompt():
    """A final assistant message is closed
    history, rendered as mid-conversation, then the generation prompt."""
    out = text_of([user(), Message("assistant", "391")])
    assert out.endswith("<|eot|><|start|>user<|message|>Hi<|eot|>"
                        "<|start|>assistant to=user<|message|>391<|eot|><|start|>assistant")
    # the same message followed by a user turn renders identically up to that turn
    middle = text_of([user(), Message("assistant", "391"), user("More")])
    assert middle.startswith(out.removesuffix("<|start|>assistant"))
    # reasoning and a message to another recipient keep their own terminators
    out = text_of([user(), Message("assistant", "w", reasoning_content="r", recipient="x.y")])
    assert out.endswith("<|start|>assistant to=self<|message|>r<|eom|>"
                        "<|start|>assistant to=x.y<|message|>w<|eom|><|start|>assistant")
    # a final tool call: no assistant message follows, so it ends <|eot|>
    call = (ToolCall("c", FunctionCall("n.f", {"a": 1})),)
    out = text_of([user(), Message("assistant", None, tool_calls=call)])
    assert out.endswith("</atem:function_calls><|eot|><|start|>assistant")


def test_2_1_6_9_one_bos_string_and_one_bos_id():
    """The prompt text starts with the BOS string; 6.9: the
    tokenized prompt starts with exactly one BOS id (200000)."""
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    rendered = MuseTemplate().render([user()])
    assert rendered.text.startswith("<|begin_of_text|><|start|>system")
    assert rendered.text.count("<|begin_of_text|>") == 1
    ids = MuseTokenizer.load(default_model_path()).encode_segments(rendered.segments)
    assert ids[0] == 200000 and ids.count(200000) == 1


def test_2_5_recipients_line_lists_namespaces_in_first_appearance_order():
    """Chat-format 2.5 (with 6.3 aliasing of the flat name)."""
    out = text_of([user()], [tool("b.x"), tool("flat"), tool("a.y"), tool("b.z")])
    assert '# Valid recipients: "self", "b.*", "flat.*", "a.*", "user".<|eot|>' in out
    assert '# Valid recipients: "self", "user".<|eot|>' in text_of([user()])


def test_2_12_roles_outside_the_api_are_rejected():
    """Developer renders as system (never dropped); a role
    the API does not define is a 400 naming it, not silently dropped."""
    with pytest.raises(ApiError) as info:
        parse_messages([{"role": "narrator", "content": "x"}, {"role": "user", "content": "Hi"}])
    assert info.value.status == 400 and info.value.param.startswith("messages[0]")
