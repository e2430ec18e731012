"""A checker of the Messages stream grammar, as Claude Code and the SDKs rely on it.

:func:`check_stream` asserts, over parsed SSE events, that ``message_start``
comes first; ``ping`` may come anywhere after it; blocks open with
``content_block_start`` at the next index, one at a time; every
``content_block_delta`` goes to the open block and has its type's delta
(``text_delta`` → text, ``thinking_delta``/``signature_delta`` → thinking,
the signature last; ``input_json_delta`` → tool_use); every block is closed by
``content_block_stop``; then ``message_delta`` (stop reason, cumulative usage)
and ``message_stop`` end it. An ``error`` event may end the stream instead.
It returns the message the events build.
"""

from __future__ import annotations

import json
import re

DELTAS = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "thinking",
          "input_json_delta": "tool_use"}
TOOL_ID = re.compile(r"^[a-zA-Z0-9_-]+$")


def parse_sse(text: str) -> list[tuple[str, dict]]:
    """``(event name, data)`` of every event; comments are skipped."""
    events = []
    for chunk in text.split("\n\n"):
        name, data = None, []
        for line in chunk.splitlines():
            if line.startswith(":"):
                continue
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
        if name is not None:
            payload = json.loads("\n".join(data))
            assert payload["type"] == name, (name, payload)
            events.append((name, payload))
    return events


def check_stream(events: list[tuple[str, dict]]) -> dict:
    assert events and events[0][0] == "message_start", events[:1]
    message = dict(events[0][1]["message"])
    assert message["content"] == [] and message["stop_reason"] is None
    blocks: list[dict] = []
    json_parts: dict[int, list[str]] = {}
    open_index = None
    signed = False
    finished = False
    for position, (name, data) in enumerate(events[1:], start=1):
        if name == "ping":
            continue
        if name == "error":
            assert position == len(events) - 1, "an error event ends the stream"
            return {**message, "content": blocks, "error": data["error"]}
        assert not finished or name == "message_stop", f"{name} after message_delta"
        if name == "content_block_start":
            assert open_index is None, "a block opened while another is open"
            assert data["index"] == len(blocks), "blocks open at the next index"
            block = dict(data["content_block"])
            if block["type"] == "tool_use":
                assert TOOL_ID.match(block["id"]) and block["input"] == {}
                json_parts[data["index"]] = []
            blocks.append(block)
            open_index, signed = data["index"], False
        elif name == "content_block_delta":
            assert data["index"] == open_index, "a delta to a block that is not open"
            delta, block = data["delta"], blocks[open_index]
            assert DELTAS[delta["type"]] == block["type"], (delta["type"], block["type"])
            assert not signed, "nothing follows the signature"
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] += delta["signature"]
                signed = True
            else:
                json_parts[open_index].append(delta["partial_json"])
        elif name == "content_block_stop":
            assert data["index"] == open_index, "closing a block that is not open"
            if blocks[open_index]["type"] == "tool_use":
                blocks[open_index]["input"] = json.loads("".join(json_parts[open_index]) or "{}")
            open_index = None
        elif name == "message_delta":
            assert open_index is None, "message_delta with a block open"
            message["stop_reason"] = data["delta"]["stop_reason"]
            message["stop_sequence"] = data["delta"]["stop_sequence"]
            usage = data["usage"]
            assert usage["output_tokens"] >= 0 and usage["input_tokens"] >= 0
            message["usage"] = usage
            finished = True
        elif name == "message_stop":
            assert finished and position == len(events) - 1, "message_stop ends the stream"
        else:
            raise AssertionError(f"unknown event {name}")
    assert finished, "the stream ended without message_delta / message_stop"
    return {**message, "content": blocks}
