"""The service's settings type and its raw-prompt plans (``/v1/completions``)."""

from __future__ import annotations

import asyncio

import attrs
import pytest

from musegl_core.engine.executor import SamplingParams
from musegl_core.engine.request import RequestOptions
from musegl_core.service import events as ev
from musegl_core.service.conversation import Settings
from musegl_core.service.generation import Generation
from musegl_core.service.prepare import prepare_text
from musegl_core.worker import messages as m
from tests.http.test_choice_group import FakeWorker, started


def test_every_setting_is_a_worker_request_option_with_its_default():
    options = {field.name: field for field in attrs.fields(RequestOptions)}
    for field in attrs.fields(Settings):
        assert field.name in options, field.name
        assert field.default == options[field.name].default, field.name


def test_settings_build_the_worker_request():
    settings = Settings(max_tokens=5, sampling=SamplingParams(temperature=0.0), stop=("x",), session_id="s",
                        add_bos=False, special_tokens="none")
    segment = m.PromptSegment(text="hi", special=True)
    request = settings.request("r", (segment,), grammar="start: /a/")
    assert request == m.Generate(id="r", prompt=(segment,), max_tokens=5, sampling=SamplingParams(temperature=0.0),
                                 stop=("x",), session_id="s", add_bos=False, special_tokens="none",
                                 grammar="start: /a/")


def test_a_raw_plan_returns_the_decoded_text_as_it_is():
    """No channel parsing: harmony-looking text and a tool-call header stay content."""
    text = "<|channel|>analysis<|message|>not reasoning"
    worker = FakeWorker([[started(0), m.Tokens("r", (1, 2), text[:20]), m.Tokens("r", (3,), text[20:]),
                          m.Done("r", "stop", None, prompt_tokens=3, completion_tokens=3, cached_tokens=0)]])
    plan = prepare_text(m.PromptSegment(text="p"), Settings(add_bos=False, stream=True), request_id="r",
                        include_usage=True)
    assert plan.raw and plan.generate.add_bos is False and plan.generate.prompt == (m.PromptSegment(text="p"),)

    async def run():
        generation = Generation(worker, plan)
        await generation.open()
        return generation, [event async for event in generation.events()]

    generation, events = asyncio.run(run())
    deltas = [e.text for e in events if isinstance(e, ev.ContentDelta)]
    assert "".join(deltas) == text and generation.outputs[0].content_text == text
    assert not any(isinstance(e, (ev.ReasoningDelta, ev.ToolCallStart)) for e in events)
    finish = next(e for e in events if isinstance(e, ev.Finish))
    usage = next(e for e in events if isinstance(e, ev.UsageReport)).usage
    assert finish.reason == "stop" and usage.completion_tokens == 3 and usage.reasoning_tokens is None


def test_a_raw_plan_takes_no_logprobs():
    with pytest.raises(ValueError):
        prepare_text(m.PromptSegment(text="p"), Settings(logprobs=0), request_id="r")
