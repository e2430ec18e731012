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
  JSON nested 2,000 levels deep, an 8190 x 8190 PNG.

A separate loop DELETEs a random live session about once a second, active or
not (200, 404 and 409 are all expected answers).

The report: outcomes by action, **unexpected errors by kind**, the RSS of the
front and the worker (before load, after the warm-up, every ``--sample``
seconds, at the end) and the KV blocks in use and reserved at the end, once
idle and with every session deleted, against the baseline before any load.
The run passes when there is no unexpected error, no block is leaked and
both processes' RSS at the end is within ``--rss-tolerance`` of the warm
value. Exit status 0 when it passes, 1 otherwise.

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

from common import serve_process

MAX_REQUEST_BYTES = 12 * 2**20  # room for the 10 MiB hostile bodies; ``oversize`` sends more
SERVE_FLAGS = ("--max-context", "1024", "--max-decode-sequences", "8", "--max-image-bytes", str(2**20),
               "--max-request-bytes", str(MAX_REQUEST_BYTES))
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
    return [
        ("letter-run", "/v1/chat/completions", chat("A" * (10 * 2**20)), (400,)),
        ("letter-run-tokenize", "/tokenize", json.dumps({"prompt": "A" * (10 * 2**20)}).encode(), (200, 400)),
        ("six-mib-prompt", "/v1/chat/completions", chat("lorem ipsum " * (6 * 2**20 // 12)), (400,)),
        ("lone-surrogate", "/v1/chat/completions", chat("x").replace(b'"x"', b'"\\ud800"'), (400,)),
        ("deep-json", "/v1/chat/completions", deep, (400,)),
        ("huge-png", "/v1/chat/completions", chat(image), (200,)),
    ]


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
                    name, path, raw, statuses = self.rng.choice(self.hostile)
                    response = await http.post(f"{self.url}{path}", content=raw,
                                               headers={"content-type": "application/json"})
                    await self.expect(http, f"hostile {name}", response, statuses)
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
        async def one(name: str, path: str, raw: bytes, statuses: tuple[int, ...]) -> None:
            response = await http.post(f"{self.url}{path}", content=raw, headers={"content-type": "application/json"})
            await self.expect(http, f"hostile {name}", response, statuses)

        for body in self.hostile:
            await asyncio.gather(*[one(*body) for _ in range(self.clients)])

    async def run(self, seconds: float, *, prime: bool = False) -> None:
        self.stop_at = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=self.clients + 8, max_keepalive_connections=self.clients + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            if prime:
                await self.prime(http)
            await asyncio.gather(self.deleter(http), *[self.client_loop(http, i) for i in range(self.clients)])


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
    p.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS growth, warm to end")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
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
        asyncio.run(soak.run(args.warmup, prime=True))
        asyncio.run(quiet(url))
        for name, proc in procs.items():
            rss[name]["warm"] = rss_mib(proc)
        samples: list = []
        started = time.monotonic()
        while (left := args.duration - (time.monotonic() - started)) > 0:
            asyncio.run(soak.run(min(args.sample, left)))
            samples.append({"t": round(time.monotonic() - started), **{n: rss_mib(p) for n, p in procs.items()}})
        end = asyncio.run(settle(url))
        asyncio.run(quiet(url))
        for name, proc in procs.items():
            rss[name]["end"] = rss_mib(proc)
            rss[name]["growth"] = round(rss[name]["end"] / rss[name]["warm"] - 1, 4)
        worker_restarted = front.children() != [worker]
    leaked = {key: end[key] - baseline[key] for key in ("kv_blocks_used", "kv_blocks_reserved")}
    report = {
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "clients": args.clients,
        "requests": sum(soak.tally.outcomes.values()) + sum(soak.tally.errors.values()),
        "outcomes": dict(sorted(soak.tally.outcomes.items())),
        "errors": dict(sorted(soak.tally.errors.items())),
        "error_examples": soak.tally.examples,
        "rss_mib": rss,
        "rss_samples": samples,
        "kv_baseline": baseline,
        "kv_end": end,
        "kv_leaked": leaked,
        "worker_restarted": worker_restarted,
    }
    passed = (not soak.tally.errors and not any(leaked.values()) and not worker_restarted
              and all(abs(r["growth"]) <= args.rss_tolerance for r in rss.values()))
    report["passed"] = passed
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
        print(f"soak {'PASSED' if passed else 'FAILED'}: {report['requests']} requests in "
              f"{args.warmup + args.duration:.0f} s, {sum(soak.tally.errors.values())} unexpected errors, "
              f"leaked blocks {leaked}, RSS growth front {rss['front']['growth']:+.1%} "
              f"worker {rss['worker']['growth']:+.1%}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
