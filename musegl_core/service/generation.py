"""Running a prepared conversation: submit, wait for admission or prefill, stream typed events.

:class:`Generation` is what every API surface drives::

    plan = prepare(conversation, request_id=..., config=..., template=..., tool_parser=...)
    generation = Generation(worker, plan, tool_parser, preflight_timeout)
    await generation.open()          # raises ApiError: a plain HTTP error, nothing sent yet
    async for event in generation.events():
        ...                          # musegl_core.service.events; a Failure ends it
    # or, without streaming:
    outputs = await generation.run()  # one OutputAssembler per choice; raises ApiError

:meth:`Generation.open` submits the choices (:class:`~musegl_core.service.choices.ChoiceGroup`:
choice 0 first, the others once its prompt KV is in the prefix cache) and
returns once each has *started* (prefill done), or with ``until="admitted"``
once the worker has admitted the request (exact prompt and cached counts
known, prefill may still run: a surface that sends its headers then can keep
the connection alive with its own events during a long prefill; ``n`` must
be 1). ``preflight_timeout`` (``--streaming-preflight-timeout``) bounds that
wait. Leaving early (:meth:`Generation.close`, client disconnect) cancels
every worker request still running.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from musegl_core.errors import ApiError, unavailable
from musegl_core.service.choices import ChoiceGroup
from musegl_core.service import events as ev
from musegl_core.service.output import OutputAssembler, end_of_generation
from musegl_core.service.prepare import Plan
from musegl_core.worker import messages as m


def ended_early() -> ApiError:
    return unavailable("the model worker ended the request without a result", code="worker_restarting")


class Generation:
    """One response's worker requests and their output (see the module docstring).

    ``outputs[i]`` is choice ``i``'s :class:`OutputAssembler`: a surface
    reads accumulated text, tool calls, generated ids and logprobs there.
    """

    def __init__(self, worker: Any, plan: Plan, tool_parser: Any = None, preflight_timeout: float | None = None):
        self.plan = plan
        self.preflight_timeout = preflight_timeout
        self.group = ChoiceGroup(worker, plan.requests())
        self.outputs = [OutputAssembler(plan, tool_parser) for _ in range(plan.n)]
        self.finished: list[ev.Finish | None] = [None] * plan.n
        self.usages: list[ev.Usage | None] = [None] * plan.n

    @property
    def hide_reasoning(self) -> bool:
        return self.plan.hide_reasoning

    def counts(self, choice: int = 0) -> tuple[int, int] | None:
        """``(prompt_tokens, cached_tokens)`` of a choice once :meth:`open` saw it
        admitted (or started); None before."""
        event = self.group.admitted.get(choice) or self.group.started.get(choice)
        return None if event is None else (event.prompt_tokens, event.cached_tokens)

    async def open(self, until: str = "started") -> None:
        """Submit and wait until every choice has started (or, ``until="admitted"``,
        was admitted); raises :class:`ApiError` (everything submitted is cancelled)."""
        await self.group.open(self.preflight_timeout, until=until)

    async def close(self) -> None:
        """Leave the worker requests (cancelling those not done)."""
        await self.group.close()

    async def events(self) -> AsyncIterator[ev.GenerationEvent]:
        """The typed events after :meth:`open`, ending with every choice's
        :class:`~musegl_core.service.events.Finish` or one
        :class:`~musegl_core.service.events.Failure`. The first events repeat
        what :meth:`open` saw (``Admitted``, and ``Started`` where it waited for it)."""
        try:
            for index in range(self.plan.n):
                admitted = self.group.admitted.get(index)
                if admitted is not None:
                    yield ev.Admitted(index, admitted.prompt_tokens, admitted.cached_tokens)
                started = self.group.started.get(index)
                if started is not None:
                    yield ev.Started(index, started.prompt_tokens, started.cached_tokens)
            remaining = self.plan.n
            try:
                async for index, event in self.group.events():
                    if isinstance(event, m.Started):
                        yield ev.Started(index, event.prompt_tokens, event.cached_tokens)
                    elif isinstance(event, m.Tokens):
                        for item in self._deltas(index, self.outputs[index].feed(event)):
                            yield item
                    elif isinstance(event, m.Done):
                        remaining -= 1
                        for item in self._finish(index, event):
                            yield item
                if remaining == 0:
                    return
                error = ended_early()
            except ApiError as exc:
                error = exc
            await self.close()  # cancel the other choices before the surface tells the client
            yield ev.Failure(error)
        finally:
            await self.close()

    async def run(self) -> list[OutputAssembler]:
        """Run every choice to the end (no streaming): :meth:`open`, then the
        events, into :attr:`outputs`; raises the first error. Usage and finish
        reasons are in :attr:`usages` and :attr:`finished`."""
        await self.group.open()
        try:
            async for event in self.events():
                if isinstance(event, ev.Failure):
                    raise event.error
        finally:
            await self.close()
        if any(finish is None for finish in self.finished):
            raise ended_early()
        return self.outputs

    def _deltas(self, index: int, out: Any) -> list[ev.GenerationEvent]:
        """Reasoning then content of one worker batch; never an empty one. The
        first carries the batch's logprob entries (when asked for)."""
        items: list[ev.GenerationEvent] = []
        logprobs = self.outputs[index].logprob_entries(unsent=True) if out.reasoning or out.content else None
        if out.reasoning:
            items.append(ev.ReasoningDelta(index, out.reasoning, logprobs))
            logprobs = None
        if out.content:
            items.append(ev.ContentDelta(index, out.content, logprobs))
        return items

    def _finish(self, index: int, done: m.Done) -> list[ev.GenerationEvent]:
        output = self.outputs[index]
        out, reason = output.finish(done)  # an invalid call set raises ApiError: the response fails
        items = self._deltas(index, out)
        for number, call in enumerate(output.calls):
            items += [ev.ToolCallStart(index, number, call.id, call.name),
                      ev.ToolCallArgumentsDelta(index, number, call.arguments),
                      ev.ToolCallEnd(index, number)]
        usage = output.usage(done)
        self.usages[index] = usage
        limit = self.plan.generate.max_tokens
        finish = ev.Finish(
            index,
            reason,
            end=end_of_generation(done),
            matched_stop=done.matched_stop,
            context_full=done.finish_reason == "length" and (limit is None or done.completion_tokens < limit),
            logprobs=output.logprob_entries(unsent=True),
        )
        self.finished[index] = finish
        items += [ev.UsageReport(index, usage), finish]
        return items
