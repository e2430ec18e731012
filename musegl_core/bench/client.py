"""One streamed chat completion, timed from the client's side.

:func:`stream_chat` posts a request with ``stream: true`` and
``stream_options.include_usage`` and reads the SSE events as they arrive:

* **TTFT** is the time from sending the request to the first content or
  reasoning delta (the server sends headers only after prefill, so this
  includes queueing and prefill);
* **inter-token latencies** are the gaps between later deltas (a delta may
  carry more than one token when the detokenizer holds back bytes);
* output, prompt and cached token counts come from the usage chunk.

Failures never raise: an HTTP error status, an SSE error event, a stream that
ends without ``[DONE]`` or a transport error becomes :attr:`RequestResult.error`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import httpx

#: Request kinds: an independent ``chat`` prompt, an ``agent`` turn in a
#: session, and the anonymous ``baseline`` replay of an agent history.
KINDS = ("chat", "turn", "baseline")


@attrs.define
class RequestResult:
    """What one request measured (times in seconds, relative to its start)."""

    kind: str
    conversation: int = 0
    turn: int = 0
    started: float = 0.0  # time.perf_counter() when the request was sent
    ttft: float | None = None
    latency: float | None = None
    itls: list[float] = attrs.field(factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    content: str = ""
    reasoning: str = ""
    #: the answer in the API's own shape, for the client to resend (``--api`` replays): Chat
    #: Completions tool calls, Messages content blocks, Responses output items
    reply: list[dict[str, Any]] = attrs.field(factory=list)
    #: which API answered (``chat``, ``messages``, ``responses``)
    api: str = "chat"
    #: size of the request body's JSON (set by the ``--api`` replays)
    request_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


def chat_body(
    messages: tuple[dict[str, Any], ...],
    *,
    max_tokens: int,
    session_id: str | None = None,
    seed: int | None = None,
    model: str = "musegl-bench",
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The request body the bench sends: greedy, exactly ``max_tokens`` tokens."""
    body: dict[str, Any] = {
        "model": model,
        "messages": list(messages),
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if seed is not None:
        body["seed"] = seed
    if session_id is not None:
        body["session_id"] = session_id
    if tools:
        body["tools"] = tools
    return body


def error_text(payload: Any, fallback: str) -> str:
    """An error body's ``code: message`` (OpenAI's and Anthropic's error objects), or ``fallback``."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type") or "error"
        return f"{code}: {error.get('message', '')}".strip()
    return fallback


@attrs.define
class OutputClock:
    """Times a stream's output: the first piece is the TTFT, each later one an inter-token latency."""

    start: float
    last: float | None = None

    def output(self, result: RequestResult) -> None:
        now = time.perf_counter()
        if self.last is None:
            result.ttft = now - self.start
        else:
            result.itls.append(now - self.last)
        self.last = now


#: A stream reader: takes the ``data:`` payloads, fills the result (``reply``: index -> item,
#: in the API's own shape), and says whether the stream reached its end.
Reader = Callable[[AsyncIterator[str], RequestResult, OutputClock, dict[int, dict[str, Any]]], Awaitable[bool]]


async def _data(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None,
                result: RequestResult) -> AsyncIterator[str]:
    """The ``data:`` payloads of the SSE answer, as text; an error status fills ``result.error``."""
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raw = await response.aread()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = None
            result.error = f"HTTP {response.status_code} " + error_text(payload, raw[:200].decode(errors="replace"))
            return
        async for line in response.aiter_lines():
            if line.startswith("data:"):  # not blank separators and keepalive comments
                yield line[5:].strip()


async def post_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult,
                      read: Reader, *, headers: dict[str, str] | None = None,
                      end: str = "[DONE]") -> RequestResult:
    """Send ``body`` and fill ``result`` with ``read``; a transport error, data that is not
    JSON or a stream that stops before its ``end`` becomes ``result.error``."""
    result.started = start = time.perf_counter()
    reply: dict[int, dict[str, Any]] = {}
    done = False
    try:
        # aclosing: a reader that returns at the end event closes the stream (and frees its
        # connection) here, not whenever the abandoned generator is collected
        async with contextlib.aclosing(_data(client, url, body, headers, result)) as data:
            done = await read(data, result, OutputClock(start), reply)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    except (ValueError, KeyError) as exc:  # a data line that is not JSON, an event without its fields
        result.error = f"bad SSE data: {exc!r}"
    result.latency = time.perf_counter() - start
    result.reply = [reply[i] for i in sorted(reply)]
    if result.error is None and not done:
        result.error = f"the stream ended without {end}"
    return result


async def read_chat(data: AsyncIterator[str], result: RequestResult, clock: OutputClock,
                     calls: dict[int, dict[str, Any]]) -> bool:
    """Chat Completions chunks; tool calls merged from their deltas."""
    async for line in data:
        if line == "[DONE]":
            return True
        chunk = json.loads(line)
        if "error" in chunk:
            result.error = "stream " + error_text(chunk, "error")
            return False
        usage = chunk.get("usage")
        if usage:
            result.output_tokens = int(usage.get("completion_tokens") or 0)
            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = int(details.get("cached_tokens") or 0)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            reasoning = delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or ():
                merged = calls.setdefault(int(call.get("index") or 0),
                                          {"type": "function", "function": {"name": "", "arguments": ""}})
                merged["id"] = call.get("id") or merged.get("id", "")
                function = call.get("function") or {}
                merged["function"]["name"] += function.get("name") or ""
                merged["function"]["arguments"] += function.get("arguments") or ""
            if text or reasoning or delta.get("tool_calls"):
                clock.output(result)
                result.content += text
                result.reasoning += reasoning
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
    return False


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult,
                      *, headers: dict[str, str] | None = None) -> RequestResult:
    """Send ``body`` to ``url`` and fill ``result`` from the SSE stream (tool calls, merged
    from their deltas, go to ``result.reply``)."""
    return await post_stream(client, url, body, result, read_chat, headers=headers)
