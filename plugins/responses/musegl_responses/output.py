"""Generation events → Responses output items and stream events.

:class:`ResponseBuilder` is fed the generation service's typed events and
returns, for each, the Responses stream events it causes (with
``sequence_number``, ``output_index``, ``content_index`` / ``summary_index``).
The same builder makes the non-streaming body (its events are dropped), so a
stream's ``response.completed`` and the JSON body are the same object, and
every ``output_item.done`` item is the one in ``output``:

* reasoning → a ``reasoning`` item: its text as a ``reasoning_text`` content
  part; with ``reasoning.summary`` also as one ``summary_text`` part (musegl
  has no summarizer); with ``include: ["reasoning.encrypted_content"]`` its
  ``encrypted_content`` seals the exact generated ids (the next turn restores them);
* visible text → a ``message`` item with one ``output_text`` part (logprobs
  when asked for);
* each tool call → a ``function_call`` (``arguments``) or ``custom_tool_call``
  (raw ``input``) item.

One item is open at a time; it is closed (``*.done`` events, then
``response.output_item.done``) before the next opens and before the final
``response.completed`` / ``response.incomplete`` / ``response.failed``.
"""

from __future__ import annotations

import json
from typing import Any

from musegl_core.errors import ApiError
from musegl_core.service import events as ev
from musegl_core.service.reasoning_seal import reasoning_block

from musegl_responses.planning import ResponsePlan, new_id


def wire_logprobs(entries: Any) -> list[dict[str, Any]]:
    if entries is None:
        return []
    return [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
             "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}
                              for t in e.top_logprobs]} for e in entries.content]


def wire_usage(usage: ev.Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
        "total_tokens": usage.total_tokens,
    }


def error_object(error: ApiError) -> dict[str, Any]:
    return {"code": error.code or error.type, "message": error.message}


class ResponseBuilder:
    """One response's output items and stream events (see the module docstring).

    ``output`` is the generation's :class:`~musegl_core.service.output.OutputAssembler`
    (generated ids, channel starts: what a reasoning seal needs), ``seal``
    the server's :class:`~musegl_core.service.reasoning_seal.ReasoningSeal`."""

    def __init__(self, plan: ResponsePlan, model: str, *, seal: Any, tokenizer: Any):
        self.plan = plan
        self.model = model
        self.seal = seal
        self.tokenizer = tokenizer
        self.output_assembler: Any = None
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.sealed: list[Any] = []  # per reasoning item: the SealedReasoning or None
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.usage_report: ev.Usage | None = None
        self.error: dict[str, Any] | None = None
        self.failure: ApiError | None = None
        self.started = False  # prefill is done (keep-alives are SSE comments from then on)
        self.incomplete: dict[str, Any] | None = None
        self._open: dict[str, Any] | None = None
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        self._sealed_through = 0
        self._calls: dict[int, dict[str, Any]] = {}
        self._pending_logprobs: list[dict[str, Any]] = []  # content entries not attached to a delta yet

    # -- objects -------------------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        """The response object as it stands."""
        return {
            "id": self.plan.id,
            "object": "response",
            "created_at": self.plan.created_at,
            "status": self.status,
            "model": self.model,
            "output": [dict(item) for item in self.items],
            "usage": self.usage,
            "error": self.error,
            "incomplete_details": self.incomplete,
            **self.plan.echo(),
        }

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return body

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and the first ``response.in_progress``."""
        return [self.event("response.created", response=self.response()), self.in_progress()]

    def in_progress(self) -> dict[str, Any]:
        return self.event("response.in_progress", response=self.response())

    # -- feeding -------------------------------------------------------------------------
    def feed(self, event: Any) -> list[dict[str, Any]]:
        if self.plan.logprobs and isinstance(event, (ev.ReasoningDelta, ev.ContentDelta, ev.Finish)):
            self._pending_logprobs += wire_logprobs(event.logprobs)  # a batch's entries ride on its first delta
        if isinstance(event, ev.ReasoningDelta):
            return self._reasoning(event.text)
        if isinstance(event, ev.ContentDelta):
            return self._content(event.text)
        if isinstance(event, ev.ToolCallStart):
            out = self.close()
            index = len(self.items)
            item = self.plan.tools.call_item(event.name, event.id, "{}", new_id("fc"), "in_progress")
            item = {**item, "arguments": ""} if item["type"] == "function_call" else {**item, "input": ""}
            if item["type"] == "custom_tool_call":
                item["id"] = new_id("ctc")
            self.items.append(item)
            self._calls[event.index] = {"index": index, "name": event.name, "id": event.id, "item_id": item["id"]}
            return out + [self.event("response.output_item.added", output_index=index, item=dict(item))]
        if isinstance(event, ev.ToolCallArgumentsDelta):
            call = self._calls[event.index]
            done = self.plan.tools.call_item(call["name"], call["id"], event.arguments, call["item_id"], "completed")
            item = self.items[call["index"]]
            if done["type"] == "custom_tool_call":
                item["input"] += done["input"]
                return [self.event("response.custom_tool_call_input.delta", item_id=item["id"],
                                   output_index=call["index"], delta=done["input"])]
            item["arguments"] += event.arguments
            return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=call["index"], delta=event.arguments)]
        if isinstance(event, ev.ToolCallEnd):
            call = self._calls[event.index]
            item = self.items[call["index"]]
            item["status"] = "completed"
            if item["type"] == "custom_tool_call":
                done = self.event("response.custom_tool_call_input.done", item_id=item["id"],
                                  output_index=call["index"], input=item["input"])
            else:
                done = self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=call["index"], name=item["name"], arguments=item["arguments"])
            return [done, self.event("response.output_item.done", output_index=call["index"], item=dict(item))]
        if isinstance(event, ev.UsageReport):
            self.usage_report = event.usage
            self.usage = wire_usage(event.usage)
            return []
        if isinstance(event, ev.Finish):
            out = self.close()
            if event.reason == "length":
                self.status = "incomplete"
                self.incomplete = {"reason": "max_output_tokens"}
                return out + [self.event("response.incomplete", response=self.response())]
            self.status = "completed"
            return out + [self.event("response.completed", response=self.response())]
        if isinstance(event, ev.Failure):
            return self.fail(event.error)
        return []

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        out = self.close(status="incomplete")
        self.status = "failed"
        self.failure = error
        self.error = error_object(error)
        return out + [self.event("response.failed", response=self.response())]

    def cancelled(self) -> list[dict[str, Any]]:
        """``POST /v1/responses/{id}/cancel`` ended it: status ``cancelled``; a
        stream ends with ``response.failed`` carrying that status (the API has no
        cancelled event) and the error code ``cancelled``."""
        out = self.close(status="incomplete")
        self.status = "cancelled"
        self.error = {"code": "cancelled", "message": "the response was cancelled"}
        return out + [self.event("response.failed", response=self.response())]

    # -- items -----------------------------------------------------------------------------
    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != "reasoning":
            out += self.close()
            index = len(self.items)
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            self.items.append(item)
            self._open = item
            self._text = []
            out.append(self.event("response.output_item.added", output_index=index, item=_copy(item)))
            if self.plan.summary:
                out.append(self.event("response.reasoning_summary_part.added", item_id=item["id"],
                                      output_index=index, summary_index=0, part={"type": "summary_text", "text": ""}))
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "reasoning_text", "text": ""}))
        item, index = self._open, len(self.items) - 1
        self._text.append(text)
        if self.plan.summary:
            out.append(self.event("response.reasoning_summary_text.delta", item_id=item["id"], output_index=index,
                                  summary_index=0, delta=text))
        out.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                              content_index=0, delta=text))
        return out

    def _content(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != "message":
            out += self.close()
            index = len(self.items)
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            self.items.append(item)
            self._open = item
            self._text, self._logprobs = [], []
            out.append(self.event("response.output_item.added", output_index=index, item=_copy(item)))
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=self._text_part("", [])))
        item, index = self._open, len(self.items) - 1
        entries, self._pending_logprobs = self._pending_logprobs, []
        self._text.append(text)
        self._logprobs += entries
        return out + [self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                 content_index=0, delta=text, logprobs=entries)]

    def _text_part(self, text: str, logprobs: list) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close the open reasoning or message item (its ``*.done`` events)."""
        item = self._open
        if item is None:
            return []
        self._open = None
        index = len(self.items) - 1
        text = "".join(self._text)
        out = []
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
            item["content"] = [part]
            if self.plan.summary:
                summary = {"type": "summary_text", "text": text}
                out.append(self.event("response.reasoning_summary_text.done", item_id=item["id"],
                                      output_index=index, summary_index=0, text=text))
                out.append(self.event("response.reasoning_summary_part.done", item_id=item["id"],
                                      output_index=index, summary_index=0, part=summary))
                item["summary"] = [summary]
            sealed = self._seal(text) if status == "completed" else None
            self.sealed.append(sealed)
            if self.plan.encrypted and sealed is not None:
                item["encrypted_content"] = self.seal.seal(sealed)
        else:
            self._logprobs += self._pending_logprobs  # entries the last batch reported with the finish
            self._pending_logprobs = []
            part = self._text_part(text, self._logprobs)
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=self._logprobs))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
            item["content"] = [part]
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return out

    def _seal(self, text: str) -> Any:
        """The exact ids of the reasoning just closed (None when they cannot be told)."""
        output = self.output_assembler
        if output is None or self.tokenizer is None:
            return None
        channels = [channel for _, channel in output.parser.message_starts]
        found = reasoning_block(output.ids, channels, sealed_through=self._sealed_through, text=text,
                                tokenizer=self.tokenizer)
        if found is None:
            return None
        if isinstance(found, tuple):
            sealed, self._sealed_through = found  # the block, and where the next one starts
        else:  # an older reasoning_block without the end index: the block ends where its ids do
            sealed = found
            start = 0 if found.opens_turn else _find(output.ids, found.ids, self._sealed_through)
            self._sealed_through = start + len(found.ids)
        return sealed


def _find(ids: list[int], piece: tuple[int, ...], start: int) -> int:
    for index in range(start, len(ids) - len(piece) + 1):
        if tuple(ids[index:index + len(piece)]) == piece:
            return index
    return start


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))
