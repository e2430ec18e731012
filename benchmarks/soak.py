"""Soak: mixed load for a set duration, then check for leaks.

Starts ``musegl serve`` (the tiny demo checkpoint unless ``--model``) on
127.0.0.1 and runs ``--clients`` client loops for ``--warmup`` and then
``--duration`` seconds. Each loop picks, at random, one of:

* ``stream``: a streamed request read to ``[DONE]``;
* ``cancel``: a streamed request closed after a few chunks;
* ``plain``: a non-streaming request;
* ``session``: the next turn of the loop's named session, whose history grows
  (reply + new user message) until it nears the context budget, when the loop
  deletes the session and starts another;
* ``bad``: an invalid request (malformed JSON, a bad field), expecting 400;
* ``oversize``: a body over ``--max-request-bytes``, expecting 413;
* ``hostile``: one of the inputs that used to crash or stall the server, each
  expecting its 400 (or 200 where the request is valid): a 10 MiB run of one
  letter (chat and ``/tokenize``), a 6 MiB prompt, a lone ``\ud800`` escape,
  JSON nested 2,000 levels deep, an 8190 x 8190 PNG; and those of issue 47: a
  web page's ``text/plain`` POST with a ``session_id`` (415) and a foreign
  ``Origin`` (403), a 100,000-member enum (400) and 100,000 messages (400),
  a 200,000 x 1 PNG (200, under the row cap), raw surrogate bytes (400), 300
  tools with a forced call (200) and JSON 5,000 levels deep inside a tool
  call's ``arguments`` (400).

Beside the client loops (issue 47's done-when):

* an **idle-socket** loop opens connections that send part of a request line
  and go silent, ``IDLE_BATCH`` every ``IDLE_EVERY`` seconds, and counts how
  many the server closed within ``--header-timeout`` and a margin;
* a **probe** loop asks ``/health`` every 0.2 s, and a second client sends a
  1-token chat request every second: their latencies' p50, p99 and max are
  reported, and the run fails past ``--health-p99`` / ``--probe-p99``;
* the server's **log** is measured before and after: growth past
  ``--log-growth-mb`` fails the run.

A separate loop DELETEs a random live session about once a second, active or
not (200, 404 and 409 are all expected answers).

The report: outcomes by action, **unexpected errors by kind**, the RSS of the
front and the worker (before load, after the warm-up, every ``--sample``
seconds, at the end) and the KV blocks in use and reserved at the end, once
idle and with every session deleted, against the baseline before any load.
The run passes when there is no unexpected error, no block is leaked and both processes' **memory in
use** at the end is within ``--rss-tolerance`` of the warm value: malloc's bytes in use (its arenas
and mapped blocks) plus the bytes in pymalloc's allocated blocks, which each process reports from
inside on ``SIGUSR2`` (``memtrace.py``; no endpoint, no server code). The RSS is reported beside it
(``rss_mib``), no longer judged: it also counts the free memory malloc keeps after transient
allocations (the worker does not trim while serving), which follows the peaks the random mix happens
to reach rather than what the process holds. In the 15-minute quiet run
(``results/soak_hardening_2026-12-07_15min_quiet.json``) the worker's RSS rose from 498 to 591 MiB
in 534 s and then by 66 MiB between two samples, and the front's from 265 to 329 MiB; under the same
mix (``results/memory_growth_2026-12-07``) the memory in use stayed flat (front malloc 97.2 -> 97.5
MiB, worker 274.8 -> 274.1 MiB over 1,756 requests) while the worker's malloc free space differed by
62 MiB between two runs at the same point (29.6 and 91.9 MiB). In the second (with trims) the
worker's anonymous memory grew 25.3 MiB: the host tier's 24 MiB of pages and malloc's 1.3 MiB more
in use; the front's 16.6 MiB: pymalloc's arenas 105 -> 120 MiB while the bytes in their blocks went
64.6 -> 65.2 MiB (arenas a few long-lived objects keep, a high-water, not a leak). Those runs
predate the worker's own trims after each burst of work (``musegl_core/worker/memory.py``). The
worker's RSS growth is counted net of the host KV tier filling its pages (``--kv-offload-memory``,
on by default: its pages become resident as they are first used, up to the tier's size): the
high-water of its bytes in use over the run, minus that at the warm reading, is taken off the end
RSS (``host_tier_filled``).

The warm and the end RSS are read once the server is idle and
:data:`QUIET_SECONDS` later: the front gives freed memory back to the system
after large bodies (``musegl_core/http/memory.py``, ``malloc_trim``), the
last time up to about two seconds after the last one, and the reading waits
for it. Before that, the front's RSS was mostly free space that glibc's
arenas kept from the 10 MiB bodies (390-400 MiB of about 610 MiB at the
warm point, while the memory in use, Python objects under ``tracemalloc``
and malloc's bytes in use, stayed flat), and it rose or fell by tens of MiB
with the mix of large bodies in flight: growth +3.6 % and +5.4 % (240 s) in
two runs, +10.5 to +13.9 % in others, none of it a leak. Since, the front
reads 230-236 MiB at both points (growth -0.6, -2.1, -0.6 % in 2-minute runs).
Without the ``gc.collect()`` before each trim, one run in three still grew
+11.4 % (238 -> 265 MiB), most likely from bodies still held by reference
cycles (a 400 for a wrongly typed field leaves 20 MiB of a 10 MiB body in
cycles until the next full collection). The samples in between are read under load and may
still show peaks.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import sys
import time

import attrs
import httpx
import psutil

import memtrace
from common import serve_process

MAX_REQUEST_BYTES = 12 * 2**20  # room for the 10 MiB hostile bodies; ``oversize`` sends more
SERVE_FLAGS = ("--max-context", "1024", "--max-decode-sequences", "8", "--max-image-bytes", str(2**20),
               "--max-request-bytes", str(MAX_REQUEST_BYTES), "--tool-parser", "atem", "--header-timeout", "5")
#: the server's --header-timeout (above) and the margin the idle-socket loop allows beyond it
HEADER_TIMEOUT, CLOSE_MARGIN = 5.0, 5.0
#: idle sockets opened per batch, and seconds between batches
IDLE_BATCH, IDLE_EVERY = 50, 2.0
# Prompt tokens after which a session starts over. The budget is 1024, and one turn can add
# about 350 tokens on the tiny checkpoint (its tokenizer is nearly byte-level).
HISTORY_LIMIT = 450
#: seconds between the server becoming idle and an RSS reading: the front's last memory trim
#: comes up to two trim intervals (musegl_core.http.memory.TRIM_INTERVAL, 1 s) after its last
#: large request, plus the trims themselves
QUIET_SECONDS = 4.0
ACTIONS = {"stream": 3, "cancel": 2, "plain": 1, "session": 3, "bad": 1, "oversize": 0.3, "hostile": 0.6}


def hostile_bodies() -> list[tuple[str, str, bytes, tuple[int, ...]]]:
    """(name, path, raw JSON body, expected statuses): built once, sent as they are."""
    import base64
    import io

    from PIL import Image

    def chat(content) -> bytes:
        return json.dumps({"model": "soak", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}).encode()

    png = io.BytesIO()
    Image.new("RGB", (8190, 8190), (90, 140, 200)).save(png, format="PNG", optimize=True)
    image = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode(),
                                                "detail": "low"}}]
    deep = b'{"model": "soak", "messages": [], "x": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    thin = io.BytesIO()
    Image.new("RGB", (200_000, 1), (10, 20, 30)).save(thin, format="PNG")
    thin_image = [{"type": "text", "text": "And this?"},
                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                      + base64.b64encode(thin.getvalue()).decode(),
                                                      "detail": "low"}}]  # 64 rows: within --max-context 1024
    enum = {"model": "soak", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "schema": {"type": "string", "enum": [f"value-{i}" for i in range(100_000)]}}}}
    many = {"model": "soak", "max_tokens": 1, "messages": [{"role": "user", "content": f"m{i}"} for i in range(100_000)]}
    tools = {"model": "soak", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
             "tools": [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}
                       for i in range(300)]}
    arguments = '{"a":' + "[" * 5000 + "]" * 5000 + "}"
    nested = {"model": "soak", "max_tokens": 1, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    csrf = b'{"messages":[{"role":"user","content":"x"}],"max_tokens":1,"session_id":"csrf1"}'
    return [
        ("letter-run", "/v1/chat/completions", chat("A" * (10 * 2**20)), (400,)),
        ("letter-run-tokenize", "/tokenize", json.dumps({"prompt": "A" * (10 * 2**20)}).encode(), (200, 400)),
        ("six-mib-prompt", "/v1/chat/completions", chat("lorem ipsum " * (6 * 2**20 // 12)), (400,)),
        ("lone-surrogate", "/v1/chat/completions", chat("x").replace(b'"x"', b'"\\ud800"'), (400,)),
        ("deep-json", "/v1/chat/completions", deep, (400,)),
        ("huge-png", "/v1/chat/completions", chat(image), (200,)),
        ("csrf-text-plain", "/v1/chat/completions", csrf, (415,), {"content-type": "text/plain"}),
        ("csrf-origin", "/v1/messages", csrf, (403,), {"origin": "http://evil.example"}),
        ("huge-enum", "/v1/chat/completions", json.dumps(enum).encode(), (400,)),
        ("many-messages", "/v1/chat/completions", json.dumps(many).encode(), (400,)),
        ("thin-png", "/v1/chat/completions", chat(thin_image), (200,)),
        ("raw-surrogate", "/v1/chat/completions", chat("x").replace(b'"x"', b'"\xed\xa0\x80"'), (400,)),
        ("forced-300-tools", "/v1/chat/completions", json.dumps(tools).encode(), (200, 400)),  # 400: over 1024 tokens
        ("deep-arguments", "/v1/chat/completions", json.dumps(nested).encode(), (400,)),
    ]


def post_hostile(http, url: str, body: tuple):
    """Send one of :func:`hostile_bodies` with its headers (JSON unless it names others)."""
    name, path, raw, statuses, *rest = body
    headers = {"content-type": "application/json", **(rest[0] if rest else {})}
    return http.post(f"{url}{path}", content=raw, headers=headers)


@attrs.define
class Tally:
    outcomes: collections.Counter = attrs.field(factory=collections.Counter)  # "action status"
    errors: collections.Counter = attrs.field(factory=collections.Counter)  # unexpected, by kind
    examples: dict = attrs.field(factory=dict)  # one message per unexpected kind

    def ok(self, action: str, status: int) -> None:
        self.outcomes[f"{action} {status}"] += 1

    def error(self, action: str, kind: str, detail: str = "") -> None:
        key = f"{action}: {kind}"
        self.errors[key] += 1
        self.examples.setdefault(key, detail[:1000])


def error_kind(status: int, body: bytes | str) -> str:
    try:
        error = json.loads(body)["error"]
        return f"{status} {error.get('code') or error.get('type')}"
    except (ValueError, KeyError, TypeError):
        return f"{status}"


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


async def metrics(client: httpx.AsyncClient, url: str) -> str:
    return (await client.get(f"{url}/metrics")).text


def host_tier_mib(url: str) -> float:
    """The host KV tier's pages in use (``musegl_kv_tier_bytes{cache_source="host"}``), MiB; 0 without
    the tier. Its pages are touched as they are first used (a free page is reused before an untouched
    one), so the high-water of this figure is what the tier adds to the worker's RSS by design."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    match = re.search(r'^musegl_kv_tier_bytes\{cache_source="host"\} ([0-9.e+]+)$', text, re.M)
    return round(float(match.group(1)) / 2**20, 1) if match else 0.0


def rss_mib(process: psutil.Process) -> float:
    return round(process.memory_info().rss / 2**20, 1)


@attrs.define
class Soak:
    url: str
    clients: int
    rng: random.Random
    tally: Tally = attrs.field(factory=Tally)
    live_sessions: set = attrs.field(factory=set)
    stop_at: float = 0.0
    hostile: list = attrs.field(factory=list)
    idle: collections.Counter = attrs.field(factory=collections.Counter)  # idle sockets opened, closed
    latency: dict = attrs.field(factory=lambda: {"health": [], "probe": []})  # seconds, in order

    def body(self, messages: list, **extra) -> dict:
        return {"model": "soak", "messages": messages, "max_tokens": self.rng.randint(4, 24),
                "temperature": 0.7, "seed": self.rng.randint(0, 1 << 30), **extra}

    def prompt(self, client: int) -> list:
        words = " ".join(self.rng.choice(["alpha", "beta", "gamma", "delta", "soak", "load"])
                         for _ in range(self.rng.randint(1, 60)))
        return [{"role": "system", "content": "You are a soak test."},
                {"role": "user", "content": f"client {client}: {words}"}]

    async def stream(self, http: httpx.AsyncClient, action: str, body: dict, stop_after: int | None) -> None:
        async with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = await response.aread()
                self.tally.error(action, error_kind(response.status_code, text), text.decode(errors="replace"))
                return
            seen, last = 0, None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line[6:]
                if last != "[DONE]" and '"error"' in last:
                    self.tally.error(action, "sse " + error_kind(200, last), last)
                    return
                seen += 1
                if stop_after is not None and seen >= stop_after:
                    self.tally.ok(action, 200)
                    return  # leaving the block closes the connection: a client disconnect
            if last != "[DONE]":
                self.tally.error(action, "stream ended without [DONE]", str(last))
                return
            self.tally.ok(action, 200)

    async def expect(self, http: httpx.AsyncClient, action: str, response: httpx.Response,
                     statuses: tuple[int, ...]) -> None:
        if response.status_code in statuses:
            self.tally.ok(action, response.status_code)
        else:
            self.tally.error(action, error_kind(response.status_code, response.content), response.text)

    async def client_loop(self, http: httpx.AsyncClient, client: int) -> None:
        generation, history = 0, []
        names, weights = list(ACTIONS), list(ACTIONS.values())
        while time.monotonic() < self.stop_at:
            action = self.rng.choices(names, weights)[0]
            try:
                if action == "stream":
                    await self.stream(http, action, self.body(self.prompt(client), stream=True), None)
                elif action == "cancel":
                    await self.stream(http, action, self.body(self.prompt(client), stream=True, max_tokens=64,
                                                              ignore_eos=True), self.rng.randint(1, 12))
                elif action == "plain":
                    response = await http.post(f"{self.url}/v1/chat/completions", json=self.body(self.prompt(client)))
                    await self.expect(http, action, response, (200,))
                elif action == "bad":
                    if self.rng.random() < 0.5:
                        response = await http.post(f"{self.url}/v1/chat/completions", content=b'{"messages": [',
                                                   headers={"content-type": "application/json"})
                    else:
                        response = await http.post(f"{self.url}/v1/chat/completions",
                                                   json=self.body(self.prompt(client), temperature="hot"))
                    await self.expect(http, action, response, (400,))
                elif action == "oversize":
                    huge = self.body([{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 1024)}])
                    response = await http.post(f"{self.url}/v1/chat/completions", json=huge)
                    await self.expect(http, action, response, (413,))
                elif action == "hostile":
                    body = self.rng.choice(self.hostile)
                    response = await post_hostile(http, self.url, body)
                    await self.expect(http, f"hostile {body[0]}", response, body[3])
                else:
                    name = f"soak-{client}-{generation}"
                    if not history:
                        history = self.prompt(client)
                    self.live_sessions.add(name)
                    response = await http.post(f"{self.url}/v1/chat/completions",
                                               json=self.body(history, session_id=name))
                    await self.expect(http, action, response, (200,))
                    full = True  # start another session after an error, too (never repeat a failing turn)
                    if response.status_code == 200:
                        result = response.json()
                        # The random-weight model's text can re-tokenize much longer than it was
                        # generated (byte-level tokens), so the resent answer is capped at 120 bytes.
                        answer = (result["choices"][0]["message"]["content"] or ".").encode()[:120]
                        answer = answer.decode(errors="ignore") or "."
                        history = history + [
                            {"role": "assistant", "content": answer},
                            {"role": "user", "content": f"turn {len(history)}: " + "more " * self.rng.randint(5, 30)},
                        ]
                        full = result["usage"]["prompt_tokens"] > HISTORY_LIMIT
                    if full:
                        self.live_sessions.discard(name)
                        closed = await http.delete(f"{self.url}/v1/sessions/{name}")
                        await self.expect(http, "session-close", closed, (200, 404))
                        generation, history = generation + 1, []
            except httpx.HTTPError as exc:
                self.tally.error(action, f"transport {type(exc).__name__}", str(exc))

    async def deleter(self, http: httpx.AsyncClient) -> None:
        while time.monotonic() < self.stop_at:
            await asyncio.sleep(self.rng.uniform(0.5, 1.5))
            if not self.live_sessions:
                continue
            name = self.rng.choice(sorted(self.live_sessions))
            try:
                response = await http.delete(f"{self.url}/v1/sessions/{name}")
                await self.expect(http, "delete", response, (200, 404, 409))
            except httpx.HTTPError as exc:
                self.tally.error("delete", f"transport {type(exc).__name__}", str(exc))

    async def prime(self, http: httpx.AsyncClient) -> None:
        """Every client sends every hostile body at once: the warm-up sees the largest burst of
        large bodies the load can produce, so the warm memory figure includes it."""
        async def one(body: tuple) -> None:
            response = await post_hostile(http, self.url, body)
            await self.expect(http, f"hostile {body[0]}", response, body[3])

        for body in self.hostile:
            await asyncio.gather(*[one(body) for _ in range(self.clients)])

    async def idle_sockets(self) -> None:
        """Batches of connections that send part of a request line and go silent: each must be
        closed by the server within the header timeout and a margin."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)

        async def one() -> None:
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError as exc:
                self.tally.error("idle-socket", f"connect {type(exc).__name__}", str(exc))
                return
            self.idle["opened"] += 1
            try:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                await writer.drain()
                closed = await asyncio.wait_for(reader.read(1024), HEADER_TIMEOUT + CLOSE_MARGIN)
                if closed == b"":
                    self.idle["closed"] += 1
                else:
                    self.tally.error("idle-socket", "answered instead of closed", closed[:200].decode(errors="replace"))
            except (asyncio.TimeoutError, TimeoutError):
                self.tally.error("idle-socket", "kept open past the header timeout")
            except OSError:
                self.idle["closed"] += 1  # reset by the server
            finally:
                writer.close()

        tasks = []
        while time.monotonic() < self.stop_at:
            tasks += [asyncio.ensure_future(one()) for _ in range(IDLE_BATCH)]
            await asyncio.sleep(IDLE_EVERY)
        await asyncio.gather(*tasks)

    async def probes(self) -> None:
        """/health every 0.2 s and, from a client of its own, a 1-token chat request every second."""
        async with httpx.AsyncClient(timeout=60) as health, httpx.AsyncClient(timeout=60) as second:
            async def health_loop() -> None:
                while time.monotonic() < self.stop_at:
                    started = time.monotonic()
                    try:
                        response = await health.get(f"{self.url}/health")
                        if response.status_code != 200:
                            self.tally.error("health", error_kind(response.status_code, response.content))
                    except httpx.HTTPError as exc:
                        self.tally.error("health", f"transport {type(exc).__name__}", str(exc))
                    self.latency["health"].append(time.monotonic() - started)
                    await asyncio.sleep(0.2)

            async def probe_loop() -> None:
                body = {"model": "soak", "max_tokens": 1, "messages": [{"role": "user", "content": "probe"}]}
                while time.monotonic() < self.stop_at:
                    started = time.monotonic()
                    try:
                        response = await second.post(f"{self.url}/v1/chat/completions", json=body)
                        await self.expect(second, "probe", response, (200,))
                    except httpx.HTTPError as exc:
                        self.tally.error("probe", f"transport {type(exc).__name__}", str(exc))
                    self.latency["probe"].append(time.monotonic() - started)
                    await asyncio.sleep(1.0)

            await asyncio.gather(health_loop(), probe_loop())

    async def run(self, seconds: float, *, prime: bool = False) -> None:
        self.stop_at = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=self.clients + 8, max_keepalive_connections=self.clients + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            if prime:
                await self.prime(http)
            await asyncio.gather(self.deleter(http), self.idle_sockets(), self.probes(),
                                 *[self.client_loop(http, i) for i in range(self.clients)])


async def wait_idle(http: httpx.AsyncClient, url: str, timeout: float = 120) -> None:
    """Until no request runs or waits in the engine."""
    deadline = time.monotonic() + timeout
    while True:
        text = await metrics(http, url)
        if not metric(text, "musegl_requests_running") and not metric(text, "musegl_requests_waiting"):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become idle")
        await asyncio.sleep(0.2)


async def quiet(url: str) -> None:
    """Wait until idle, then :data:`QUIET_SECONDS` (the front's last memory trim)."""
    async with httpx.AsyncClient(timeout=60) as http:
        await wait_idle(http, url)
    await asyncio.sleep(QUIET_SECONDS)


async def settle(url: str, timeout: float = 120) -> dict:
    """Wait until idle, delete every session, and read the KV counters."""
    async with httpx.AsyncClient(timeout=60) as http:
        await wait_idle(http, url, timeout)
        for session in (await http.get(f"{url}/v1/sessions")).json()["data"]:
            await http.delete(f"{url}/v1/sessions/{session['id']}")
        text = await metrics(http, url)
        return {name: metric(text, f"musegl_{name}") for name in
                ("kv_blocks", "kv_blocks_used", "kv_blocks_reserved", "kv_blocks_cached", "sessions_resident",
                 "sessions_anonymous")}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"n": len(ordered), "p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 3)}


def log_bytes(process: psutil.Process) -> int:
    """The size of the file the server's output goes to (benchmarks/common.py: a log file)."""
    import os

    return os.path.getsize(os.readlink(f"/proc/{process.pid}/fd/1"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120, help="seconds of measured load (after the warm-up)")
    p.add_argument("--warmup", type=float, default=20, help="seconds of load before the warm RSS is taken")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--max-inflight", type=int, default=None,
                   help="the server's --max-inflight-requests (default: 3 x --clients, so nothing waits); "
                   "fewer than --clients makes requests wait in the admission queue, and cancels hit queued ones")
    p.add_argument("--sample", type=float, default=30, help="seconds between RSS samples")
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny demo checkpoint)")
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--rss-tolerance", type=float, default=0.10,
                   help="allowed growth of the memory in use (malloc's and pymalloc's blocks), warm to end")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--health-p99", type=float, default=0.5, help="most /health p99 seconds (after the warm-up)")
    p.add_argument("--probe-p99", type=float, default=2.0, help="most 1-token probe p99 seconds (after the warm-up)")
    p.add_argument("--log-growth-mb", type=float, default=50.0, help="most MB the server's log may grow")
    args = p.parse_args()
    vision: tuple[str, ...] = ()
    if args.model is None:
        from musegl_core.tiny import default_model_path, demo_mmproj_path

        args.model = str(default_model_path(progress=True))
        projector = demo_mmproj_path(args.model)
        vision = ("--mmproj", projector) if projector else ()  # the huge PNG is decoded and encoded
    # A cancelled request keeps its slot until the server notices the disconnect, while its
    # client has already sent the next one: room for that, so capacity refusals stay errors.
    flags = (*SERVE_FLAGS, *vision, "--max-sessions", str(4 * args.clients),
             "--max-inflight-requests", str(args.max_inflight or 3 * args.clients))
    import tempfile
    from pathlib import Path

    dumps = Path(tempfile.mkdtemp(prefix="musegl-soak-memory-"))
    memtrace.enable(dumps)  # the server's processes report the memory they use on SIGUSR2
    with serve_process(args.model, *flags) as (url, process):
        front = psutil.Process(process.pid)
        workers = front.children()
        if len(workers) != 1:
            raise RuntimeError(f"expected one worker process, found {len(workers)}")
        worker = workers[0]
        procs = {"front": front, "worker": worker}
        baseline = asyncio.run(settle(url))
        rss = {name: {"start": rss_mib(proc)} for name, proc in procs.items()}
        soak = Soak(url, args.clients, random.Random(args.seed), hostile=hostile_bodies())
        log_start = log_bytes(front)
        asyncio.run(soak.run(args.warmup, prime=True))
        soak.latency = {"health": [], "probe": []}  # the figures count from the end of the warm-up
        asyncio.run(quiet(url))
        for name, proc in procs.items():
            rss[name]["warm"] = rss_mib(proc)
        live = {name: {"warm": memtrace.live_mib(found)} for name, found in memtrace.dump(procs, dumps).items()}
        host_warm = host_high = host_tier_mib(url)
        samples: list = []
        started = time.monotonic()
        while (left := args.duration - (time.monotonic() - started)) > 0:
            asyncio.run(soak.run(min(args.sample, left)))
            host_high = max(host_high, host_tier_mib(url))
            samples.append({"t": round(time.monotonic() - started), **{n: rss_mib(p) for n, p in procs.items()},
                            "host_tier": host_high})
        end = asyncio.run(settle(url))
        asyncio.run(quiet(url))
        for name, proc in procs.items():
            rss[name]["end"] = rss_mib(proc)
        for name, found in memtrace.dump(procs, dumps).items():
            live[name]["end"] = memtrace.live_mib(found)
            live[name]["growth"] = round(live[name]["end"] / live[name]["warm"] - 1, 4)
        # the worker's growth net of the host KV tier filling its pages (by design, up to its size)
        rss["worker"]["host_tier_filled"] = round(host_high - host_warm, 1)
        for name in procs:
            net = rss[name]["end"] - rss[name].get("host_tier_filled", 0.0)
            rss[name]["growth"] = round(net / rss[name]["warm"] - 1, 4)
        worker_restarted = front.children() != [worker]
        log_growth_mb = round((log_bytes(front) - log_start) / 1e6, 2)
    leaked = {key: end[key] - baseline[key] for key in ("kv_blocks_used", "kv_blocks_reserved")}
    report = {
        "command": " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]]),
        "server": "musegl serve MODEL " + " ".join(flags),
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "clients": args.clients,
        "requests": sum(soak.tally.outcomes.values()) + sum(soak.tally.errors.values()),
        "outcomes": dict(sorted(soak.tally.outcomes.items())),
        "errors": dict(sorted(soak.tally.errors.items())),
        "error_examples": soak.tally.examples,
        "rss_mib": rss,
        "in_use_mib": live,
        "rss_samples": samples,
        "kv_baseline": baseline,
        "kv_end": end,
        "kv_leaked": leaked,
        "worker_restarted": worker_restarted,
        "idle_sockets": dict(soak.idle),
        "health_s": percentiles(soak.latency["health"]),
        "probe_s": percentiles(soak.latency["probe"]),
        "log_growth_mb": log_growth_mb,
    }
    passed = (not soak.tally.errors and not any(leaked.values()) and not worker_restarted
              and all(abs(r["growth"]) <= args.rss_tolerance for r in live.values())
              and report["health_s"].get("p99", 0) <= args.health_p99
              and report["probe_s"].get("p99", 0) <= args.probe_p99 and log_growth_mb <= args.log_growth_mb)
    report["passed"] = passed
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
        print(f"soak {'PASSED' if passed else 'FAILED'}: {report['requests']} requests in "
              f"{args.warmup + args.duration:.0f} s, {sum(soak.tally.errors.values())} unexpected errors, "
              f"leaked blocks {leaked}, memory in use growth front {live['front']['growth']:+.1%} "
              f"worker {live['worker']['growth']:+.1%} (RSS front {rss['front']['growth']:+.1%} "
              f"worker {rss['worker']['growth']:+.1%}); /health {report['health_s']}, probe {report['probe_s']}, "
              f"idle sockets {dict(soak.idle)}, log +{log_growth_mb} MB")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
