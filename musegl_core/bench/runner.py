"""Drive a bench run: calibrate, run N concurrent clients, aggregate.

A run has up to three phases, all against one server:

1. **calibration** (not measured): two short prompts that differ by a known
   number of filler words, one token each; the difference in
   ``usage.prompt_tokens`` gives the server tokenizer's tokens per word and
   the rest the template's fixed overhead, so ``prompt_tokens`` means tokens
   on any checkpoint. It also warms the server up.
2. **measured phase**: ``chat`` sends ``requests`` independent prompts through
   ``concurrency`` client tasks; ``agent`` runs ``conversations`` conversations
   of ``turns`` turns, at most ``concurrency`` at a time, each turn resending
   the whole history with the conversation's ``session_id``; ``api`` other
   than ``chat`` replays the agent conversation as Claude Code or Codex CLI
   sends it, each turn interleaved with the same turn over Chat Completions
   (:mod:`musegl_core.bench.replay`).
3. **baseline** (``agent`` over Chat Completions only, unless disabled): each conversation's
   last-turn history is sent again *without* a session, at the same
   concurrency, so the report compares the TTFT the session gives that history
   with the TTFT of a full prefill. Start the server without prefix snapshots
   (``--prefix-cache-entries 0``, the default) or the replay may hit one.

Named sessions persist on the server until deleted, so the ``agent`` workload
deletes its sessions (``DELETE /v1/sessions/{id}``) when its turns are done,
before the baseline (whose anonymous requests need the slots), and again on
the way out of an interrupted run (Ctrl-C); the report says how many it
deleted and which it could not (a server with ``--sessions-api off``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from typing import Iterator

import attrs
import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from musegl_core.bench import agent_script, workloads
from musegl_core.bench.cli_wire import APIS, Sizes
from musegl_core.bench.client import RequestResult, chat_body, stream_chat
from musegl_core.bench.replay import run_replays
from musegl_core.bench.report import BenchReport, build_report

#: Filler words between the two calibration prompts.
CALIBRATION_WORDS = 200
#: The turn of a conversation at whose start it spawns its subagents (``BenchConfig.subagents``).
SUBAGENT_TURN = 2


class BenchError(RuntimeError):
    """The bench cannot run (server unreachable, calibration failed)."""


def _positive(_instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1 (got {value})")


@attrs.frozen
class BenchConfig:
    """What one ``musegl bench`` run does."""

    #: server base URL (``http://host:port``; a trailing ``/v1`` is accepted)
    url: str = "http://127.0.0.1:8000"
    #: ``chat`` (independent prompts) or ``agent`` (multi-turn sessions)
    workload: str = attrs.field(default="chat", validator=attrs.validators.in_(workloads.WORKLOADS))
    #: concurrent clients (``agent``: conversations in flight)
    concurrency: int = attrs.field(default=1, validator=_positive)
    #: ``chat``: number of requests
    requests: int = attrs.field(default=16, validator=_positive)
    #: ``agent``: number of conversations (default: ``concurrency``)
    conversations: int | None = None
    #: ``agent``: turns per conversation
    turns: int = attrs.field(default=5, validator=_positive)
    #: generated tokens per request (``ignore_eos``, so exactly this many)
    max_tokens: int = attrs.field(default=64, validator=_positive)
    #: approximate tokens per prompt (``chat``) or per new user message (``agent``)
    prompt_tokens: int = attrs.field(default=256, validator=_positive)
    #: seed of the filler text
    seed: int = 0
    #: per-request timeout in seconds
    timeout: float = 600.0
    #: bearer token, when the server requires one
    api_key: str | None = None
    #: ``agent``: replay each last-turn history anonymously for comparison
    baseline: bool = True
    #: model name sent in the body (the server answers with its own)
    model: str = "musegl-bench"
    #: ``chat`` (Chat Completions), or replay the agent conversation as Claude Code (``messages``)
    #: or Codex CLI (``responses``) sends it, interleaved with the same one over Chat Completions
    api: str = attrs.field(default="chat", validator=attrs.validators.in_(APIS))
    #: ``--api messages|responses``: approximate tokens of the system prompt's text (tools come on top)
    system_tokens: int = attrs.field(default=12000, validator=_positive)
    #: ``agent`` over Chat Completions: a system prompt of about this many tokens, the same in every
    #: conversation (a coding agent's rules and project notes); 0: the one-line prompt
    shared_system_tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    #: ``agent`` over Chat Completions: send the coding agent's ten tool definitions with every turn
    tools: bool = False
    #: ``agent`` over Chat Completions: each conversation's first user message carries a context of
    #: its own of about this many tokens (files it read, an earlier history), so it starts long
    context_tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    #: ``agent``: subagent conversations, spawned by the conversations in turn (subagent ``k`` by
    #: conversation ``k % conversations``) as their turn :data:`SUBAGENT_TURN` starts, each running
    #: beside its parent in a session of its own
    subagents: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    #: ``agent``: turns of a subagent
    subagent_turns: int = attrs.field(default=3, validator=_positive)
    #: ``agent``: a subagent's own context, as ``context_tokens``
    subagent_context_tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    #: ``agent``: ``concurrency`` bounds the requests in flight, not the conversations: every
    #: conversation is open from the start and their turns interleave (many sessions held at
    #: once, as an agent host's users are); off: a conversation holds a client from its first
    #: turn to its last
    interleave: bool = False
    #: devices the server's model spans (its ``--tensor-parallel-size``): the report adds the
    #: output throughput per device, the figure tensor parallelism and replicas compare by
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.api != "chat" and self.workload != "agent":
            raise ValueError(f"api {self.api} replays an agent conversation: workload must be agent")
        if (self.shared_system_tokens or self.tools) and (self.workload != "agent" or self.api != "chat"):
            raise ValueError("shared_system_tokens and tools belong to the agent workload over Chat Completions "
                             "(--api messages|responses send their own system prompt and tools)")
        if (self.context_tokens or self.subagents or self.interleave) and (self.workload != "agent"
                                                                            or self.api != "chat"):
            raise ValueError("context_tokens, subagents and interleave belong to the agent workload over Chat "
                             "Completions")
        if self.api != "chat" and self.concurrency != 1:
            raise ValueError(f"api {self.api} replays one conversation at a time, interleaved with its "
                             "Chat Completions reference: concurrency must be 1")

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"

    @property
    def conversation_count(self) -> int:
        return self.conversations if self.conversations is not None else self.concurrency

    @property
    def measured_requests(self) -> int:
        if self.workload == "chat":
            return self.requests
        return (self.conversation_count * self.turns * (1 if self.api == "chat" else 2)
                + self.subagents * self.subagent_turns)


class _Bar:
    """The rich progress bar of a run (or nothing when progress is off)."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.task = None
        self.ok = self.errors = self.tokens = 0
        self.started = time.perf_counter()

    def phase(self, title: str, total: int) -> None:
        self.ok = self.errors = self.tokens = 0
        self.started = time.perf_counter()
        if self.progress is not None:
            if self.task is not None:
                self.progress.update(self.task, visible=False)
            self.task = self.progress.add_task(title, total=total, stats="")

    def done(self, result: RequestResult) -> None:
        if result.ok:
            self.ok += 1
            self.tokens += result.output_tokens
        else:
            self.errors += 1
        if self.progress is not None and self.task is not None:
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            stats = f"ok {self.ok}  errors {self.errors}  {rate:.1f} tok/s"
            self.progress.update(self.task, advance=1, stats=stats)


@contextlib.contextmanager
def _progress_bar(enabled: bool) -> Iterator[_Bar]:
    if not enabled:
        yield _Bar(None)
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}", style="dim"),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
    ) as progress:
        yield _Bar(progress)


@attrs.frozen
class Calibration:
    """How the server counts filler: ``prompt_tokens ≈ overhead + per_word × words``."""

    per_word: float
    overhead: int

    def words(self, tokens: int, *, whole_prompt: bool) -> int:
        """Filler words for ``tokens`` tokens (of the whole prompt, or of one message)."""
        target = tokens - self.overhead if whole_prompt else tokens
        return workloads.words_for(max(target, 1), self.per_word)


async def calibrate(client: httpx.AsyncClient, config: BenchConfig) -> Calibration:
    """Measure the server tokenizer's tokens per filler word (and warm the server up)."""
    counts = []
    for words in (8, 8 + CALIBRATION_WORDS):
        text = workloads.filler_text(config.seed, "calibrate", words, words=words)
        body = chat_body(({"role": "user", "content": text},), max_tokens=1, model=config.model)
        result = await stream_chat(client, config.endpoint, body, RequestResult("calibration"))
        if not result.ok:
            raise BenchError(f"calibration request to {config.endpoint} failed: {result.error}")
        counts.append(result.prompt_tokens)
    per_word = (counts[1] - counts[0]) / CALIBRATION_WORDS
    if per_word <= 0:
        raise BenchError(f"calibration got no usage.prompt_tokens from {config.endpoint}")
    return Calibration(per_word, max(0, round(counts[0] - 8 * per_word)))


async def _run_chat(client: httpx.AsyncClient, config: BenchConfig, words: int, bar: _Bar) -> list[RequestResult]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(config.requests):
        queue.put_nowait(index)
    results: list[RequestResult] = []

    async def client_task() -> None:
        while True:
            try:
                index = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            prompt = workloads.chat_prompt(config.seed, index, words=words)
            body = chat_body(prompt.messages, max_tokens=config.max_tokens, model=config.model)
            result = await stream_chat(client, config.endpoint, body, RequestResult("chat", conversation=index))
            results.append(result)
            bar.done(result)

    await asyncio.gather(*(client_task() for _ in range(min(config.concurrency, config.requests))))
    return results


def agent_tools(config: BenchConfig) -> list[dict] | None:
    """The Chat Completions ``tools`` of an agent run with ``tools`` (Claude Code's ten), else None."""
    if not config.tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in agent_script.CLAUDE_TOOLS]


def shared_system(config: BenchConfig, calibration: "Calibration") -> str:
    """The system prompt every agent conversation starts with."""
    if not config.shared_system_tokens:
        return workloads.SYSTEM_PROMPT
    words = calibration.words(config.shared_system_tokens, whole_prompt=False)
    return agent_script.system_text(config.seed, f"shared-{config.seed}", words=words)


async def _run_agent(
    client: httpx.AsyncClient, config: BenchConfig, words: int, bar: _Bar, sessions: list[str],
    system: str = workloads.SYSTEM_PROMPT, calibration: Calibration | None = None,
) -> tuple[list[RequestResult], list[tuple[int, int, tuple[dict, ...]]]]:
    """The conversations (and their subagents: indices from ``conversation_count`` on); every
    session id used is appended to ``sessions`` before its first turn."""
    run_id = uuid.uuid4().hex[:10]
    tools = agent_tools(config)
    gate = asyncio.Semaphore(config.concurrency)
    results: list[RequestResult] = []
    last_histories: list[tuple[int, int, tuple[dict, ...]]] = []
    spawned: list[asyncio.Task] = []
    context = calibration.words(config.context_tokens, whole_prompt=False) if config.context_tokens else 0
    sub_context = (calibration.words(config.subagent_context_tokens, whole_prompt=False)
                   if config.subagent_context_tokens else 0)

    @contextlib.asynccontextmanager
    async def held(per_turn: bool):
        if per_turn:
            yield
        else:
            async with gate:
                yield

    async def turns_of(conversation: workloads.Conversation, index: int, turns: int, per_turn: bool,
                       children: list[int]) -> None:
        async with held(per_turn):
            sessions.append(conversation.session_id)
            for turn in range(1, turns + 1):
                if turn == SUBAGENT_TURN:
                    spawned.extend(asyncio.create_task(subagent_task(k)) for k in children)
                history = conversation.next_user_turn()
                body = chat_body(history, max_tokens=config.max_tokens, session_id=conversation.session_id,
                                 model=config.model, tools=tools)
                # the session in X-Session-Id too: the header a router keys its session affinity by
                async with (gate if per_turn else contextlib.nullcontext()):
                    result = await stream_chat(client, config.endpoint, body, RequestResult("turn", index, turn),
                                               headers={"X-Session-Id": conversation.session_id})
                results.append(result)
                bar.done(result)
                if not result.ok:  # the history cannot grow past a failed turn
                    for skipped in range(turn + 1, turns + 1):
                        missed = RequestResult("turn", index, skipped, error=f"skipped: turn {turn} failed")
                        results.append(missed)
                        bar.done(missed)
                    if turn < SUBAGENT_TURN:  # its subagents never start: counted as failed
                        for k in children:
                            for skipped in range(1, config.subagent_turns + 1):
                                missed = RequestResult("turn", config.conversation_count + k, skipped,
                                                       error=f"skipped: parent turn {turn} failed")
                                results.append(missed)
                                bar.done(missed)
                    return
                conversation.record_reply(result.content, result.reasoning, result.reply)
            if index < config.conversation_count:
                last_histories.append((index, turns, history))

    async def conversation_task(index: int) -> None:
        conversation = workloads.Conversation(index, f"bench-{run_id}-{index}", config.seed, words, system=system,
                                              context_words=context)
        children = [k for k in range(config.subagents) if k % config.conversation_count == index]
        await turns_of(conversation, index, config.turns, config.interleave, children)

    async def subagent_task(k: int) -> None:
        index = config.conversation_count + k
        conversation = workloads.Conversation(index, f"bench-{run_id}-sub{k}", config.seed, words, system=system,
                                              context_words=sub_context)
        await turns_of(conversation, index, config.subagent_turns, True, [])  # (its parent may hold a client)

    await asyncio.gather(*(conversation_task(i) for i in range(config.conversation_count)))
    while spawned:  # (a subagent spawns none, so the list is final once the parents are done)
        await spawned.pop()
    return results, last_histories


async def _run_baselines(
    client: httpx.AsyncClient, config: BenchConfig, histories: list[tuple[int, int, tuple[dict, ...]]], bar: _Bar
) -> list[RequestResult]:
    gate = asyncio.Semaphore(config.concurrency)

    async def replay(index: int, turn: int, history: tuple[dict, ...]) -> RequestResult:
        async with gate:
            body = chat_body(history, max_tokens=config.max_tokens, model=config.model, tools=agent_tools(config))
            result = await stream_chat(client, config.endpoint, body, RequestResult("baseline", index, turn))
            bar.done(result)
            return result

    return list(await asyncio.gather(*(replay(*entry) for entry in sorted(histories))))


@attrs.define
class Cleanup:
    """What deleting the run's sessions did."""

    deleted: int = 0
    #: session id -> why it could not be deleted
    left: dict[str, str] = attrs.field(factory=dict)


async def delete_sessions(client: httpx.AsyncClient, config: BenchConfig, sessions: list[str],
                          cleanup: Cleanup, *, patience: float = 5.0) -> None:
    """``DELETE /v1/sessions/{id}`` for each of ``sessions`` (emptied as they are handled).
    A 409 (its last request is still winding down, e.g. after Ctrl-C) is retried for up to
    ``patience`` seconds; a 404 means it is gone already, unless the server says its
    sessions API is off."""
    base = config.url.rstrip("/").removesuffix("/v1")
    while sessions:
        name = sessions.pop()
        deadline = time.monotonic() + patience
        while True:
            try:
                # X-Session-Id: behind a router, the DELETE goes to the replica holding the session
                response = await client.delete(f"{base}/v1/sessions/{name}", headers={"X-Session-Id": name})
            except httpx.HTTPError as exc:
                cleanup.left[name] = f"{type(exc).__name__}: {exc}".rstrip(": ")
                break
            if response.status_code == 200:
                cleanup.deleted += 1
                break
            reason = _error_message(response)
            if response.status_code == 404 and "turned off" not in reason:
                break  # never created (its first turn failed) or closed already
            if response.status_code != 409 or time.monotonic() > deadline:
                cleanup.left[name] = f"HTTP {response.status_code}: {reason}"
                break
            await asyncio.sleep(0.1)


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error") or {}
        return str(error.get("message") or error)
    except (ValueError, AttributeError):
        return response.text[:200]


COUNTERS = ("engine_steps", "spec_drafted_tokens", "spec_accepted_tokens", "spec_verify_blocks")


async def engine_counters(client: httpx.AsyncClient, config: BenchConfig) -> dict[str, float] | None:
    """The engine counters of the server's ``/metrics`` (None when it has none)."""
    base = config.url.rstrip("/").removesuffix("/v1")
    try:
        response = await client.get(f"{base}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values = {}
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        key = name.removeprefix("musegl_").removesuffix("_total")
        if name.startswith("musegl_") and key in COUNTERS:
            values[key] = float(value)
    return values or None


async def run_bench_async(config: BenchConfig, *, progress: bool = True,
                          event_hooks: dict[str, list] | None = None) -> BenchReport:
    """Run ``config`` against its server and return the report (``event_hooks``: httpx's,
    e.g. to record the requests sent)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.timeout, connect=min(config.timeout, 10.0))
    limits = httpx.Limits(max_connections=config.concurrency + 2, max_keepalive_connections=config.concurrency + 2)
    sessions: list[str] = []
    cleanup = Cleanup()
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits, event_hooks=event_hooks) as client:
        try:
            with _progress_bar(progress) as bar:
                bar.phase("calibrating", 2)
                calibration = await calibrate(client, config)
                words = calibration.words(config.prompt_tokens, whole_prompt=config.workload == "chat")
                title = f"{config.workload} x{config.concurrency}" if config.api == "chat" else f"{config.api} + chat"
                bar.phase(title, config.measured_requests)
                before = await engine_counters(client, config)
                started = time.perf_counter()
                histories: list = []
                references: list[RequestResult] = []
                if config.api != "chat":
                    sizes = Sizes(calibration.words(config.system_tokens, whole_prompt=False), words)
                    results, references = await run_replays(
                        client, config, sizes, bar, sessions,
                        lambda names: delete_sessions(client, config, names, cleanup))
                elif config.workload == "chat":
                    results = await _run_chat(client, config, words, bar)
                else:
                    results, histories = await _run_agent(client, config, words, bar, sessions,
                                                          shared_system(config, calibration), calibration)
                duration = time.perf_counter() - started
                after = await engine_counters(client, config)
                await delete_sessions(client, config, sessions, cleanup)  # the baseline needs the slots
                baselines: list[RequestResult] = []
                if config.api == "chat" and config.workload == "agent" and config.baseline and histories:
                    bar.phase("anonymous baseline", len(histories))
                    baselines = await _run_baselines(client, config, histories, bar)
        finally:  # an interrupted run (Ctrl-C cancels this task) deletes its sessions too
            if sessions:
                await delete_sessions(client, config, sessions, cleanup)
                print(f"musegl bench: deleted {cleanup.deleted} of the run's sessions"
                      + (f"; could not delete {', '.join(cleanup.left)}" if cleanup.left else ""), file=sys.stderr)
    return build_report(
        results,
        url=config.url,
        workload=config.workload,
        concurrency=config.concurrency,
        max_tokens=config.max_tokens,
        tokens_per_word=calibration.per_word,
        prompt_overhead=calibration.overhead,
        duration_s=duration,
        baselines=baselines,
        counters=(before, after) if before is not None and after is not None else None,
        sessions_deleted=cleanup.deleted,
        sessions_left=dict(cleanup.left),
        api=config.api,
        references=references,
        tensor_parallel_size=config.tensor_parallel_size,
    )


def run_bench(config: BenchConfig, *, progress: bool = True) -> BenchReport:
    """Synchronous :func:`run_bench_async` (for the CLI and ``benchmarks/``)."""
    return asyncio.run(run_bench_async(config, progress=progress))
