"""Sealed reasoning (issue 27 item 5): a token over the exact generated reasoning
ids that only this server process can open, the span of a closed reasoning block,
and the template writing a verified block back as those very ids."""

from __future__ import annotations

import pytest

from musegl_core.chat.messages import Message
from musegl_core.chat.template import MuseTemplate
from musegl_core.service.reasoning_seal import ReasoningSeal, SealedReasoning, message_spans, reasoning_block

OUTPUT = " to=self<|message|>Add them up.<|eom|><|start|>assistant to=user<|message|>4<|eot|>"


@pytest.fixture(scope="module")
def tokenizer():
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    return MuseTokenizer.load(str(default_model_path()))


def test_a_seal_opens_only_on_the_server_that_made_it():
    seal = ReasoningSeal.random()
    sealed = SealedReasoning((5, 200007, 123456, 7), opens_turn=True)
    token = seal.seal(sealed)
    assert seal.open(token) == sealed
    assert ReasoningSeal.random().open(token) is None  # another process: another secret
    flipped = token[:-3] + ("A" if token[-3] != "A" else "B") + token[-2:]
    assert seal.open(flipped) is None
    for junk in ("", "not base64 !", "EqA8", None, 42, token[:10], "A" * 200):
        assert seal.open(junk) is None


def test_a_seal_is_compact_for_long_reasoning():
    seal = ReasoningSeal.random()
    ids = tuple(range(100_000, 102_000))
    token = seal.seal(SealedReasoning(ids, False))
    assert seal.open(token).ids == ids and len(token) < 4 * len(ids)


def test_the_block_span_is_the_reasoning_message_and_checks_its_text(tokenizer):
    ids = tokenizer.encode(OUTPUT, special=True)
    channels = ["reasoning", "visible"]
    spans = message_spans(ids, channels, frozenset((tokenizer.eom_id, tokenizer.eot_id)))
    assert [channel for *_, channel in spans] == channels
    block, end = reasoning_block(ids, channels, sealed_through=0, text="Add them up.", tokenizer=tokenizer)
    assert block.opens_turn and end == len(block.ids) == ids.index(tokenizer.eom_id) + 1
    assert tokenizer.decode(list(block.ids)) == " to=self<|message|>Add them up.<|eom|>"
    assert reasoning_block(ids, channels, sealed_through=0, text="Something else", tokenizer=tokenizer) is None


def test_the_template_writes_a_verified_block_as_its_ids(tokenizer):
    ids = tokenizer.encode(" to=self<|message|>Add them up.<|eom|>", special=True)
    sealed = SealedReasoning(tuple(ids), opens_turn=True)
    template = MuseTemplate()
    messages = [Message("user", "2+2?"), Message("assistant", "4", reasoning_content="Add them up.",
                                                 reasoning_ids=sealed), Message("user", "and 3+3?")]
    rendered = template.render(messages)
    id_segments = [s for s in rendered.segments if s.token_ids is not None]
    assert [s.token_ids for s in id_segments] == [tuple(ids)]
    prompt = tokenizer.encode_segments(rendered.segments)
    first = tokenizer.encode_segments(template.render(messages[:1]).segments)
    assert prompt[: len(first) + len(ids)] == first + ids  # the turn 1 prompt, then exactly the generated ids
    plain = template.render([m if m.role != "assistant" else Message("assistant", "4", reasoning_content="Add them up.")
                             for m in messages])
    assert plain.text == rendered.text.replace("<|start|>assistant<|start|>assistant to=user",
                                               "<|start|>assistant to=self<|message|>Add them up.<|eom|>"
                                               "<|start|>assistant to=user")
