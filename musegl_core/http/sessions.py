"""``GET /v1/sessions`` and ``DELETE /v1/sessions/{id}``: named sessions as a client manages them.

Named sessions persist by default (never dropped behind a client's back), each holding one of
the ``--max-sessions`` slots, so a client that names many sessions needs a way
to see them and give their slots back. Both routes ask the worker, which
answers between two engine steps; both take the API key when one is set.
"""

from __future__ import annotations

from typing import Any

import attrs
from litestar import Request, delete, get
from litestar.params import FromPath

from musegl_core.errors import bad_request, unavailable
from musegl_core.http import openapi
from musegl_core.http import schemas as s
from musegl_core.service.rules import session_id as checked_session_id
from musegl_core.worker.client import WorkerClient


@attrs.frozen
class SessionObject:
    id: str
    state: str  # "active" (a request runs or waits on it) or "idle"
    cached_tokens: int  # positions whose K/V the next request on it may reuse
    idle_seconds: float  # since its last request ended; 0 while active
    queued_requests: int
    retention: str | None = None  # the residency its requests asked for (docs/sessions.md "Retention")
    object: str = "session"


@attrs.frozen
class SessionPage:
    data: list[SessionObject]
    object: str = "list"


@attrs.frozen
class SessionDeleted:
    id: str
    object: str = "session"
    deleted: bool = True


def session_routes(worker: WorkerClient, guards: list) -> list:
    """The two route handlers, guarded like the generation routes."""

    def require_worker() -> None:
        if not worker.ready:
            raise unavailable("the model is loading or restarting", code="model_loading")

    @get(["/v1/sessions", "/sessions"], guards=guards,
         operation_class=openapi.operation(responses={200: SessionPage, **{c: s.ErrorBody for c in (401, 503)}}))
    async def list_sessions() -> dict[str, Any]:
        """Every named session, most recently used first."""
        require_worker()
        infos = await worker.list_sessions()
        return s.to_json(SessionPage([SessionObject(**attrs.asdict(info)) for info in infos]))

    @delete(["/v1/sessions/{session:str}", "/sessions/{session:str}"], guards=guards, status_code=200,
            operation_class=openapi.operation(
                responses={200: SessionDeleted, **{c: s.ErrorBody for c in (400, 401, 404, 409, 503)}}))
    async def delete_session(session: FromPath[str], request: Request) -> dict[str, Any]:
        """Close an idle named session: its slot and KV are freed (404 unknown, 409 while active).
        An ``X-Session-Id`` header (which a router routes by) must name the same session."""
        name = checked_session_id(session, None)
        header = request.headers.get("x-session-id")
        if header is not None and header != name:
            raise bad_request("the X-Session-Id header names another session than the path",
                              param="X-Session-Id")
        require_worker()
        await worker.close_session(name)
        return s.to_json(SessionDeleted(name))

    return [list_sessions, delete_session]
