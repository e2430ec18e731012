"""The lazily activated call grammar (tool_choice "auto" with strict tools):
free output until a tool call opens, the strict tools' schemas inside it."""

from __future__ import annotations

import numpy as np
import pytest

from musegl_core.chat.messages import ToolDef
from musegl_core.constrain.grammar import lazy_grammars
from musegl_core.constrain.matcher import compile_lazy
from musegl_core.tiny import default_model_path
from musegl_core.tokenizer import MuseTokenizer

pytest.importorskip("musegl_atem")
from musegl_atem.grammar import call_grammar  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"]}
TOOLS = [ToolDef(name="get_weather", parameters=WEATHER, strict=True),
         ToolDef(name="free", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})]
CALL = ('<atem:function_calls>\n<atem:invoke name="get_weather.get_weather">\n'
        '<atem:parameter name="city">Oslo</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')


@pytest.fixture(scope="module")
def tokenizer():
    return MuseTokenizer.load(default_model_path())


def processor(tokenizer):
    found = call_grammar(TOOLS, {"lazy": True, "names": ["get_weather"], "free_names": ["free"]})
    return compile_lazy(lazy_grammars(found["trigger"], found["rules"]), tokenizer, tokenizer.vocab_size)


def allowed(mask, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def follow(tokenizer, text: str):
    """The masks before each id of ``text`` (None: free) and the processor."""
    ids = tokenizer.encode(text, special=True)
    proc = processor(tokenizer)
    masks = [proc.mask(ids[:i]) for i in range(len(ids) + 1)]
    return ids, masks, proc


def test_free_text_stays_free_and_a_tool_message_activates_the_grammar(tokenizer):
    head = " to=self<|message|>Think <atem:function_calls> here.<|eom|><|start|>assistant to=user<|message|>Sure. "
    text = head + "<|eom|><|start|>assistant to=get_weather.get_weather<|message|>" + CALL + "<|eom|>"
    ids, masks, proc = follow(tokenizer, text)
    opened = len(tokenizer.encode(head + "<|eom|><|start|>assistant to=get_weather.get_weather<|message|>",
                                  special=True))
    assert all(m is None for m in masks[:opened])  # reasoning, the answer and the header are free
    assert all(m is not None and allowed(m, t) for m, t in zip(masks[opened:len(ids)], ids[opened:]))
    assert masks[len(ids)] is None  # after the terminator: free again
    assert proc.activations == 1
    # inside the call the grammar forbids what the schema does: a parameter that is not declared
    prefix = tokenizer.encode(" to=x.y<|message|>" + CALL.split("<atem:parameter")[0] + '<atem:parameter name="',
                              special=True)
    mask = processor(tokenizer).mask(prefix)
    assert not allowed(mask, tokenizer.encode("z", special=False)[0]) and allowed(mask, tokenizer.encode("c", special=False)[0])


def test_a_line_start_call_in_a_visible_message_activates_it_and_the_message_goes_on_freely(tokenizer):
    text = " to=user<|message|>Let me look.\n" + CALL + " Done"
    ids, masks, proc = follow(tokenizer, text)
    opened = len(tokenizer.encode(" to=user<|message|>Let me look.\n<atem:function_calls>", special=True))
    done = len(tokenizer.encode(" to=user<|message|>Let me look.\n" + CALL, special=True))
    assert all(m is None for m in masks[:opened])  # free up to the trigger
    assert all(m is not None and allowed(m, t) for m, t in zip(masks[opened:done], ids[opened:done]))
    assert all(m is None for m in masks[done:])  # the message goes on freely
    assert proc.activations == 1
    # not at a line start, or in reasoning: no activation
    for other in (" to=user<|message|>see <atem:function_calls>\n", " to=self<|message|>\n<atem:function_calls>\n"):
        _, masks, proc = follow(tokenizer, other)
        assert all(m is None for m in masks) and proc.activations == 0


def test_a_non_strict_tool_stays_free_after_its_opening_tag(tokenizer):
    text = ' to=free.free<|message|><atem:function_calls>\n<atem:invoke name="free.free">\n<atem:parameter'
    ids, masks, _ = follow(tokenizer, text)
    opened = len(tokenizer.encode(' to=free.free<|message|><atem:function_calls>\n<atem:invoke name="free.free">',
                                  special=True))
    assert all(m is not None for m in masks[len(tokenizer.encode(" to=free.free<|message|>", special=True)):opened])
    assert all(m is None for m in masks[opened:])


def test_masks_follow_rollbacks_and_a_second_call(tokenizer):
    text = " to=a.b<|message|>" + CALL + "<|eom|><|start|>assistant to=a.b<|message|>" + CALL + "<|eot|>"
    ids, masks, proc = follow(tokenizer, text)
    assert proc.activations == 2
    for keep in (len(ids) - 3, 30, 5, len(ids) - 40):  # replaced ids (rejected drafts): the same masks again
        again = proc.mask(ids[:keep])
        assert (again is None and masks[keep] is None) or np.array_equal(again, masks[keep])
        proc.mask(ids)


def test_a_raw_string_value_ends_at_its_closing_tag_in_the_forced_call_grammar_too(tokenizer):
    # A value lexeme followed by the closing tag as a second lexeme (greedy
    # lexing) took "</atem" as value text and refused ":parameter".
    import llguidance

    from musegl_core.constrain.grammar import calls_grammar
    from musegl_core.constrain.matcher import ll_tokenizer

    grammar = calls_grammar(call_grammar(TOOLS, {"names": ["get_weather"]}), 0)
    compiled = llguidance.LLMatcher(ll_tokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(grammar),
                                    log_level=0)
    for value in ("Oslo", "a</atem b", "ten chars!"):
        matcher = compiled.deep_copy()
        text = " to=get_weather.get_weather<|message|>" + CALL.replace(">Oslo<", f">{value}<") + "<|eot|>"
        assert matcher.consume_tokens(tokenizer.encode(text, special=True)) and matcher.is_accepting(), value
    matcher = compiled.deep_copy()
    too_long = " to=get_weather.get_weather<|message|>" + CALL.replace(">Oslo<", ">eleven char<")
    assert not matcher.consume_tokens(tokenizer.encode(too_long, special=True))
