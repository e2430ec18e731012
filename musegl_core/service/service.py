"""The generation service: the one way every API surface generates.

:class:`GenerationService` binds what the server was started with (the chat
template, the tool parser, the front's tokenizer, the worker, the metrics)
so that a surface only says *what* to generate::

    service = context.service                       # musegl_core.http.surface.SurfaceContext
    service.require_ready()                         # 503 model_loading before the worker is up
    plan = service.prepare(conversation, request_id="msg_...")  # or prepare_text(prompt, settings, ...)
    generation = service.generation(plan, arrived=arrived)
    await generation.open()                         # or open(until="admitted")
    async for event in generation.events(): ...

The pieces (:mod:`~musegl_core.service.conversation`,
:mod:`~musegl_core.service.prepare`, :mod:`~musegl_core.service.generation`,
:mod:`~musegl_core.service.events`) may also be used on their own.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from musegl_core.config import ServeConfig
from musegl_core.errors import unavailable
from musegl_core.service.conversation import Conversation, Settings
from musegl_core.service.generation import Generation
from musegl_core.service.prepare import Plan, ToolSetup, prepare, prepare_text
from musegl_core.worker import messages as m


class GenerationService:
    """Prepare conversations and run them on the worker (see the module docstring).

    ``tokenizer`` is the front's :class:`~musegl_core.http.front_tokenizer.FrontTokenizer`
    (loaded at start-up; its ``tokenizer`` is None until then or when it could
    not load). ``metered(arrived)`` wraps the worker so that every request's
    events are timed for ``/metrics``.
    """

    def __init__(self, config: ServeConfig, worker: Any, *, template: Any, tool_parser: Any, tokenizer: Any,
                 metered: Any = None):
        self.config = config
        self.worker = worker
        self.template = template
        self.tool_parser = tool_parser
        self._tokenizer = tokenizer
        self._metered = metered

    @property
    def tokenizer(self) -> Any:
        """The served tokenizer in the front (:class:`~musegl_core.tokenizer.MuseTokenizer`), or None."""
        return self._tokenizer.tokenizer if self._tokenizer is not None else None

    def require_ready(self) -> None:
        """503 ``model_loading`` unless the worker can generate."""
        if not self.worker.ready:
            raise unavailable("the model is loading or restarting", code="model_loading")

    def prepare(self, conversation: Conversation, *, request_id: str, tool_setup: ToolSetup | None = None) -> Plan:
        """:func:`musegl_core.service.prepare.prepare` with the server's template,
        tool parser and tokenizer; raises :class:`~musegl_core.errors.ApiError`."""
        return prepare(conversation, request_id=request_id, config=self.config, template=self.template,
                       tool_parser=self.tool_parser, tokenizer=self.tokenizer, tool_setup=tool_setup)

    def prepare_text(self, prompt: m.PromptSegment, settings: Settings, *, request_id: str,
                     include_usage: bool = False, n: int = 1) -> Plan:
        """:func:`musegl_core.service.prepare.prepare_text`: a raw prompt, no template
        (the output is the decoded text, without channels or tool calls)."""
        return prepare_text(prompt, settings, request_id=request_id, include_usage=include_usage, n=n)

    def generation(self, plan: Plan, *, arrived: float | None = None, client: str | None = None) -> Generation:
        """A :class:`Generation` for ``plan`` on the (metered) worker. A streamed
        plan's :meth:`~Generation.open` is bounded by ``--streaming-preflight-timeout``.
        ``arrived`` is ``time.monotonic()`` when the HTTP request arrived (latency metrics);
        ``client`` the admission fairness key (:func:`~musegl_core.service.sessions.peer_key`)."""
        if client is not None:
            plan = attrs.evolve(plan, generate=attrs.evolve(plan.generate, client=client))
        worker = self.worker
        if self._metered is not None:
            worker = self._metered(time.monotonic() if arrived is None else arrived)
        timeout = self.config.streaming_preflight_timeout if plan.stream else None
        return Generation(worker, plan, self.tool_parser, timeout)
