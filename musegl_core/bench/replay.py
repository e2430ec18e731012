"""``musegl bench --api messages|responses``: the agent conversation as a CLI sends it,
interleaved with the same conversation over Chat Completions.

Each conversation runs on its own (one request in flight, so the two APIs see
the same server state): turn ``t`` of the CLI's conversation and turn ``t`` of
the Chat Completions reference go out back to back, the CLI's first on odd
turns and the reference's first on even ones (so a drift in the machine's
load falls on both alike). A failed turn ends both conversations (the history
cannot grow past it); the turns left are reported as skipped.
"""

from __future__ import annotations

import uuid
from typing import Any, Awaitable, Callable

import httpx

from musegl_core.bench.cli_wire import ChatConversation, MessagesConversation, ResponsesConversation, Sizes
from musegl_core.bench.client import RequestResult

#: RequestResult.kind of the interleaved Chat Completions turns.
REFERENCE = "reference"


def conversations(config: Any, index: int, sizes: Sizes, run_id: str) -> tuple[Any, ChatConversation]:
    """The CLI's conversation ``index`` and its Chat Completions reference."""
    shared = dict(index=index, seed=config.seed, sizes=sizes, base_url=config.url, model=config.model,
                  max_tokens=config.max_tokens, api_key=config.api_key, run_id=run_id)
    cli = MessagesConversation(**shared) if config.api == "messages" else ResponsesConversation(**shared)
    return cli, ChatConversation(**shared, mirrors=config.api, session_key=f"bench-{run_id}-{index}-chat")


async def run_replays(client: httpx.AsyncClient, config: Any, sizes: Sizes, bar: Any, sessions: list[str],
                      release: Callable[[list[str]], Awaitable[None]]) -> tuple[list[RequestResult], list[RequestResult]]:
    """The CLI's turns and the reference's turns. Every session used is appended to ``sessions``
    before its first request (soft and named alike), and a conversation's two sessions are taken
    out again and handed to ``release`` (which deletes them) when it ends, so that the next
    conversation finds their slots free."""
    run_id = uuid.uuid4().hex[:10]
    measured: list[RequestResult] = []
    references: list[RequestResult] = []
    for index in range(config.conversation_count):
        cli, reference = conversations(config, index, sizes, run_id)
        names = [cli.session_name, reference.session_name]
        sessions.extend(names)
        for turn in range(1, config.turns + 1):
            failed = None
            for conversation in ((cli, reference) if turn % 2 else (reference, cli)):
                kind = REFERENCE if conversation is reference else "turn"
                result = await conversation.send(client, RequestResult(kind, index, turn, api=conversation.api))
                (references if conversation is reference else measured).append(result)
                bar.done(result)
                if not result.ok:
                    failed = failed or result
                else:
                    conversation.record(result)
            if failed is not None:
                for skipped in range(turn + 1, config.turns + 1):
                    for conversation, out in ((cli, measured), (reference, references)):
                        kind = REFERENCE if conversation is reference else "turn"
                        missed = RequestResult(kind, index, skipped, api=conversation.api,
                                               error=f"skipped: turn {turn} failed ({failed.api})")
                        out.append(missed)
                        bar.done(missed)
                break
        await release(list(names))  # still in ``sessions`` meanwhile: an interrupted release is redone
        for name in names:
            sessions.remove(name)
    return measured, references
