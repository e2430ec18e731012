"""``POST /v1/completions``: a raw prompt, no chat template.

The prompt is exactly what the model reads: text in which special tokens are
written out (``<|start|>`` becomes its single id, as in ``musegl generate``)
or token ids; no BOS is added. Sampling, stop strings, ``max_tokens`` and the
context budget follow the chat endpoint's rules (the same functions check
them). Parameters of the legacy OpenAI endpoint that the engine does not
implement are refused by name: ``n`` or ``best_of`` above 1, ``echo``,
``suffix`` and ``logprobs``; so is a list of several prompts. ``logit_bias``,
the penalties and ``min_p`` are honoured as in chat (docs/constrained.md).

The response is OpenAI's ``text_completion`` object; a stream sends
``text_completion`` chunks, the finish chunk, a usage chunk when
``stream_options.include_usage`` is set, and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, AsyncIterator

import attrs

from musegl_core.config import ServeConfig
from musegl_core.errors import ApiError, bad_request, unavailable
from musegl_core.http import schemas as s
from musegl_core.http import sse
from musegl_core.http.completions import (
    ResponseMeta,
    completion_limit,
    sampling_params,
    stop_strings,
    unsupported,
)
from musegl_core.http.dialect import Dialect
from musegl_core.worker import messages as m


@attrs.frozen
class CompletionPlan:
    generate: m.Generate
    stream: bool
    include_usage: bool
    image_count: int = 0  # never images


def plan_completion(request: s.CompletionRequest, *, request_id: str, config: ServeConfig) -> CompletionPlan:
    """Validate ``request``; raises :class:`ApiError` (400) before anything runs."""
    _check_unsupported(request)
    segment = prompt_segment(request.prompt)
    stream = bool(request.stream)
    generate = m.Generate(
        id=request_id,
        prompt=(segment,),
        max_tokens=completion_limit(request),
        sampling=sampling_params(request),
        stop=stop_strings(request.stop),
        ignore_eos=bool(request.ignore_eos),
        add_bos=False,
        stream=stream,
    )
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return CompletionPlan(generate=generate, stream=stream, include_usage=include_usage)


def _check_unsupported(request: s.CompletionRequest) -> None:
    for name in ("n", "best_of"):
        value = getattr(request, name)
        if value is not None and value != 1:
            raise unsupported(name, f"only {name}=1 is supported")
    if request.echo:
        raise unsupported("echo", "echo is not supported by this server")
    if request.suffix:
        raise unsupported("suffix", "suffix (insertion) is not supported by this server")
    if request.logprobs is not None:
        raise unsupported("logprobs", "logprobs are not supported by this server")


def prompt_segment(prompt: s.PromptField) -> m.PromptSegment:
    """The one prompt of a request: text (special tokens parsed) or token ids."""
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise unsupported("prompt", "one prompt per request: send each prompt as its own request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", param="prompt")
        return m.PromptSegment(text=prompt, special=True)
    if not prompt:
        raise bad_request("'prompt' must not be empty", param="prompt")
    if any(i < 0 for i in prompt):
        raise bad_request("prompt token ids must not be negative", param="prompt")
    return m.PromptSegment(token_ids=tuple(prompt))


def new_meta(model: str, backend: str) -> ResponseMeta:
    meta = ResponseMeta.new(model, backend)
    return attrs.evolve(meta, id=f"cmpl-{uuid.uuid4().hex}")


def _finish_reason(done: m.Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def _usage(done: m.Done) -> s.Usage:
    return s.Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
        prompt_tokens_details=s.PromptTokensDetails(cached_tokens=done.cached_tokens),
    )


def _object(meta: ResponseMeta, choices: list[s.CompletionChoice], usage: s.Usage | None = None) -> s.TextCompletion:
    return s.TextCompletion(meta.id, meta.created, meta.model, meta.system_fingerprint, choices, usage)


async def complete_text(worker: Any, plan: CompletionPlan, meta: ResponseMeta) -> s.TextCompletion:
    """Run ``plan`` to the end; the non-streaming response."""
    text: list[str] = []
    async with worker.generate(plan.generate) as events:
        async for event in events:
            if isinstance(event, m.Tokens):
                text.append(event.text)
            elif isinstance(event, m.Done):
                choice = s.CompletionChoice(text="".join(text), finish_reason=_finish_reason(event))
                return _object(meta, [choice], _usage(event))
    raise unavailable("the model worker ended the request without a result", code="worker_restarting")


class TextStream:
    """One streaming ``/v1/completions`` response; :meth:`open` waits for
    ``Started`` (errors before it are ordinary HTTP errors)."""

    def __init__(self, worker: Any, plan: CompletionPlan, meta: ResponseMeta, dialect: Dialect,
                 preflight_timeout: float | None = None):
        self.worker = worker
        self.plan = plan
        self.meta = meta
        self.dialect = dialect
        self.preflight_timeout = preflight_timeout
        self._context: contextlib.AbstractAsyncContextManager | None = None
        self._events: AsyncIterator[m.Event] | None = None

    async def open(self) -> None:
        self._context = self.worker.generate(self.plan.generate)
        self._events = await self._context.__aenter__()
        try:
            first = await asyncio.wait_for(anext(self._events), self.preflight_timeout)
        except asyncio.TimeoutError:
            await self.close()
            raise unavailable(
                f"generation did not start within --streaming-preflight-timeout ({self.preflight_timeout} s)",
                code="preflight_timeout",
            ) from None
        except BaseException:
            await self.close()
            raise
        if not isinstance(first, m.Started):
            await self.close()
            raise unavailable("the model worker sent an unexpected first event", code="worker_restarting")

    async def close(self) -> None:
        context, self._context = self._context, None
        if context is None:
            return
        task = asyncio.ensure_future(context.__aexit__(None, None, None))
        with contextlib.suppress(BaseException):
            await asyncio.shield(task)

    async def events(self) -> AsyncIterator[bytes]:
        async for item in sse.with_keepalive(self._body(), self.dialect.keepalive):
            yield item

    def _chunk(self, text: str, finish_reason: str | None = None) -> bytes:
        choice = s.CompletionChoice(text=text, finish_reason=finish_reason)
        return sse.data_event(s.to_json(_object(self.meta, [choice])))

    async def _body(self) -> AsyncIterator[bytes]:
        assert self._events is not None, "open() first"
        try:
            try:
                async for event in self._events:
                    if isinstance(event, m.Tokens) and event.text:
                        yield self._chunk(event.text)
                    elif isinstance(event, m.Done):
                        yield self._chunk("", _finish_reason(event))
                        if self.plan.include_usage:
                            yield sse.data_event(s.to_json(_object(self.meta, [], _usage(event))))
                        yield sse.DONE
                        return
                error = unavailable("the model worker ended the request without a result", code="worker_restarting")
            except ApiError as exc:
                error = exc
            yield sse.data_event(self.dialect.error_body(error))
            yield sse.DONE
        finally:
            await self.close()
