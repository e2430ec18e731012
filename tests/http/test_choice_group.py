"""The choices of one response (``n`` > 1) against a scripted fake worker:
submission order, all-or-nothing admission, cancellation of the other choices
after an error, and where each dialect puts the one usage object."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from musegl_core.engine.executor import SamplingParams
from musegl_core.errors import ApiError
from musegl_core.service.choices import ChoiceGroup, choice_requests, choice_seed
from musegl_core.openai.chat import ChatPlan, ChatStream, ResponseMeta, complete
from musegl_core.service.generation import Generation
from musegl_core.http.dialect import Dialect
from musegl_core.worker import messages as m

FOREVER = "forever"  # a script step: the request never produces another event


def busy() -> ApiError:
    return ApiError(503, "busy", "unavailable_error", "server_busy", retry_after=1)


class FakeWorker:
    """``generate`` as WorkerClient has it; ``scripts[i]`` are choice i's events
    (an ApiError is raised, FOREVER blocks). Records what happened in ``log``."""

    def __init__(self, scripts: list[list]):
        self.scripts = scripts
        self.log: list[tuple[str, int]] = []

    @contextlib.asynccontextmanager
    async def generate(self, request: m.Generate):
        index = int(request.id.rpartition("-")[2]) if "-" in request.id else 0
        self.log.append(("submit", index))
        finished = False

        async def events():
            nonlocal finished
            for step in self.scripts[index]:
                await asyncio.sleep(0)
                if step == FOREVER:
                    await asyncio.Event().wait()
                if isinstance(step, ApiError):
                    finished = True
                    raise step
                if isinstance(step, m.Started):
                    self.log.append(("started", index))
                yield step
                if isinstance(step, m.Done):
                    finished = True
                    return

        try:
            yield events()
        finally:
            self.log.append(("done" if finished else "cancel", index))


def started(i: int = 0) -> m.Started:
    return m.Started(f"r-{i}", 20)


def tokens(text: str) -> m.Tokens:
    return m.Tokens("r", (1,) * len(text.split()), text)


def done(count: int) -> m.Done:
    return m.Done("r", "length", None, prompt_tokens=20, completion_tokens=count, cached_tokens=16)


def plan(n: int, include_usage: bool = True) -> ChatPlan:
    generate = m.Generate(id="r", prompt=(m.PromptSegment(text="x"),))
    return ChatPlan(generate=generate, stream=True, include_usage=include_usage, hide_reasoning=False,
                    ignore_eos=False, n=n)


def meta() -> ResponseMeta:
    return ResponseMeta("chatcmpl-x", 0, "m", "fp")


async def body(stream: ChatStream) -> list:
    out = []
    async for item in stream._body():
        text = item.decode().removeprefix("data: ").strip()
        out.append(text if text == "[DONE]" else json.loads(text))
    return out


def test_choice_seeds_and_ids():
    generate = m.Generate(id="r", prompt=())
    assert [r.id for r in choice_requests(generate, 3)] == ["r", "r-1", "r-2"]
    assert [r.sampling.seed for r in choice_requests(generate, 2)] == [None, None]
    seeded = m.Generate(id="r", prompt=(), sampling=SamplingParams(seed=7))
    assert [r.sampling.seed for r in choice_requests(seeded, 3)] == [7, 8, 9]
    assert choice_seed(2**64 - 1, 1) == 0  # wraps: the sampler reads seeds modulo 2**64
    assert choice_seed(-5, 2) == -3


def test_the_other_choices_are_submitted_after_choice_0_started():
    worker = FakeWorker([[started(0), done(1)], [started(1), done(1)], [started(2), done(1)]])

    async def run():
        return await complete(Generation(worker, plan(3)), meta(), Dialect())

    result = asyncio.run(run())
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert worker.log.index(("started", 0)) < worker.log.index(("submit", 1))
    assert result.usage.completion_tokens == 3 and result.usage.prompt_tokens == 20
    assert result.usage.prompt_tokens_details.cached_tokens == 16


@pytest.mark.parametrize("streaming", [True, False])
def test_a_refused_choice_fails_the_response_and_cancels_the_admitted_ones(streaming):
    worker = FakeWorker([[started(0), FOREVER], [started(1), FOREVER], [busy()]])

    async def run():
        if streaming:
            await ChatStream(Generation(worker, plan(3)), meta(), Dialect()).open()
        else:
            await complete(Generation(worker, plan(3)), meta(), Dialect())

    with pytest.raises(ApiError) as caught:
        asyncio.run(run())
    assert caught.value.code == "server_busy"
    assert {("cancel", 0), ("cancel", 1), ("done", 2)} <= set(worker.log)


def test_the_preflight_timeout_covers_every_choice():
    worker = FakeWorker([[started(0), FOREVER], [FOREVER]])

    async def run():
        await ChatStream(Generation(worker, plan(2), preflight_timeout=0.2), meta(), Dialect()).open()

    with pytest.raises(ApiError) as caught:
        asyncio.run(run())
    assert caught.value.code == "preflight_timeout"
    assert {("cancel", 0), ("cancel", 1)} <= set(worker.log)


def test_an_error_after_headers_ends_the_stream_and_cancels_the_other_choices():
    failure = ApiError(502, "bad tool output", "server_error", "invalid_tool_output")
    worker = FakeWorker([[started(0), tokens("a"), FOREVER], [started(1), tokens("b"), failure],
                         [started(2), FOREVER]])

    async def run():
        stream = ChatStream(Generation(worker, plan(3)), meta(), Dialect())
        await stream.open()
        return await body(stream)

    events = asyncio.run(run())
    assert [e["choices"][0]["index"] for e in events[:3]] == [0, 1, 2]  # a role chunk per choice
    assert events[-2] == {"error": {"message": "bad tool output", "type": "server_error", "param": None,
                                    "code": "invalid_tool_output"}}
    assert events[-1] == "[DONE]"
    assert {("cancel", 0), ("cancel", 2)} <= set(worker.log)


def stream_of(dialect: Dialect, include_usage: bool = True) -> list:
    worker = FakeWorker([[started(0), tokens("a"), done(2)], [started(1), tokens("b"), tokens("c"), done(3)]])

    async def run():
        stream = ChatStream(Generation(worker, plan(2, include_usage)), meta(), dialect)
        await stream.open()
        return await body(stream)

    return asyncio.run(run())


def test_openai_dialect_sends_one_usage_chunk_after_every_finish():
    events = stream_of(Dialect())
    assert events[-1] == "[DONE]"
    finishes = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(e["choices"][0]["index"] for e in finishes) == [0, 1]
    usage = [e for e in events[:-1] if e.get("usage")]
    assert usage == [events[-2]] and events[-2]["choices"] == []
    assert usage[0]["usage"]["completion_tokens"] == 5 and usage[0]["usage"]["prompt_tokens"] == 20
    assert not any(e.get("usage") for e in stream_of(Dialect(), include_usage=False)[:-1])


def test_openrouter_dialect_puts_the_usage_on_the_last_finish_chunk():
    dialect = pytest.importorskip("musegl_openrouter.dialect")
    cls = next(v for v in vars(dialect).values() if isinstance(v, type) and issubclass(v, Dialect) and v is not Dialect)
    events = stream_of(cls())
    assert events[-1] == "[DONE]"
    with_usage = [e for e in events[:-1] if e.get("usage")]
    assert with_usage == [events[-2]]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert with_usage[0]["usage"]["completion_tokens"] == 5
