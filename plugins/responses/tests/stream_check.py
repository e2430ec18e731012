"""A checker of the Responses stream grammar (what Codex and the SDK rely on)."""

from __future__ import annotations

from typing import Any

LIFECYCLE_END = ("response.completed", "response.incomplete", "response.failed")


def check_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Assert the stream's grammar; returns the final response object.

    * ``sequence_number`` counts 0, 1, 2, ...;
    * ``response.created`` first, then ``response.in_progress`` (possibly repeated
      before any output), one terminal event last;
    * items open (``output_item.added``) in ``output_index`` order, one at a
      time; every delta names the open item and a part opened before it;
      every item is closed (``output_item.done``) before the next opens;
    * the terminal response's ``output`` equals the ``output_item.done`` items;
    * each text equals its concatenated deltas.
    """
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[1]["type"] == "response.in_progress"
    assert events[-1]["type"] in LIFECYCLE_END
    assert not any(e["type"] in LIFECYCLE_END for e in events[:-1])
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1
    done_items: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None
    parts: set[tuple[str, int]] = set()
    texts: dict[tuple[str, str, int], str] = {}
    seen_output = False
    for event in events[1:-1]:
        kind = event["type"]
        if kind == "response.in_progress":
            assert not seen_output, "in_progress is a keep-alive before output only"
            continue
        seen_output = True
        if kind == "response.output_item.added":
            assert open_item is None, "an item opened while another is open"
            assert event["output_index"] == len(done_items)
            open_item = event["item"]
            assert open_item["status"] == "in_progress"
            continue
        assert open_item is not None, f"{kind} outside an item"
        assert event["output_index"] == len(done_items)
        if kind == "response.output_item.done":
            assert event["item"]["id"] == open_item["id"] and event["item"]["type"] == open_item["type"]
            done_items.append(event["item"])
            open_item = None
            continue
        assert event["item_id"] == open_item["id"]
        if kind in ("response.content_part.added", "response.reasoning_summary_part.added"):
            family = "summary" if "summary" in kind else "content"
            index = event["summary_index" if family == "summary" else "content_index"]
            parts.add((family + open_item["id"], index))
            continue
        if kind.endswith(".delta") or kind.endswith(".done"):
            if kind.startswith("response.reasoning_summary"):
                key = ("summary", open_item["id"], event["summary_index"])
                assert ("summary" + open_item["id"], event["summary_index"]) in parts
                assert open_item["type"] == "reasoning"
            elif kind.startswith(("response.reasoning_text", "response.output_text", "response.content_part")):
                key = ("content", open_item["id"], event["content_index"])
                assert ("content" + open_item["id"], event["content_index"]) in parts
                expected = "reasoning" if kind.startswith("response.reasoning_text") else None
                if expected:
                    assert open_item["type"] == "reasoning"
                elif kind.startswith("response.output_text"):
                    assert open_item["type"] == "message"
            elif kind.startswith("response.function_call_arguments"):
                key = ("arguments", open_item["id"], 0)
                assert open_item["type"] == "function_call"
            elif kind.startswith("response.custom_tool_call_input"):
                key = ("input", open_item["id"], 0)
                assert open_item["type"] == "custom_tool_call"
            else:
                raise AssertionError(f"unexpected event {kind}")
            if kind.endswith(".delta"):
                texts[key] = texts.get(key, "") + event["delta"]
            elif kind != "response.content_part.done" and not kind.endswith("_part.done"):
                final = event.get("text", event.get("arguments", event.get("input")))
                assert final == texts.get(key, ""), f"{kind}: the done text differs from the deltas"
            continue
        raise AssertionError(f"unexpected event {kind}")
    assert open_item is None, "an item was never closed"
    final = events[-1]["response"]
    assert final["output"] == done_items
    for item in done_items:
        if item["type"] == "message":
            assert item["content"][0]["text"] == texts.get(("content", item["id"], 0), "")
        if item["type"] == "function_call":
            assert item["arguments"] == texts.get(("arguments", item["id"], 0), "")
    return final
