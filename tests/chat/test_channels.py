"""The channel parser: headers, messages, fences, ATEM blocks, streaming."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from musegl_core.chat.channels import (
    AtemBlockScanner,
    ChannelParser,
    ContentDelta,
    ReasoningDelta,
    ToolMessage,
    ToolMessageEnd,
    collect,
    match_header,
    parse_output,
)

CALL = (
    '<atem:function_calls>\n<atem:invoke name="get_time.get_time">\n'
    '<atem:parameter name="tz">UTC</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
)


def parsed(text, *, tools=False, hide=False, end="eos"):
    return parse_output(text, tools_active=tools, hide_reasoning=hide, end=end)


def check(text, reasoning=None, content=None, **kwargs):
    result = parsed(text, **kwargs)
    assert (result.reasoning, result.content) == (reasoning, content)
    return result


def test_r1_framing_removed_self_is_reasoning_user_is_content():
    """Framing is removed; to=self → reasoning, to=user → content."""
    check(" to=self<|message|>Think.<|eom|><|start|>assistant to=user<|message|>Hi!<|eot|>", "Think.", "Hi!")


def test_r2_no_header_is_implicit_visible_message():
    """Output without a header is an implicit visible message."""
    check("Just an answer.", None, "Just an answer.")


@pytest.mark.parametrize(
    "text",
    [
        " to=self<|message|>think<|eom|><|start|>assistant<|message|>Answer.<|eot|>",
        " to=self<|message|>think<|eom|>\n to=user<|message|>Answer.<|eot|>",
        " to=self<|message|>think<|eom|>assistant to=user<|message|>Answer.<|eot|>",
        " to=self<|message|>think<|eom|><|message|>Answer.<|eot|>",
    ],
)
def test_r3_header_forms_after_a_terminator(text):
    """Unaddressed, bare, <|start|>-less and <|message|>-only headers."""
    check(text, "think", "Answer.")


def test_r4_separators_and_control_only_bodies():
    """Bodies joined with "\\n\\n"; control-only bodies add none."""
    check(
        " to=self<|message|>one<|eom|><|start|>assistant to=self<|message|>two<|eom|><|start|>assistant"
        " to=user<|message|>A<|eom|><|start|>assistant to=user<|message|>B<|eot|>",
        "one\n\ntwo",
        "A\n\nB",
    )
    check(
        " to=self<|message|>A<|eom|><|start|>assistant to=self<|message|><|start|><|eom|><|start|>assistant"
        " to=self<|message|>B<|eom|><|start|>assistant to=user<|message|>C<|eot|>",
        "A\n\nB",
        "C",
    )


def test_r5_controls_removed_in_reasoning_literal_in_content():
    """Stray controls leave reasoning, stay in content."""
    check(
        " to=self<|message|>Think <|start|>more<|message|>.<|eom|><|start|>assistant to=user<|message|>ok<|eot|>",
        "Think more.",
        "ok",
    )
    text = "Headers start with <|start|> and end with <|message|>."
    check(f" to=user<|message|>{text}<|eot|>", None, text)


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (" to=user<|message|>Answer<|eo", "Answer"),
        (" to=user<|message|>Done.<|eom|><|start|>assistant to=us", "Done."),
        (" to=user<|message|>Answer<|start|>assist", "Answer"),
        (" to=user<|message|>Done.<|eom|> to=us", "Done."),
        (" to=self<|mess", None),
        (" to=user<|message|>x<|start|>assistant to=self<|message|>y<|", "x<|start|>assistant to=self<|message|>y"),
        ("to=us", None),
        (" to=user<|message|>a <", "a <"),
    ],
)
def test_r6_end_of_output_fragments(text, content):
    """`<|` fragments, incomplete <|start|> headers and (issue 25, amending
    output-grammar 5.3) any incomplete header at a header position are
    dropped at EOF."""
    check(text, None, content, end="length")


HEADER_CUTS = [" to", " to=", " to=u", " to=us", " to=use", " to=user", " to=self", " to=s", "assistant",
               "assistant to=user", "\n to=user", " to=get_time.get_time"]


@pytest.mark.parametrize("end", ["length", "eos", "stop", "cancel"])
@pytest.mark.parametrize("cut", HEADER_CUTS)
def test_generation_that_stops_inside_the_first_header_shows_nothing(cut, end):
    """Issue 25 item 8: max_tokens 1..5 under a constraint cut the forced
    ` to=user` header; the fragment is framing, never content — buffered,
    streamed character by character, with tools active or not."""
    for tools in (False, True):
        check(cut, None, None, end=end, tools=tools)
        parser = ChannelParser(tools_active=tools)
        events = [e for ch in cut for e in parser.feed(ch)] + parser.finish(end)
        assert collect(events).content is None and collect(events).reasoning is None
        assert not collect(events).tool_messages


def test_a_header_cut_after_a_message_keeps_the_message_only():
    check(" to=self<|message|>plan<|eom|> to=us", "plan", None, end="length")
    check(" to=user<|message|>Hi<|eom|>\n to=self", None, "Hi", end="length")
    # text that is not a header prefix still continues the previous message
    check(" to=user<|message|>Hi<|eom|> tomorrow", None, "Hi tomorrow", end="length")


def test_r7_quoted_header_literal_even_when_a_call_follows():
    """A header that is not at a header position is content."""
    quoted = "The model writes <|start|>assistant to=get_time.get_time<|message|> first."
    result = check(
        f" to=user<|message|>{quoted}<|eom|><|start|>assistant to=get_time.get_time<|message|>{CALL}<|eot|>",
        None,
        quoted,
        tools=True,
    )
    assert result.tool_messages == (ToolMessage("get_time.get_time", CALL, True),)


def test_r8_rejected_self_header_stays_visible_when_reasoning_hidden():
    """Hiding never touches header-like content."""
    check(
        " to=user<|message|>Quoted: <|start|>assistant to=self<|message|>secret<|eot|>",
        None,
        "Quoted: <|start|>assistant to=self<|message|>secret",
        hide=True,
    )


def test_r9_recipient_changes_only_after_a_terminator():
    """Unexpected text after a terminator continues the same recipient."""
    check(
        " to=self<|message|>plan<|eom|>oops<|start|>assistant to=user<|message|>Hi<|eot|>",
        "planoopsassistant to=userHi",
    )
    check(" to=self<|message|>I will answer. to=user<|message|>42<|eot|>", "I will answer. to=user42")
    check(" to=user<|message|>Part one.<|eom|> Part two.<|eot|>", None, "Part one. Part two.")


def test_r10_fenced_examples_keep_their_controls():
    """Terminators inside a fence are literal (then removed in reasoning)."""
    body = "Example:\n```\n<|start|>assistant to=self<|message|>x<|eom|>\n```\nDone"
    check(f" to=user<|message|>{body}<|eot|>", None, body)
    check(
        " to=self<|message|>Example:\n```\nhi<|eom|>\n```\nok<|eom|><|start|>assistant to=user<|message|>Hi<|eot|>",
        "Example:\n```\nhi\n```\nok",
        "Hi",
    )


def test_r11_unclosed_fence_keeps_everything_in_the_message():
    """After an unclosed fence no header or call is recognised."""
    rest = (
        "Here:\n```python\nprint(1)<|eom|><|start|>assistant to=weather.get_forecast<|message|>"
        '<atem:function_calls>\n<atem:invoke name="weather.get_forecast">\n'
        '<atem:parameter name="city">Oslo</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
    )
    result = check(f" to=user<|message|>{rest}", None, rest, tools=True)
    assert result.tool_messages == ()


def test_r12_fence_delimiter_details():
    """Info strings, closing runs, terminator-ended lines, tildes."""
    check(" to=user<|message|>``` a`b\nx<|eom|><|start|>assistant to=user<|message|>y<|eot|>", None, "``` a`b\nx\n\ny")
    tail = "```\ncode\n``` not closed\nstill<|eom|><|start|>assistant to=self<|message|>z"
    check(f" to=user<|message|>{tail}", None, tail)
    check(" to=user<|message|>```\ncode\n```<|eot|>", None, "```\ncode\n```")
    check(" to=user<|message|>~~~\n<|eom|>\n~~~\nend<|eot|>", None, "~~~\n<|eom|>\n~~~\nend")
    # A closing run shorter than the opening run does not close; indentation over 3 spaces neither.
    check(" to=user<|message|>````\n```\n<|eot|>x\n````<|eot|>", None, "````\n```\n<|eot|>x\n````")
    check(" to=user<|message|>```\n    ```\n<|eot|>\n``` \t<|eot|>", None, "```\n    ```\n<|eot|>\n``` \t")


def test_2_3_opening_line_ended_by_terminator_discards_the_fence():
    """An opening line ended by a terminator ends the message."""
    check(" to=user<|message|>```py<|eom|><|start|>assistant to=user<|message|>x<|eot|>", None, "```py\n\nx")


def test_2_3_fence_state_belongs_to_one_message():
    """Fence state starts closed in each message."""
    check(
        " to=self<|message|>```py<|eom|><|start|>assistant to=user<|message|>y\n```\nz<|eom|>",
        "```py",
        "y\n```\nz<|eom|>",
    )


def test_r13_tool_messages_are_handed_to_the_tool_parser():
    """Tool-addressed bodies reach the tool parser verbatim."""
    result = check(
        " to=self<|message|>Need the time.<|eom|><|start|>assistant to=get_time.get_time<|message|>"
        f"{CALL}<|eot|>",
        "Need the time.",
        None,
        tools=True,
    )
    assert result.tool_messages == (ToolMessage("get_time.get_time", CALL, True),)
    result = check(
        f" to=weather.get_forecast<|message|>\n{CALL}\n<|eom|><|start|>assistant to=get_time.get_time"
        f"<|message|>{CALL}<|eot|>",
        tools=True,
    )
    assert [m.body for m in result.tool_messages] == [f"\n{CALL}\n", CALL]
    result = check(
        f" to=user<|message|>One moment.<|eom|><|start|>assistant to=get_time.get_time<|message|>{CALL}<|eot|>",
        None,
        "One moment.",
        tools=True,
    )
    assert len(result.tool_messages) == 1


def test_r14_atem_intent_position():
    """Line-start intent outside code only; never in reasoning."""
    result = check(f" to=user<|message|>Let me check.\n{CALL}<|eot|>", None, "Let me check.\n", tools=True)
    assert result.tool_messages == (ToolMessage("user", CALL, True, intent=True),)
    for text in (f"Write {CALL} to call it.", f"Example:\n```\n{CALL}\n```", "Tags:\n<atem:foo> is not a tag."):
        result = check(f" to=user<|message|>{text}<|eot|>", None, text, tools=True)
        assert result.tool_messages == ()
    result = check(
        f" to=self<|message|>I could write:\n{CALL}<|eom|><|start|>assistant to=user<|message|>No need.<|eot|>",
        f"I could write:\n{CALL}",
        "No need.",
        tools=True,
    )
    assert result.tool_messages == ()
    check(" to=user<|message|>Let me check.\n<atem:func", None, "Let me check.\n<atem:func", tools=True, end="length")


def test_2_2_5_text_after_intent_block_continues_the_content():
    """Scanning continues in the same message after the block."""
    result = check(f" to=user<|message|>A\n{CALL}\nB<|eot|>", None, "A\n\nB", tools=True)
    assert [m.intent for m in result.tool_messages] == [True]


def test_2_2_5_broken_intent_block_resumes_content():
    """A block that deviates from the grammar is handed off
    incomplete (the tool parser reports it malformed) and the rest is content."""
    result = check(" to=user<|message|>A\n<atem:function_calls>\noops<|eot|>", None, "A\noops", tools=True)
    assert result.tool_messages == (ToolMessage("user", "<atem:function_calls>\n", False, intent=True),)


def test_r15_parameter_values_are_opaque():
    """Terminators and headers inside values are literal."""
    body = (
        '<atem:function_calls>\n<atem:invoke name="fs.write">\n<atem:parameter name="path"> a.txt </atem:parameter>\n'
        '<atem:parameter name="content">a<|eom|><|start|>assistant to=user<|message|>b\n</atem:parameter>\n'
        "</atem:invoke>\n</atem:function_calls>"
    )
    result = check(f" to=fs.write<|message|>{body}<|eot|>", tools=True)
    assert result.tool_messages == (ToolMessage("fs.write", body, True),)
    block = (
        '<atem:function_calls>\n<atem:invoke name="fs.write">\n<atem:parameter name="path">a</atem:parameter>\n'
        '<atem:parameter name="content">x<|eom|><|start|>assistant to=self<|message|>y</atem:parameter>\n'
        "</atem:invoke>\n</atem:function_calls>"
    )
    check(f" to=user<|message|>Run:\n{block}<|eot|>", None, f"Run:\n{block}", tools=False)


def test_2_2_7_tool_addressed_messages_are_content_when_tools_inactive():
    """Tool recipients are visible when tools are inactive."""
    result = check(f" to=get_time.get_time<|message|>{CALL}<|eot|>", None, CALL, tools=False)
    assert result.tool_messages == ()


def test_r17_non_atem_tool_body_is_handed_off_for_rejection():
    """A tool body that is not ATEM still ends at its terminator."""
    result = check(' to=get_time.get_time<|message|>{"tz": "UTC"}<|eot|>', tools=True)
    assert result.tool_messages == (ToolMessage("get_time.get_time", '{"tz": "UTC"}', True),)


def test_r17_r18_truncated_tool_message_is_incomplete():
    """Output ending inside a block → incomplete hand-off."""
    text = (
        " to=self<|message|>Need time.<|eom|> to=get_time.get_time<|message|><atem:function_calls>\n"
        '<atem:invoke name="get_time.get_time">\n<atem:parameter name="tz">U'
    )
    result = check(text, "Need time.", None, tools=True, end="length")
    assert result.tool_messages == (
        ToolMessage("get_time.get_time", text.split("<|message|>")[-1], False),
    )


def test_2_1_4_text_after_a_tool_message_continues_it():
    """Non-whitespace after a tool message's terminator joins its body."""
    result = check(f" to=get_time.get_time<|message|>{CALL}<|eom|>oops<|eot|>", tools=True)
    assert [m.body for m in result.tool_messages] == [CALL + "oops"]


def test_5_5_whitespace_after_final_terminator_dropped():
    """Whitespace after the last structural terminator is dropped."""
    check(" to=user<|message|>Hi<|eot|>\n \n", None, "Hi")


def test_1_recipient_must_be_followed_by_message():
    """` to=user <|message|>` is not a header."""
    check(" to=user <|message|>Hi", None, " to=user <|message|>Hi")


def test_6_bodies_are_not_trimmed():
    """No trimming of bodies."""
    check(" to=user<|message|>  spaced \n<|eot|>", None, "  spaced \n")


def test_7_hidden_reasoning_emits_no_reasoning_events():
    """Hidden reasoning produces no reasoning deltas."""
    parser = ChannelParser(tools_active=False, hide_reasoning=True)
    events = parser.feed(" to=self<|message|>secret<|eom|><|start|>assistant to=user<|message|>ok<|eot|>")
    events += parser.finish("eos")
    assert events == [ContentDelta("ok")]


def test_7_streaming_holds_back_only_ambiguous_text():
    """Settled text is emitted at once; `<|` prefixes are held."""
    parser = ChannelParser(tools_active=False)
    assert parser.feed(" to=user<|message|>Hel") == [ContentDelta("Hel")]
    assert parser.feed("lo<|e") == [ContentDelta("lo")]
    assert parser.feed("ot|>") == []
    assert parser.finish("eos") == []


def test_7_tool_end_waits_for_the_next_header():
    """A tool message is closed once the next header is known."""
    parser = ChannelParser(tools_active=True)
    events = parser.feed(f" to=get_time.get_time<|message|>{CALL}<|eom|>")
    assert not any(isinstance(event, ToolMessageEnd) for event in events)
    events = parser.feed("<|start|>assistant to=user<|message|>x")
    assert events[0] == ToolMessageEnd("get_time.get_time", True)
    assert events[-1] == ContentDelta("x")


def test_finish_validates_the_end_reason():
    """The end of generation is eos, length, stop or cancel."""
    with pytest.raises(ValueError):
        ChannelParser(tools_active=False).finish("timeout")


def test_match_header_kinds():
    """Header grammar, partial prefixes at the buffer end."""
    assert match_header(" to=x<|message|>", 1) == ("full", "x", 16)
    assert match_header("<|start|>assistant<|message|>", 0)[:2] == ("full", None)
    assert match_header("<|start|>assistant to=us", 0)[0] == "partial"
    assert match_header("tomorrow", 0)[0] == "none"


def test_atem_block_scanner_statuses():
    """The block framing ends at its closing tag or deviates."""
    body = CALL[len("<atem:function_calls>") :]
    assert AtemBlockScanner().advance(body + "tail", 0) == (len(body), "done")
    assert AtemBlockScanner().advance("\n<atem:invoke name=\"\">", 0)[1] == "malformed"
    assert AtemBlockScanner().advance("\n<atem:inv", 0)[1] == "more"
    assert AtemBlockScanner().advance("</atem:function_calls>", 0) == (0, "malformed")  # no invoke


# -- streaming equals buffered ---------------------------------------------------

CORPUS = [
    " to=self<|message|>Think <|start|>more<|message|>.<|eom|><|start|>assistant to=user<|message|>ok<|eot|>",
    " to=user<|message|>Example:\n```\n<|start|>assistant to=self<|message|>x<|eom|>\n```\nDone<|eot|>",
    " to=self<|message|>plan<|eom|>oops<|start|>assistant to=user<|message|>Hi<|eot|>",
    " to=user<|message|>Done.<|eom|> to=us",
    " to=user<|message|>Answer<|start|>assist",
    f" to=self<|message|>t<|eom|>\n to=get_time.get_time<|message|>\n{CALL}<|eom|> x<|eot|>",
    f" to=user<|message|>Let me check.\n{CALL}\nafter<|eot|>\n",
    ' to=fs.write<|message|><atem:function_calls>\n<atem:invoke name="fs.write">\n<atem:parameter '
    'name="c">a<|eom|></atem:parameter</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eot|>',
    " to=user<|message|>``` a`b\nx<|eom|><|start|>assistant<|message|>~~~\n<|eom|>\n~~~<|eot|>",
    " to=user<|message|>Let me check.\n<atem:func",
    "Just <| text <atem:function_calls> <|end_of_text|>",
]


def _stream(text, cuts, **kwargs):
    parser = ChannelParser(tools_active=kwargs["tools"], hide_reasoning=kwargs["hide"])
    events, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.finish(kwargs["end"])
    for event in events:  # no delta ever carries a structural token
        if isinstance(event, (ReasoningDelta, ContentDelta)):
            assert event.text
    return collect(events)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    index=st.integers(0, len(CORPUS) - 1),
    tools=st.booleans(),
    hide=st.booleans(),
    end=st.sampled_from(["eos", "length", "stop", "cancel"]),
    truncate=st.booleans(),
)
def test_7_streaming_equals_buffered_for_every_chunking(data, index, tools, hide, end, truncate):
    """For every chunking (including splits inside
    control tokens, headers and ATEM tags) streamed events assemble to the buffered result.
    Splits inside multi-byte UTF-8 characters never reach the parser: the detokenizer
    emits only complete characters."""
    text = CORPUS[index]
    if truncate:
        text = text[: data.draw(st.integers(0, len(text)))]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    kwargs = dict(tools=tools, hide=hide, end=end)
    assert _stream(text, cuts, **kwargs) == parsed(text, **kwargs)


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(
            ["<|start|>", "assistant", " to=", "self", "user", "ns.fn", "<|message|>", "<|eom|>", "<|eot|>",
             "<|", "\n", "```", "~~~", " ", "x", "<atem:function_calls>", '<atem:invoke name="a">',
             '<atem:parameter name="p">', "</atem:parameter>", "</atem:invoke>", "</atem:function_calls>"]
        ),
        max_size=25,
    ).map("".join),
    data=st.data(),
    tools=st.booleans(),
)
def test_7_streaming_equals_buffered_on_generated_outputs(text, data, tools):
    """Per-character streaming equals buffered parsing on arbitrary
    mixtures of control tokens, fences and ATEM tags."""
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=30))
    kwargs = dict(tools=tools, hide=False, end="length")
    assert _stream(text, cuts, **kwargs) == parsed(text, **kwargs)
    assert _stream(text, range(len(text)), **kwargs) == parsed(text, **kwargs)


# -- token ids → detokenizer → parser -----------------

_TOKEN_PIECES = [
    "<|start|>", "assistant", " to=", "self", "user", "ns.fn", "<|message|>", "<|eom|>", "<|eot|>",
    "<|", "\n", "```", " ", "x", "é", "日本", "😀", "👩‍👧", "<atem:function_calls>",
    '<atem:invoke name="a">', '<atem:parameter name="p">', "</atem:parameter>", "</atem:invoke>",
    "</atem:function_calls>",
]
_CONTROL_PIECES = {"<|start|>", "<|message|>", "<|eom|>", "<|eot|>"}


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from musegl_core.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _piece_ids(tokenizer, piece: str, how: int) -> list[int]:
    """``how``: 0 = the tokenizer's own ids (a control token is one id), 1 = one
    single-byte token per byte (every split inside multi-byte characters and,
    for control strings, inside the token's spelling), 2 = plain BPE (control
    strings written out as ordinary text)."""
    from musegl_core.tokenizer import byte_level_alphabet

    if how == 1:
        alphabet = byte_level_alphabet()
        return [tokenizer.token_id(alphabet[b]) for b in piece.encode()]
    return tokenizer.encode(piece, special=how == 0 and piece in _CONTROL_PIECES)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(st.tuples(st.sampled_from(_TOKEN_PIECES), st.integers(0, 2)), max_size=30),
    data=st.data(),
    tools=st.booleans(),
    end=st.sampled_from(["eos", "length", "stop"]),
)
def test_7_token_stream_equals_buffered_for_every_split(tiny_tokenizer, pieces, data, tools, end):
    """Streamed equals buffered through the real pipeline: the
    generated ids are grouped into worker events at random boundaries — inside
    multi-byte UTF-8 characters and inside control-token spellings — decoded by the
    incremental detokenizer and fed to the parser; the result equals buffered parsing
    of the whole text, and the reasoning-token count does not depend on the grouping."""
    from musegl_core.engine.detokenize import IncrementalDetokenizer
    from musegl_core.openai.chat import reasoning_tokens

    ids = [i for piece, how in pieces for i in _piece_ids(tiny_tokenizer, piece, how)]
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(ids)), max_size=12)))) + [len(ids)]
    parser = ChannelParser(tools_active=tools)
    detokenizer = IncrementalDetokenizer(tiny_tokenizer)
    chars = []  # what the worker reports per id
    events, last = [], 0
    for cut in cuts:
        pieces_ = [detokenizer.push(i) for i in ids[last:cut]]
        chars += [len(p) for p in pieces_]
        events += parser.feed("".join(pieces_))
        last = cut
    events += parser.feed(detokenizer.flush()) + parser.finish(end)
    text = tiny_tokenizer.decode(ids)
    assert collect(events) == parsed(text, tools=tools, end=end)

    whole = ChannelParser(tools_active=tools)
    whole.feed(text)
    whole.finish(end)
    assert whole.message_starts == parser.message_starts
    assert reasoning_tokens(parser.message_starts, chars) == reasoning_tokens(whole.message_starts, chars)


def test_long_outputs_fed_in_small_chunks_stay_linear_and_identical():
    """Streaming = buffered also past buffer compaction (consumed text is dropped
    after 64 KiB): a 400 KB output with several messages, fed 7 characters at a
    time, gives the same reasoning, content and message offsets as one feed."""
    text = (
        " to=self<|message|>" + "think " * 30000 + "<|eom|>"
        "<|start|>assistant to=user<|message|>" + "answer\n" * 20000 + "```\n<|eot|>\n```\n"
        + "more " * 10000 + "<|eot|>"
    )
    whole = ChannelParser(tools_active=False)
    buffered = collect(whole.feed(text) + whole.finish("eos"))
    chunked = ChannelParser(tools_active=False)
    events = []
    for i in range(0, len(text), 7):
        events += chunked.feed(text[i : i + 7])
    events += chunked.finish("eos")
    assert collect(events) == buffered
    assert chunked.message_starts == whole.message_starts
    assert len(chunked.message_starts) == 2 and chunked.message_starts[1][0] > 180000
