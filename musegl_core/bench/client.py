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

import json
import time
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


def _error_text(payload: Any, fallback: str) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type") or "error"
        return f"{code}: {error.get('message', '')}".strip()
    return fallback


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult,
                      *, headers: dict[str, str] | None = None) -> RequestResult:
    """Send ``body`` to ``url`` and fill ``result`` from the SSE stream (tool calls, merged
    from their deltas, go to ``result.reply``)."""
    result.started = start = time.perf_counter()
    last_delta: float | None = None
    done = False
    calls: dict[int, dict[str, Any]] = {}
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                raw = await response.aread()
                try:
                    payload = json.loads(raw)
                except ValueError:
                    payload = None
                result.error = f"HTTP {response.status_code} " + _error_text(payload, raw[:200].decode(errors="replace"))
                result.latency = time.perf_counter() - start
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and keepalive comments
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = "stream " + _error_text(chunk, "error")
                    break
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
                        now = time.perf_counter()
                        if last_delta is None:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last_delta)
                        last_delta = now
                        result.content += text
                        result.reasoning += reasoning
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    except ValueError as exc:  # a data line that is not JSON
        result.error = f"bad SSE data: {exc}"
    result.latency = time.perf_counter() - start
    result.reply = [calls[i] for i in sorted(calls)]
    if result.error is None and not done:
        result.error = "the stream ended without [DONE]"
    return result
