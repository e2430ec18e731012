"""The frames between the front and the worker: the compact frame of a Tokens event."""

from __future__ import annotations

import json

import pytest

from musegl_core.engine.executor import TokenLogprobs
from musegl_core.worker import messages as m


@pytest.mark.parametrize("event", [
    m.Tokens("r-1", (5, 6, 7), "a\u00e9\U0001f600\n"),
    m.Tokens("r-2", (), ""),
    m.Tokens("r-3", (5, 9), "xy", (TokenLogprobs(-0.25, (5, 4), (-0.25, -1.5)), TokenLogprobs(-2.0))),
])
def test_a_tokens_event_travels_as_a_compact_array(event):
    line = m.encode(event)
    assert line.endswith(b"\n") and json.loads(line)[:2] == ["t", event.id]
    assert m.decode(line) == event


def test_other_events_keep_their_named_object_frames():
    done = m.Done("r", "stop", None, 3, 2)
    assert json.loads(m.encode(done))["op"] == "done" and m.decode(m.encode(done)) == done
    with pytest.raises(m.FrameError):  # a Tokens event has one frame, the array
        m.decode(b'{"op":"tokens","id":"r","ids":[1],"text":"x"}\n')


@pytest.mark.parametrize("line", [
    b'["t","r",[1]]', b'["x","r",[1],"a"]', b'["t",1,[1],"a"]', b'["t","r",["1"],"a"]', b'["t","r",[true],"a"]',
    b'["t","r",[1],5]', b'["t","r",[1],"a",[[0.5,[1]]]]', b'["t","r",[1,2],"a",[[0.5,[],[]]]]', b'["t","r",[1],"a",[],1]',
])
def test_a_malformed_tokens_frame_is_a_frame_error(line):
    with pytest.raises(m.FrameError):
        m.decode(line)


def test_a_malformed_tokens_frame_names_its_request():
    """The front fails that request (BadEvent) rather than drop its output: it needs the id."""
    mismatched = m.encode(m.Tokens("r-9", (5, 9), "xy", (TokenLogprobs(-0.25),)))  # one entry for two ids
    with pytest.raises(m.FrameError, match="one logprobs entry per id") as info:
        m.decode(mismatched)
    assert info.value.id == "r-9"
    for line in (b'["t",1,[1],"a"]', b'{"op":"done"}', b"not json"):
        with pytest.raises(m.FrameError) as info:
            m.decode(line)
        assert info.value.id is None
