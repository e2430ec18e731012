"""Driving an :class:`~musegl_core.engine.engine.Engine` directly in tests: random prompt ids,
the :class:`~musegl_core.engine.events.Done` of a request, and a scripted conversation (turns on a
named session, rewinds into its history, two requests side by side) whose generated ids two
engines can be compared on (the sliding-pages tests of every backend)."""

from __future__ import annotations

import attrs


def ids(seed: int, n: int) -> list[int]:
    """``n`` prompt ids in [3, 500), the same for the same ``seed``."""
    import torch

    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def done(events: list, rid: str):
    """The :class:`~musegl_core.engine.events.Done` of request ``rid`` among ``events`` (fails
    with the request's events when it has none)."""
    from musegl_core.engine import events as ev

    found = [e for e in events if isinstance(e, ev.Done) and e.id == rid]
    assert found, [e for e in events if getattr(e, "id", None) == rid]
    return found[0]


@attrs.frozen
class Script:
    """A conversation on the named session ``"chat"``: a first prompt of ``turns[0]`` ids, then a
    turn per further entry (the reply of ``reply`` ids and that many new ids), a last turn; then
    each rewind ``(request id, positions kept, seed, new ids)``; then request ``"a"`` (50 ids,
    12 generated) and ``"b"`` (21 ids, ``side_tokens`` generated) side by side, without a session."""

    turns: tuple[int, ...] = (37, 23, 19)
    reply: int = 10
    rewinds: tuple[tuple[str, int, int, int], ...] = (("rewind_late", 85, 8, 6), ("rewind", 30, 4, 5))
    side_tokens: int = 30


def conversation(engine, events: list, script: Script = Script()) -> dict[str, list[int]]:
    """Run ``script`` on ``engine`` (whose events go to ``events``): the ids generated per request."""
    from musegl_core.engine.executor import GREEDY
    from musegl_core.engine.request import PreparedRequest

    out: dict[str, list[int]] = {}

    def submit(rid: str, prompt: list[int], n: int, session: str | None) -> None:
        engine.submit(PreparedRequest(id=rid, prompt_ids=tuple(prompt), max_tokens=n, ignore_eos=True,
                                      sampling=GREEDY, session_id=session, stream=session is not None))

    def run(rid: str, prompt: list[int]) -> list[int]:
        submit(rid, prompt, script.reply, "chat")
        engine.run_until_idle()
        out[rid] = list(done(events, rid).generated_ids)
        return out[rid]

    history = ids(1, script.turns[0])
    for turn, more in enumerate(script.turns[1:], start=1):
        history += run(f"t{turn}", history) + ids(turn + 1, more)
    history += run(f"t{len(script.turns)}", history)
    for rid, kept, seed, n in script.rewinds:
        run(rid, history[:kept] + ids(seed, n))
    submit("a", ids(5, 50), 12, None)
    submit("b", ids(6, 21), script.side_tokens, None)
    engine.run_until_idle()
    out["a"], out["b"] = list(done(events, "a").generated_ids), list(done(events, "b").generated_ids)
    return out


def example_engine(tokenizer, **config) -> tuple:
    """An engine over :class:`~musegl_core.testing.example_executor.ExampleExecutor` with the
    :class:`~musegl_core.engine.engine.EngineConfig` fields ``config``: ``(engine, events)``."""
    from musegl_core.engine.engine import Engine, EngineConfig
    from musegl_core.testing.example_executor import ExampleExecutor

    events: list = []
    return Engine(ExampleExecutor(tokenizer.vocab_size), tokenizer, EngineConfig(**config), events.append), events
