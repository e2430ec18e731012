"""ATEM markup and call-set rules: block framing, values, call sets and their errors."""

from __future__ import annotations

import pytest

from musegl_atem.parser import scan_piece

from atem_support import FORECAST, GET_TIME, block, call, is_output_error, run

TOOLS = [FORECAST, GET_TIME]
CHUNKS = [None, 1, 7]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_r13_reasoning_then_call_with_alias_mapped_back(chunk):
    out = " to=self<|message|>Need the time.<|eom|><|start|>assistant" + call("get_time.get_time", [("tz", "UTC")])
    assert run(out, TOOLS, chunk=chunk) == [("get_time", {"tz": "UTC"})]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_r13_two_tool_messages_in_order(chunk):
    out = call("weather.get_forecast", [("city", "Oslo")]).replace("<|eot|>", "<|eom|><|start|>assistant")
    out += call("get_time.get_time", [("tz", "UTC")])
    assert run(out, TOOLS, chunk=chunk) == [("weather.get_forecast", {"city": "Oslo"}), ("get_time", {"tz": "UTC"})]


def test_several_invokes_in_one_block():
    text = block("get_time", [("tz", "UTC")]).replace(
        "</atem:invoke>\n</atem:function_calls>",
        '</atem:invoke>\n<atem:invoke name="get_time"><atem:parameter name="tz">CET</atem:parameter></atem:invoke></atem:function_calls>',
    )
    assert run(f" to=get_time.get_time<|message|>{text}<|eot|>", TOOLS) == [
        ("get_time", {"tz": "UTC"}),
        ("get_time", {"tz": "CET"}),
    ]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_r14_line_start_intent_block_is_a_call(chunk):
    out = " to=user<|message|>Let me check.\n" + block("get_time.get_time", [("tz", "UTC")]) + "<|eot|>"
    assert run(out, TOOLS, chunk=chunk) == [("get_time", {"tz": "UTC"})]


@pytest.mark.parametrize(
    "out",
    [
        " to=user<|message|>Write " + block("get_time.get_time", [("tz", "UTC")]) + " to call it.<|eot|>",
        " to=user<|message|>Example:\n```\n" + block("get_time.get_time", [("tz", "UTC")]) + "\n```<|eot|>",
        " to=self<|message|>I could write:\n" + block("get_time.get_time", [("tz", "UTC")]) + "<|eom|>",
        " to=user<|message|>Here:\n```python\nprint(1)<|eom|><|start|>assistant" + call("get_time.get_time", [("tz", "UTC")]),
    ],
    ids=["mid-line", "fenced", "reasoning", "unclosed-fence"],
)
def test_r11_r14_examples_stay_content(out):
    assert run(out, TOOLS) == []


def test_r15_values_keep_whitespace_headers_and_terminators():
    tool = FORECAST.__class__("fs.write", parameters={"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}})
    value = "a<|eom|><|start|>assistant to=user<|message|>b\n"
    out = call("fs.write", [("path", " a.txt "), ("content", value)])
    for chunk in CHUNKS:
        assert run(out, [tool], chunk=chunk) == [("fs.write", {"path": " a.txt ", "content": value})]


@pytest.mark.parametrize(
    "out",
    [
        call("weather.get_forecast", [("city", "A"), ("city", "B")]),
        call("foo.foo", []),
        " to=get_time.get_time<|message|>{\"tz\": \"UTC\"}<|eot|>",
        ' to=get_time.get_time<|message|><atem:function_calls>\n<atem:invoke name="get_time.get_time">\n<atem:parameter name="tz">U',
        " to=get_time.get_time<|message|><|eot|>",
        call("get_time.get_time", [("tz", "UTC")]).replace("<|eot|>", "<|eom|>trailing prose"),
        " to=user<|message|>Hi\n<atem:function_calls>\n<atem:foo>\nmore<|eot|>",
        ' to=x.y<|message|><atem:function_calls><atem:invoke name=""></atem:invoke></atem:function_calls><|eot|>',
    ],
    ids=["duplicate", "undefined", "not-atem", "eos-inside", "empty-message", "text-after", "broken-intent", "empty-name"],
)
def test_r17_failures_are_invalid_tool_output(out):
    assert is_output_error(run(out, TOOLS))


@pytest.mark.parametrize("end", ["length", "stop"])
def test_r18_truncation_suppresses_the_whole_call_set(end):
    complete = call("get_time.get_time", [("tz", "UTC")]).replace("<|eot|>", "<|eom|><|start|>assistant")
    cut = complete + ' to=weather.get_forecast<|message|><atem:function_calls>\n<atem:inv'
    assert run(cut, TOOLS, end=end) == []


def test_r18_completed_malformed_invoke_still_fails_when_truncated():
    bad = call("weather.get_forecast", [("city", "A"), ("city", "B")]).replace("<|eot|>", "<|eom|><|start|>assistant")
    assert is_output_error(run(bad + " to=get_time.get_time<|message|><atem:func", TOOLS, end="length"))


def test_scan_is_linear_and_reports_status():
    assert scan_piece(block("f", [("a", "1")]), message=False, closed=True).status == "complete"
    assert scan_piece(block("f", [("a", "1")])[:-5], message=False, closed=False).status == "incomplete"
    assert scan_piece('<atem:function_calls><atem:invoke name="f" x>', message=True, closed=False).status == "malformed"
