"""One agent conversation as each client sends it, and its streamed answers read back.

``musegl bench --api messages|responses`` replays the conversation of
:mod:`musegl_core.bench.agent_script` the way Claude Code and Codex CLI send
theirs (``spec/agent-apis.md``), and the same conversation over Chat
Completions as the reference:

* :class:`MessagesConversation`: ``POST /v1/messages?beta=true``, ``system``
  as text blocks whose first is the ``x-anthropic-billing-header`` line with
  a ``cch`` nonce that changes on every request, the
  ``X-Claude-Code-Session-Id`` header (the same on every request), Claude
  Code's headers and body keys, ``stream: true``;
* :class:`ResponsesConversation`: ``POST /v1/responses`` with
  ``instructions``, ``input`` items, ``store: false``, ``prompt_cache_key``
  (the thread id) and the ``session-id`` / ``thread-id`` headers, reasoning
  items echoed with their ``encrypted_content``, assistant items without
  ``id`` and ``status``;
* :class:`ChatConversation`: the same system text, tools and turns as Chat
  Completions in a named session (``session_id``).

Every turn resends the whole history: the previous answer as the client
received it (thinking/reasoning with its signature, text, tool calls), then a
tool result for each call the answer made, or else a new user message. The
requests are greedy (``temperature: 0``, the one field the CLIs do not send)
so that two runs replay the same text; no ``ignore_eos`` (the Anthropic and
Responses APIs have none), so answers may end early.

The stream readers time the first generated output (TTFT: the first
``thinking``/``text``/``input_json`` delta, the first reasoning, output text
or call-input delta) and take the prompt and cached counts from the final
usage (Anthropic: prompt = ``input_tokens + cache_read_input_tokens +
cache_creation_input_tokens``; Responses: ``input_tokens``, cached
``input_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx

from musegl_core.bench import agent_script
from musegl_core.bench.client import OutputClock, RequestResult, error_text, post_stream, read_chat
from musegl_core.constrain.lark_embed import LARK_KEY

#: The values ``musegl bench --api`` accepts.
APIS = ("chat", "messages", "responses")

CLAUDE_CODE_VERSION = "2.1.328"
CODEX_VERSION = "0.169.0"
ANTHROPIC_BETA = ("claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
                  "effort-2025-11-24,advanced-tool-use-2025-11-20")


def billing_header(nonce: str) -> str:
    """Claude Code's first system block, with its per-request ``cch`` nonce."""
    return f"x-anthropic-billing-header: cc_version={CLAUDE_CODE_VERSION}.b1e; cc_entrypoint=cli; cch={nonce};"


@attrs.define
class Sizes:
    """Filler words of the conversation's parts (from the token sizes and the calibration)."""

    system_words: int
    turn_words: int


@attrs.define
class _Conversation:
    """What the three wire formats share: the script's position and the calls to answer."""

    index: int
    seed: int
    sizes: Sizes
    base_url: str
    model: str
    max_tokens: int
    api_key: str | None = None
    #: names the run in the system prompt, so that no run reuses another's prefix cache
    run_id: str = ""
    turn: int = 0
    #: (call id, kind) of the calls in the previous answer, answered at the next turn
    pending: list[tuple[str, str]] = attrs.field(factory=list)
    #: the client's conversation key (the Chat Completions reference's: its session's name)
    session_key: str = attrs.field(factory=lambda: str(uuid.uuid4()))

    @property
    def session_name(self) -> str:
        """The session the server runs the conversation in."""
        return _SESSION_PREFIXES[self.api] + self.session_key

    def _next_parts(self) -> tuple[str | None, list[tuple[str, str, str]]]:
        """The next turn's user text, or the tool results ``(call id, kind, output)`` to send."""
        self.turn += 1
        if self.pending:
            results = [(call_id, kind, agent_script.tool_output(self.seed, self.index, self.turn, n,
                                                                words=self.sizes.turn_words))
                       for n, (call_id, kind) in enumerate(self.pending)]
            self.pending = []
            return None, results
        return agent_script.user_text(self.seed, self.index, self.turn, words=self.sizes.turn_words), []

    @property
    def workspace(self) -> str:
        """Names the conversation in its system prompt (the reference's differs from the CLI's)."""
        return f"project-{self.run_id}-{self.index}{'b' if self.api == 'chat' else 'a'}"

    def _api_url(self, path: str) -> str:
        base = self.base_url.rstrip("/").removesuffix("/v1")
        return f"{base}/v1/{path}"

    def next_request(self) -> tuple[str, dict[str, str], dict[str, Any]]:
        """The next turn's URL, headers and body (the history resent in full)."""
        raise NotImplementedError

    async def send(self, client: httpx.AsyncClient, result: RequestResult) -> RequestResult:
        """Send the next turn and read its answer into ``result``."""
        url, headers, body = self.next_request()
        result.request_bytes = len(json.dumps(body))
        read, end = _READERS[self.api]
        return await post_stream(client, url, body, result, read, headers=headers, end=end)


@attrs.define
class MessagesConversation(_Conversation):
    """Claude Code's conversation: ``/v1/messages?beta=true``."""

    api: str = "messages"
    messages: list[dict[str, Any]] = attrs.field(factory=list)

    def system_blocks(self, nonce: str) -> list[dict[str, Any]]:
        text = agent_script.system_text(self.seed, self.workspace, words=self.sizes.system_words)
        return [{"type": "text", "text": billing_header(nonce)},
                {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]

    def next_request(self) -> tuple[str, dict[str, str], dict[str, Any]]:
        text, results = self._next_parts()
        if results:
            content = [{"type": "tool_result", "tool_use_id": call_id, "content": output}
                       for call_id, _kind, output in results]
        else:
            content = [{"type": "text", "text": text}]
        self.messages.append({"role": "user", "content": content})
        headers = {
            "anthropic-version": "2023-06-01",
            "anthropic-beta": ANTHROPIC_BETA,
            "X-Claude-Code-Session-Id": self.session_key,
            "x-app": "cli",
            "user-agent": f"claude-cli/{CLAUDE_CODE_VERSION} (external, cli)",
        }
        if self.api_key:
            headers["x-api-key"] = self.api_key
        body = {
            "model": self.model,
            "messages": [dict(m) for m in self.messages],
            "system": self.system_blocks(secrets.token_hex(3)[:5]),
            "tools": [{"name": t.name, "description": t.description, "input_schema": t.parameters}
                      for t in agent_script.CLAUDE_TOOLS],
            "metadata": {"user_id": f"user_bench_account__session_{self.session_key}"},
            "max_tokens": self.max_tokens,
            "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "temperature": 0,
            "stream": True,
        }
        return self._api_url("messages?beta=true"), headers, body

    def record(self, result: RequestResult) -> None:
        """Append the answer as received (blocks in order, signatures kept)."""
        content = [block for block in result.reply if not (block["type"] == "text" and not block["text"])]
        self.messages.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
        self.pending = [(block["id"], "tool_use") for block in result.reply if block["type"] == "tool_use"]


@attrs.define
class ResponsesConversation(_Conversation):
    """Codex CLI's conversation: ``/v1/responses`` with ``store: false``."""

    api: str = "responses"
    items: list[dict[str, Any]] = attrs.field(factory=list)

    def next_request(self) -> tuple[str, dict[str, str], dict[str, Any]]:
        text, results = self._next_parts()
        if not self.items:
            self.items.append({"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<permissions instructions>sandbox: workspace-write; approvals: "
                                               "never</permissions instructions>"}]})
        if results:
            for call_id, kind, output in results:
                self.items.append({"type": f"{kind}_output", "call_id": call_id, "output": output})
        else:
            self.items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        headers = {
            "session-id": self.session_key,
            "thread-id": self.session_key,
            "originator": "codex_exec",
            "version": CODEX_VERSION,
            "x-codex-turn-metadata": json.dumps({"turn_id": f"{self.session_key}-{self.turn}", "sandbox": "workspace-write"}),
            "user-agent": f"codex_exec/{CODEX_VERSION}",
        }
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        tools: list[dict[str, Any]] = [
            {"type": "function", "name": t.name, "description": t.description, "strict": False,
             "parameters": t.parameters} for t in agent_script.CODEX_TOOLS]
        tools.append({"type": "custom", "name": "apply_patch", "description": agent_script.APPLY_PATCH_DESCRIPTION,
                      "format": {"type": "grammar", "syntax": "lark", "definition": agent_script.APPLY_PATCH_GRAMMAR}})
        body = {
            "model": self.model,
            "instructions": agent_script.system_text(self.seed, self.workspace, words=self.sizes.system_words),
            "input": [dict(item) for item in self.items],
            "tools": tools,
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": self.session_key,
            "max_output_tokens": self.max_tokens,
            "temperature": 0,
            "client_metadata": {"originator": "codex_exec"},
        }
        return self._api_url("responses"), headers, body

    def record(self, result: RequestResult) -> None:
        """Append the output items as Codex resends them (assistant items without ``id``/``status``)."""
        for item in result.reply:
            kind = item.get("type")
            if kind == "message":
                self.items.append({"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": part.get("text", "")}
                    for part in item.get("content") or () if part.get("type") == "output_text"]})
            elif kind == "reasoning":
                echoed = {"type": "reasoning", "summary": item.get("summary") or []}
                if item.get("encrypted_content"):
                    echoed["encrypted_content"] = item["encrypted_content"]
                self.items.append(echoed)
            elif kind in ("function_call", "custom_tool_call"):
                echoed = {key: item[key] for key in ("type", "name", "call_id", "namespace", "arguments", "input")
                          if key in item}
                self.items.append(echoed)
                self.pending.append((item["call_id"], kind))


@attrs.define
class ChatConversation(_Conversation):
    """The same conversation over Chat Completions in a named session: the reference."""

    api: str = "chat"
    #: the conversation it mirrors (``messages`` or ``responses``): same system text and tools
    mirrors: str = "messages"
    messages: list[dict[str, Any]] = attrs.field(factory=list)

    def next_request(self) -> tuple[str, dict[str, str], dict[str, Any]]:
        text, results = self._next_parts()
        system = agent_script.system_text(self.seed, self.workspace, words=self.sizes.system_words)
        if not self.messages:
            if self.mirrors == "messages":  # the billing block, as the Messages surface normalises it
                self.messages.append({"role": "system", "content": f"{billing_header('0')}\n\n{system}"})
            else:
                self.messages.append({"role": "system", "content": system})
                self.messages.append({"role": "developer", "content": "<permissions instructions>sandbox: "
                                      "workspace-write; approvals: never</permissions instructions>"})
        if results:
            self.messages.extend({"role": "tool", "tool_call_id": call_id, "content": output}
                                 for call_id, _kind, output in results)
        else:
            self.messages.append({"role": "user", "content": text})
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.parameters}}
                 for t in (agent_script.CLAUDE_TOOLS if self.mirrors == "messages" else agent_script.CODEX_TOOLS)]
        if self.mirrors == "responses":
            # The function the Responses surface makes of the custom apply_patch tool (its input
            # constrained by the grammar), so that both prompts are the same tokens.
            tools.append({"type": "function", "function": {
                "name": "apply_patch", "description": agent_script.APPLY_PATCH_DESCRIPTION, "strict": True,
                "parameters": {"type": "object", "required": ["input"], "additionalProperties": False,
                               "properties": {"input": {"type": "string",
                                                        LARK_KEY: agent_script.APPLY_PATCH_GRAMMAR}}}}})
        body = {
            "model": self.model,
            "messages": [dict(m) for m in self.messages],
            "tools": tools,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "session_id": self.session_key,
        }
        if self.mirrors == "responses":
            body["reasoning_effort"] = "medium"  # Codex's reasoning.effort
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return self._api_url("chat/completions"), headers, body

    def record(self, result: RequestResult) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": result.content}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        if result.reply:
            message["tool_calls"] = result.reply
            self.pending = [(call["id"], "tool") for call in result.reply]
        self.messages.append(message)



# -- stream readers -----------------------------------------------------------------------
async def _read_messages(data: AsyncIterator[str], result: RequestResult, clock: OutputClock,
                         blocks: dict[int, dict[str, Any]]) -> bool:
    """Messages events; ``blocks``: the content blocks by index."""
    partial: dict[int, str] = {}
    async for line in data:
        event = json.loads(line)
        kind = event.get("type")
        if kind == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif kind == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            piece = delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
            if delta["type"] == "text_delta":
                block["text"] += piece
                result.content += piece
            elif delta["type"] == "thinking_delta":
                block["thinking"] += piece
                result.reasoning += piece
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + piece
            if piece:
                clock.output(result)
        elif kind == "content_block_stop" and event["index"] in partial:
            blocks[event["index"]]["input"] = json.loads(partial.pop(event["index"]) or "{}")
        elif kind in ("message_start", "message_delta"):
            usage = (event.get("message") or event).get("usage") or {}
            cached = int(usage.get("cache_read_input_tokens") or 0)
            result.prompt_tokens = (int(usage.get("input_tokens") or 0) + cached
                                    + int(usage.get("cache_creation_input_tokens") or 0))
            result.cached_tokens = cached
            result.output_tokens = int(usage.get("output_tokens") or 0)
            result.finish_reason = (event.get("delta") or {}).get("stop_reason") or result.finish_reason
        elif kind == "message_stop":
            return True
        elif kind == "error":
            result.error = "stream " + error_text(event, str(event)[:200])
            return False
    return False


#: Responses events that carry generated output (the summary deltas repeat the reasoning: not timed).
_OUTPUT_DELTAS = ("response.output_text.delta", "response.reasoning_text.delta",
                  "response.function_call_arguments.delta", "response.custom_tool_call_input.delta")


async def _read_responses(data: AsyncIterator[str], result: RequestResult, clock: OutputClock,
                          items: dict[int, dict[str, Any]]) -> bool:
    """Responses events; ``items``: the output items by index."""
    async for line in data:
        event = json.loads(line)
        kind = event.get("type", "")
        if kind in _OUTPUT_DELTAS and event.get("delta"):
            clock.output(result)
            if kind == "response.output_text.delta":
                result.content += event["delta"]
            elif kind == "response.reasoning_text.delta":
                result.reasoning += event["delta"]
        elif kind == "response.output_item.done":
            items[event["output_index"]] = event["item"]
        elif kind in ("response.completed", "response.incomplete"):
            response = event["response"]
            usage = response.get("usage") or {}
            result.prompt_tokens = int(usage.get("input_tokens") or 0)
            result.cached_tokens = int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
            result.output_tokens = int(usage.get("output_tokens") or 0)
            result.finish_reason = ((response.get("incomplete_details") or {}).get("reason")
                                    or response.get("status"))
            return True
        elif kind in ("response.failed", "error"):
            payload = event.get("response") or event
            result.error = "stream " + error_text(payload, str(payload)[:200])
            return False
    return False


#: the soft session the surfaces name after a CLI's conversation key (the reference's key is its name)
_SESSION_PREFIXES = {"messages": "claude-code:", "responses": "codex:", "chat": ""}
#: each API's stream reader and the event that ends its stream
_READERS = {"chat": (read_chat, "[DONE]"), "messages": (_read_messages, "message_stop"),
            "responses": (_read_responses, "response.completed")}
