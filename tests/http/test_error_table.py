"""The one table from error kinds to what a client sees (musegl_core/worker/errors.py):
every kind the engine or the worker reports maps, each to its pinned status, type,
code, param, message and Retry-After; an unknown kind is a 500 ``server_error``;
every kind crosses the pipe in a ``Failed`` frame and back unchanged."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest

from musegl_core.engine import errors as e
from musegl_core.worker.errors import TABLE, api_error
from musegl_core.worker import messages as m

CONTEXT = {"context_length": 512, "prompt_tokens": 600, "max_prompt_tokens": 511, "completion_reservation": 1,
           "source": "worker"}

#: one example of each kind, and (status, type, code, param, message, metadata, retry_after)
EXPECTED = [
    (e.ContextTooLong(600, 1, 512), (
        400, "invalid_request_error", "context_length_exceeded", "messages",
        "This model's maximum context length is 512 tokens. However, you requested 601 tokens (600 in the "
        "messages, 1 in the completion). Please reduce the length of the messages or completion.", CONTEXT, None)),
    (e.ContextTooLong(600, 1, 512, exact=False), (
        400, "invalid_request_error", "context_length_exceeded", "messages",
        "This model's maximum context length is 512 tokens. However, you requested at least 601 tokens (at least "
        "600 in the messages, 1 in the completion). Please reduce the length of the messages or completion.",
        {**CONTEXT, "prompt_tokens_exact": False}, None)),
    (e.Busy(2, 3, 7), (
        503, "unavailable_error", "server_busy", None,
        "the server is busy: 2 requests run (--max-inflight-requests) and 3 wait (--max-queued-requests, full); "
        "retry in about 7 s", {}, 7)),
    (e.DuplicateId("r1"), (400, "invalid_request_error", None, None, "duplicate request id r1", {}, None)),
    (e.SaltMismatchError("session 'chat' has another cache_salt"), (
        400, "invalid_request_error", "cache_salt_mismatch", "cache_salt",
        "session 'chat' has another cache_salt: a named session keeps the cache_salt of its first request "
        "(close it with DELETE /v1/sessions/{id} to change it)", {}, None)),
    (e.NoSessionSlot("all 4 slots are held"), (
        503, "unavailable_error", "session_capacity", None,
        "no session slot is free: all 4 slots are held; named sessions persist until DELETE /v1/sessions/{id}",
        {}, None)),
    (e.NoSessionSlot("all 4 slots are held", 12), (
        503, "unavailable_error", "session_capacity", None,
        "no session slot is free: all 4 slots are held; the first named session can expire in about 12 s "
        "(--session-idle-timeout)", {}, 12)),
    (e.NoSession("chat"), (404, "not_found_error", "session_not_found", "session_id", "no session 'chat'", {}, None)),
    (e.SessionActive("chat"), (
        409, "invalid_request_error", "session_active", "session_id",
        "session 'chat' has a request running or queued; close it when idle", {}, None)),
    (e.ConstraintFailed("budget exhausted"), (
        400, "invalid_request_error", "constraint_failed", None,
        "the output constraint could not be enforced: the grammar engine failed during generation (budget "
        "exhausted); simplify the schema", {}, None)),
    (e.ExecutionFailed("CUDA error"), (500, "server_error", None, None, "model execution failed: CUDA error", {},
                                       None)),
    (e.ImageEncodingFailed("bad pixels"), (500, "server_error", None, None, "image encoding failed: bad pixels", {},
                                          None)),
    (m.FrameTooLarge(1024), (413, "invalid_request_error", "request_too_large", None, "request frame over 1024 bytes",
                            {}, None)),
    (m.BadFrame("malformed frame: x"), (400, "invalid_request_error", None, None, "malformed frame: x", {}, None)),
    (m.EventTooLarge(), (500, "server_error", None, None, "an output frame exceeded 1 MiB", {}, None)),
    (m.BadEvent("malformed frame: x"), (500, "server_error", None, None,
                                         "the worker sent an unreadable event: malformed frame: x", {}, None)),
    (m.PreparationFailed("boom"), (500, "server_error", None, None, "preparing the request failed: boom", {}, None)),
    (m.InputRefused(413, "The image is 9 bytes", code="image_too_large", param="image", metadata={"a": 1}), (
        413, "invalid_request_error", "image_too_large", "image", "The image is 9 bytes", {"a": 1}, None)),
]


def fields(error) -> tuple:
    return error.status, error.type, error.code, error.param, error.message, error.metadata, error.retry_after


def test_every_kind_has_one_row_in_the_table():
    kinds = set(m.ERROR_KINDS.values())
    assert set(TABLE) == kinds == {type(example) for example, _ in EXPECTED}
    assert len(m.ERROR_KINDS) == len(e.ENGINE_ERRORS) + len(m.WORKER_ERRORS)  # no two kinds share a name


@pytest.mark.parametrize(("error", "seen"), EXPECTED, ids=[repr(error) for error, _ in EXPECTED])
def test_each_kind_maps_to_what_clients_see(error, seen):
    assert fields(api_error(error)) == seen


@pytest.mark.parametrize("error", [error for error, _ in EXPECTED], ids=[repr(error) for error, _ in EXPECTED])
def test_each_kind_crosses_the_pipe_unchanged(error):
    line = m.encode(m.Failed("r1", error))
    assert m.decode(line) == m.Failed("r1", error)
    assert f'"kind":"{error.kind}"'.encode() in line


def test_an_unknown_kind_is_a_500_server_error():
    @attrs.frozen
    class Unmapped(e.EngineError):
        kind: ClassVar[str] = "unmapped"

    error = api_error(Unmapped())
    assert (error.status, error.type, error.code) == (500, "server_error", None)
    assert "unmapped" in error.message


def test_a_frame_naming_an_unknown_kind_is_malformed():
    with pytest.raises(m.FrameError):
        m.decode(b'{"op":"failed","id":"r1","error":{"kind":"unmapped"}}')
