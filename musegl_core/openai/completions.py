"""``POST /v1/completions``: a raw prompt, no chat template.

The prompt is exactly what the model reads: text in which special tokens are
written out (``<|start|>`` becomes its single id, as in ``musegl generate``)
or token ids; no BOS is added. Sampling, stop strings, ``max_tokens`` and the
context budget follow the chat endpoint's rules (the same functions check
them). Parameters of the legacy OpenAI endpoint that the engine does not
implement are refused by name: ``best_of`` above 1, ``echo``,
``suffix`` and ``logprobs``; so is a list of several prompts. ``n`` works as
in chat (1..``--max-n``, choices sharing the prompt's KV,
:mod:`musegl_core.service.choices`). ``logit_bias``,
the penalties and ``min_p`` are honoured as in chat (docs/constrained.md).

The response is OpenAI's ``text_completion`` object; a stream sends
``text_completion`` chunks (each naming its choice's ``index``), a finish
chunk per choice, one usage chunk when
``stream_options.include_usage`` is set, and ``[DONE]``.
"""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

import attrs

from musegl_core.config import ServeConfig
from musegl_core.errors import ApiError, bad_request, unsupported
from musegl_core.http import sse
from musegl_core.http.dialect import Dialect
from musegl_core.http.request_log import stream_failed
from musegl_core.http.schemas import to_json
from musegl_core.openai import schemas as s
from musegl_core.openai.chat import ResponseMeta, combined_usage, wire_usage
from musegl_core.service import events as ev
from musegl_core.service import stopping
from musegl_core.service.conversation import Settings
from musegl_core.service.generation import Generation
from musegl_core.service.prepare import Plan, prepare_text
from musegl_core.service.rules import cache_salt, choice_count, completion_limit, sampling_params, stop_strings
from musegl_core.worker import messages as m


#: A request that passed every front-side check (the service's raw-prompt plan).
CompletionPlan = Plan


#: ``max_tokens`` when a request gives none: OpenAI's default for this API (the Completions
#: reference: "defaults to 16"), not the context budget that Chat Completions uses
DEFAULT_MAX_TOKENS = 16


def prompt_error(error: ApiError) -> ApiError:
    """``error`` as this API names its input: a context overflow of the worker's (which counts
    ``messages``) names ``prompt``."""
    if error.code != "context_length_exceeded" or error.param != "messages":
        return error
    message = error.message.replace("in the messages", "in the prompt").replace(
        "the length of the messages", "the length of the prompt")
    return attrs.evolve(error, param="prompt", message=message)


def plan_completion(request: s.CompletionRequest, *, request_id: str, config: ServeConfig, service: Any = None
                    ) -> CompletionPlan:
    """Validate ``request``; raises :class:`ApiError` (400) before anything runs.
    ``service`` (the :class:`~musegl_core.service.service.GenerationService`)
    builds the plan; without one, :func:`~musegl_core.service.prepare.prepare_text` does."""
    _check_unsupported(request)
    n = choice_count(request.n, config, None)
    segment = prompt_segment(request.prompt)
    stream = bool(request.stream)
    limit = completion_limit(request) or DEFAULT_MAX_TOKENS
    settings = Settings(
        max_tokens=limit,
        sampling=sampling_params(request),
        stop=stop_strings(request.stop),
        stop_token_ids=stopping.stop_token_ids(request.stop_token_ids),
        min_tokens=stopping.min_tokens(request.min_tokens, limit),
        ignore_eos=bool(request.ignore_eos),
        add_bos=False,
        stream=stream,
        cache_salt=cache_salt(request.cache_salt),
        special_tokens="none" if request.skip_special_tokens else "all",
    )
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    build = prepare_text if service is None else service.prepare_text
    return build(segment, settings, request_id=request_id, include_usage=include_usage, n=n)


#: Fields typed on :class:`~musegl_core.openai.schemas.CompletionRequest` only to be
#: refused by name when present (a ``null`` is absent), with what to use instead.
REFUSED_FIELDS = {
    "session_id": "sessions are a chat feature: /v1/completions is stateless (use /v1/chat/completions)",
    "prompt_logprobs": "prompt logprobs are not supported by this server",
    "spaces_between_special_tokens": "the raw text is returned exactly as decoded; it cannot be changed",
    "include_stop_str_in_output": "a matched stop string is always removed from the output",
    "n_probs": "per-token probabilities are not supported on /v1/completions",
    "n_predict": "use max_tokens",
}


def _check_unsupported(request: s.CompletionRequest) -> None:
    for name, reason in REFUSED_FIELDS.items():
        if getattr(request, name) is not None:
            raise unsupported(name, f"'{name}' is not supported on /v1/completions: {reason}")
    if request.best_of is not None and request.best_of != 1:
        raise unsupported("best_of", "only best_of=1 is supported (n gives several choices)")
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


def _object(meta: ResponseMeta, choices: list[s.CompletionChoice], usage: s.Usage | None = None) -> s.TextCompletion:
    return s.TextCompletion(meta.id, meta.created, meta.model, meta.system_fingerprint, choices, usage)


async def complete_text(generation: Generation, meta: ResponseMeta) -> s.TextCompletion:
    """Run the plan's choices to the end; the non-streaming response."""
    outputs = await generation.run()
    choices = [s.CompletionChoice(text=output.content_text, finish_reason=generation.finished[index].reason,
                                  index=index)
               for index, output in enumerate(outputs)]
    return _object(meta, choices, combined_usage([wire_usage(usage) for usage in generation.usages]))


class TextStream:
    """One streaming ``/v1/completions`` response; :meth:`open` waits until
    every choice has started (errors before that are ordinary HTTP errors)."""

    def __init__(self, generation: Generation, meta: ResponseMeta, dialect: Dialect):
        self.generation = generation
        self.plan = generation.plan
        self.meta = meta
        self.dialect = dialect

    async def open(self) -> None:
        """Submit and wait until generation is ready; raises :class:`ApiError`."""
        await self.generation.open()

    async def close(self) -> None:
        """Leave the worker requests (cancelling those not done)."""
        await self.generation.close()

    async def events(self) -> AsyncIterator[bytes]:
        """The SSE body, keepalives included."""
        async for item in sse.with_keepalive(self._body(), self.dialect.keepalive):
            yield item

    def _chunk(self, index: int, text: str, finish_reason: str | None = None) -> bytes:
        choice = s.CompletionChoice(text=text, finish_reason=finish_reason, index=index)
        return sse.data_event(to_json(_object(self.meta, [choice])))

    async def _body(self) -> AsyncIterator[bytes]:
        usages: list[s.Usage | None] = [None] * self.plan.n
        remaining = self.plan.n
        try:
            async for event in self.generation.events():
                if isinstance(event, ev.ContentDelta):
                    yield self._chunk(event.choice, event.text)
                elif isinstance(event, ev.UsageReport):
                    usages[event.choice] = wire_usage(event.usage)
                elif isinstance(event, ev.Finish):
                    yield self._chunk(event.choice, "", event.reason)
                    remaining -= 1
                    if remaining == 0:
                        if self.plan.include_usage:
                            yield sse.data_event(to_json(_object(self.meta, [], combined_usage(usages))))
                        yield sse.DONE
                elif isinstance(event, ev.Failure):
                    stream_failed(event.error)
                    yield sse.data_event(self.dialect.error_body(prompt_error(event.error)))
                    yield sse.DONE
        finally:
            await self.close()
