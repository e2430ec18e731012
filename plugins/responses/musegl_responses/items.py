"""Responses input items → the core's chat messages.

``input`` is a string (one user message) or a list of items:

* ``message`` (``type`` may be left out) with role ``user``, ``system``,
  ``developer`` or ``assistant``; content a string or parts (``input_text``,
  ``input_image`` as a base64 data URL; an assistant's ``output_text`` /
  ``refusal``). Assistant items need no ``id`` or ``status``;
* ``reasoning``: its text from ``content`` (``reasoning_text``), else from
  ``summary``; an ``encrypted_content`` this server sealed restores the exact
  generated ids (and supplies the text when the item carries none); one it
  cannot verify leaves the text as plain reasoning;
* ``function_call`` (``namespace`` + ``name`` → ``namespace.name``),
  ``custom_tool_call`` (its ``input`` as the one argument); both join the
  assistant turn of the reasoning and message items around them;
* ``function_call_output`` / ``custom_tool_call_output``: a string or parts
  (text, at most one image in the whole conversation);
* anything else (``compaction``, hosted tools' calls, types added later) is
  left out, with a log line; ``item_reference`` is refused (the referenced
  item is not looked up).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import attrs

from musegl_core.chat.channels import parse_output
from musegl_core.chat.messages import FunctionCall, ImagePart, Message, ToolCall, parse_content, parse_json_arguments
from musegl_core.errors import bad_request, unsupported

log = logging.getLogger("musegl.responses")

ROLES = ("user", "system", "developer", "assistant")


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{param}' must be a string", param=param)
    return value


def _parts(raw: Any, param: str, assistant: bool) -> Any:
    """Content (a string or parts) → the core's content."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise bad_request(f"'{param}' must be a string or an array of content parts", param=param)
    chat = []
    for index, part in enumerate(raw):
        part_param = f"{param}[{index}]"
        if not isinstance(part, dict):
            raise bad_request(f"'{part_param}' must be an object", param=part_param)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text") or (assistant and kind == "refusal"):
            key = "refusal" if kind == "refusal" else "text"
            chat.append({"type": "text", "text": _text(part.get(key), f"{part_param}.{key}")})
        elif kind == "input_image" and not assistant:
            if part.get("file_id") is not None:
                raise unsupported(f"{part_param}.file_id", "images by file id are not supported; send a base64 data URL")
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad_request(f"'{part_param}.image_url' must be a data URL string", param=f"{part_param}.image_url")
            image = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            chat.append({"type": "image_url", "image_url": image})
        elif kind == "input_file":
            raise unsupported(part_param, "file inputs are not supported")
        else:
            raise bad_request(f"unsupported content part type {kind!r} in '{part_param}'", param=f"{part_param}.type")
    parsed = parse_content(chat, param)
    texts = [getattr(p, "text", None) for p in parsed]
    if all(t is not None for t in texts) and assistant:
        return "".join(texts)
    return parsed


@attrs.define
class _Turn:
    """An assistant turn being assembled from consecutive items."""

    reasoning: str | None = None
    sealed: Any = None
    content: Any = None
    calls: list = attrs.field(factory=list)

    @property
    def empty(self) -> bool:
        return self.reasoning is None and self.content is None and not self.calls

    def message(self) -> Message:
        content = self.content
        if content is None and not self.calls:
            content = ""
        return Message(role="assistant", content=content, reasoning_content=self.reasoning or None,
                       reasoning_ids=self.sealed if self.reasoning else None, tool_calls=tuple(self.calls))


@attrs.frozen
class Reader:
    """Reads input items; ``seal`` (the server's ReasoningSeal) and
    ``tokenizer`` verify and decode ``encrypted_content``."""

    seal: Any
    tokenizer: Any

    def messages(self, raw: Any, param: str = "input") -> list[Message]:
        if isinstance(raw, str):
            return [Message(role="user", content=raw)]
        if not isinstance(raw, list):
            raise bad_request("'input' must be a string or an array of items", param=param)
        out: list[Message] = []
        turn = _Turn()

        def flush() -> None:
            nonlocal turn
            if not turn.empty:
                out.append(turn.message())
            turn = _Turn()

        for index, item in enumerate(raw):
            item_param = f"{param}[{index}]"
            if not isinstance(item, dict):
                raise bad_request(f"'{item_param}' must be an object", param=item_param)
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                role = item.get("role")
                if role not in ROLES:
                    raise bad_request(f"'{item_param}.role' must be one of {', '.join(ROLES)}", param=f"{item_param}.role")
                if "content" not in item:
                    raise bad_request(f"'{item_param}.content' is required", param=f"{item_param}.content")
                content = _parts(item["content"], f"{item_param}.content", role == "assistant")
                if role == "assistant":
                    if turn.content is not None or turn.calls:
                        flush()
                    turn.content = content
                else:
                    flush()
                    out.append(Message(role=role, content=content))
            elif kind == "reasoning":
                if turn.content is not None or turn.calls:
                    flush()
                self._reasoning(item, item_param, turn)
            elif kind in ("function_call", "custom_tool_call"):
                turn.calls.append(self._call(item, item_param, kind))
            elif kind in ("function_call_output", "custom_tool_call_output"):
                flush()
                call_id = _text(item.get("call_id"), f"{item_param}.call_id")
                output = item.get("output")
                if output is None:
                    raise bad_request(f"'{item_param}.output' is required", param=f"{item_param}.output")
                content = _parts(output, f"{item_param}.output", False)
                if isinstance(content, tuple) and all(not isinstance(p, ImagePart) for p in content):
                    content = "".join(p.text for p in content)
                out.append(Message(role="tool", content=content, tool_call_id=call_id))
            elif kind == "item_reference":
                raise unsupported(f"{item_param}.type", "item_reference is not supported: send the item itself")
            else:
                log.info("responses: input item type %.100r is not used by musegl; left out", kind)
        flush()
        images = [(i, m) for i, m in enumerate(out) if isinstance(m.content, tuple)
                  for p in m.content if isinstance(p, ImagePart)]
        if len(images) > 1:
            raise bad_request("at most one image is supported across the whole conversation", code="invalid_image",
                              param=param)
        return out

    def _reasoning(self, item: dict, param: str, turn: _Turn) -> None:
        texts = []
        for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
            parts = item.get(key)
            if parts is None:
                continue
            if not isinstance(parts, list):
                raise bad_request(f"'{param}.{key}' must be an array", param=f"{param}.{key}")
            found = []
            for j, part in enumerate(parts):
                if not isinstance(part, dict) or part.get("type") != part_type:
                    raise bad_request(f"'{param}.{key}[{j}]' must be a {part_type} part", param=f"{param}.{key}[{j}]")
                found.append(_text(part.get("text"), f"{param}.{key}[{j}].text"))
            if found:
                texts.append("".join(found) if key == "content" else "\n\n".join(found))
        text = texts[0] if texts else None
        sealed = None
        token = item.get("encrypted_content")
        if token is not None:
            if not isinstance(token, str):
                raise bad_request(f"'{param}.encrypted_content' must be a string", param=f"{param}.encrypted_content")
            sealed = self.seal.open(token)
            if sealed is not None:
                decoded = self._decode(sealed.ids)
                if text is None or decoded == text:
                    text = decoded
                else:
                    sealed = None  # the text was edited: render the client's text
        if not text:
            return
        if turn.reasoning is None:
            turn.reasoning, turn.sealed = text, sealed
            return
        joined = turn.sealed is not None and sealed is not None and not sealed.opens_turn
        turn.sealed = attrs.evolve(turn.sealed, ids=turn.sealed.ids + sealed.ids) if joined else None
        turn.reasoning = turn.reasoning + text

    def _decode(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return parse_output(self.tokenizer.decode(list(ids)), tools_active=False).reasoning

    def _call(self, item: dict, param: str, kind: str) -> ToolCall:
        call_id = _text(item.get("call_id"), f"{param}.call_id")
        name = _text(item.get("name"), f"{param}.name")
        namespace = item.get("namespace")
        if namespace is not None:
            name = f"{_text(namespace, f'{param}.namespace')}.{name}"
        if kind == "function_call":
            arguments = parse_json_arguments(item.get("arguments", ""), f"{param}.arguments")
        else:
            arguments = {"input": _text(item.get("input"), f"{param}.input")}
        return ToolCall(id=call_id, function=FunctionCall(name, arguments))
