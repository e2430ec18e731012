"""Two ``musegl serve`` replicas behind vLLM's router (``vllm-router``, the test extra), as
docs/scaling.md ("Replicas") deploys them: the bench's agent workload (multi-turn
conversations in named sessions, each turn resending the whole history) runs through the
router, and every conversation stays on one replica (its ``cached_tokens`` grow every turn,
its session is resident on that replica only) while the conversations spread over both."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Iterator

import attrs
import httpx
import pytest

from musegl_core.bench import BenchConfig, workloads
from musegl_core.bench.client import RequestResult, chat_body, stream_chat
from musegl_core.bench.runner import run_bench_async
from musegl_core.config import ServeConfig
from musegl_core.testing.server import ServeProcess, free_port, running_server, scripted_plugin_env

pytest.importorskip("vllm_router", reason="vllm-router (the test extra, Linux x86-64) is not installed")

pytestmark = pytest.mark.slow

CONVERSATIONS = 6
TURNS = 3
CONCURRENCY = 3


@contextlib.contextmanager
def router(workers: list[str], policy: str, *, check_every: int = 2) -> Iterator[str]:
    """``vllm-router`` in front of ``workers``; yields its URL once it answers ``/readiness``."""
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-c", "from vllm_router.launch_router import main; main()",
               "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
               "--health-check-interval-secs", str(check_every), "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                response = httpx.get(f"{url}/readiness", timeout=2)
                if response.status_code == 200 and response.json().get("healthy_workers") == len(workers):
                    break
            assert proc.poll() is None, f"vllm-router exited: {proc.stderr.read() if proc.stderr else ''}"
            assert time.monotonic() < deadline, "vllm-router did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    from musegl_core.tiny import default_model_path

    config = ServeConfig(model=str(default_model_path()), port=0, max_context=2048, max_sessions=CONVERSATIONS)
    with running_server(config) as first, running_server(attrs.evolve(config, port=0)) as second:
        yield [first.url, second.url]


async def agent_workload(url: str) -> list[RequestResult]:
    """The bench's agent conversations (``musegl bench --workload agent``): each turn resends the
    history with its session named in the body and in ``X-Session-Id``, the router's key."""
    gate = asyncio.Semaphore(CONCURRENCY)
    results: list[RequestResult] = []

    async def conversation(client: httpx.AsyncClient, index: int) -> None:
        talk = workloads.Conversation(index, f"routed-{index}", seed=31, turn_words=40)
        async with gate:
            for turn in range(1, TURNS + 1):
                body = chat_body(talk.next_user_turn(), max_tokens=8, session_id=talk.session_id)
                result = await stream_chat(client, f"{url}/v1/chat/completions", body,
                                           RequestResult("turn", index, turn),
                                           headers={"X-Session-Id": talk.session_id})
                results.append(result)
                assert result.ok, result.error
                talk.record_reply(result.content, result.reasoning)

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(conversation(client, i) for i in range(CONVERSATIONS)))
    return results


def chat_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(r'^musegl_http_requests_total\{endpoint="/v1/chat/completions",status="200"\} ([0-9.e+]+)$',
                      text, re.M)
    return float(found.group(1)) if found else 0.0


def test_conversations_stay_on_their_replica_and_spread_over_both(replicas):
    before = [chat_requests(url) for url in replicas]
    with router(replicas, "sticky_least_loaded") as url:
        results = asyncio.run(agent_workload(url))
        by_conversation: dict[int, list[RequestResult]] = {}
        for result in sorted(results, key=lambda r: (r.conversation, r.turn)):
            by_conversation.setdefault(result.conversation, []).append(result)
        for turns in by_conversation.values():  # the cache follows the conversation: it grows every turn
            assert turns[0].cached_tokens < turns[0].prompt_tokens
            for previous, current in zip(turns, turns[1:]):
                assert current.cached_tokens >= previous.prompt_tokens, (previous, current)
                assert current.cached_tokens > previous.cached_tokens
        resident = {url: {s["id"]: s for s in httpx.get(f"{url}/v1/sessions", timeout=30).json()["data"]}
                    for url in replicas}
        homes = Counter()
        for index, turns in by_conversation.items():
            name = f"routed-{index}"
            hosts = [replica for replica in replicas if name in resident[replica]]
            assert len(hosts) == 1, (name, hosts)  # one replica holds it: no turn went elsewhere
            homes[hosts[0]] += 1
            session = resident[hosts[0]][name]
            assert session["cached_tokens"] >= turns[-1].prompt_tokens
        assert set(homes) == set(replicas), homes  # the load spread over both
        served = [chat_requests(replica) - start for replica, start in zip(replicas, before)]
        assert served == [homes[replica] * TURNS for replica in replicas]
        for index in by_conversation:  # DELETE goes to the session's replica when it names the key
            name = f"routed-{index}"
            response = httpx.delete(f"{url}/v1/sessions/{name}", headers={"X-Session-Id": name}, timeout=30)
            assert response.status_code == 200, response.text
        assert all(httpx.get(f"{r}/v1/sessions", timeout=30).json()["data"] == [] for r in replicas)


def sessions_closed(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(r"^musegl_sessions_closed_total ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_musegl_bench_agent_runs_through_the_router(replicas):
    """``musegl bench --workload agent --url <router>``: every turn after the first reads the
    conversation's history from its replica, and the run's DELETEs reach the replicas holding
    the sessions (both replicas end with none)."""
    closed = [sessions_closed(url) for url in replicas]
    with router(replicas, "sticky_least_loaded") as url:
        config = BenchConfig(url=url, workload="agent", concurrency=CONCURRENCY, conversations=CONVERSATIONS,
                             turns=TURNS, max_tokens=8, prompt_tokens=60, baseline=False)
        report = asyncio.run(run_bench_async(config, progress=False))
    assert report.errors == 0, report.error_messages
    assert report.sessions_deleted == CONVERSATIONS and report.sessions_left == {}
    for previous, current in zip(report.turns, report.turns[1:]):  # summed over the conversations
        assert current.cached_tokens >= previous.prompt_tokens, (previous, current)
    assert all(httpx.get(f"{r}/v1/sessions", timeout=30).json()["data"] == [] for r in replicas)
    deleted_on = [sessions_closed(url) - start for url, start in zip(replicas, closed)]
    assert sum(deleted_on) == CONVERSATIONS and all(deleted_on), deleted_on  # both replicas held some


DRAIN_SCRIPT = [{"when": "", "reply": " to=user<|message|>" + "word " * 24 + "<|eot|>", "token_delay": 0.05}]


def turn(url: str, messages: list[dict], session: str) -> tuple[list[dict], str]:
    """One streamed turn through ``url``: its chunks (the last has the usage) and its text."""
    body = {"model": "m", "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 200, "session_id": session}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": session},
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return chunks, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def resident(url: str) -> list[str]:
    return [s["id"] for s in httpx.get(f"{url}/v1/sessions", timeout=30).json()["data"]]


def test_sigterm_drains_a_replica_behind_the_router(tmp_path):
    """SIGTERM to the replica holding a conversation, mid-stream: the running turn finishes,
    the replica exits, the router takes it out of rotation, and the conversation's next turn
    (its whole history resent) is served by the other replica."""
    from musegl_core.tiny import default_model_path

    with scripted_plugin_env(tmp_path, DRAIN_SCRIPT):
        servers = [ServeProcess(str(default_model_path()), "--executor", "scripted", "--max-context", "1024",
                                "--shutdown-timeout", "30") for _ in range(2)]
        try:
            urls = [server.wait_ready() for server in servers]
            with router(urls, "sticky_least_loaded", check_every=1) as url:
                messages = [{"role": "user", "content": "Hello there"}]
                _, reply = turn(url, messages, "drain")
                home = next(i for i, replica in enumerate(urls) if "drain" in resident(replica))
                other = 1 - home
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on"}]
                body = {"model": "m", "messages": messages, "stream": True, "max_tokens": 200, "session_id": "drain"}
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                                  headers={"X-Session-Id": "drain"}, timeout=60) as response:
                    lines = response.iter_lines()
                    for line in lines:
                        if '"content"' in line:
                            break
                    servers[home].signal(signal.SIGTERM)  # mid-stream
                    rest = [line[6:] for line in lines if line.startswith("data: ")]
                assert rest[-1] == "[DONE]"
                finished = [json.loads(p) for p in rest[:-1]]
                assert not any("error" in c for c in finished)
                assert finished[-1]["choices"][0]["finish_reason"] == "stop"  # the turn ran to its end
                assert servers[home].wait(30) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
                assert "Traceback" not in servers[home].stderr
                deadline = time.monotonic() + 30
                while httpx.get(f"{url}/readiness", timeout=5).json().get("healthy_workers") != 1:
                    assert time.monotonic() < deadline, "the router kept the drained replica"
                    time.sleep(0.2)
                messages += [{"role": "assistant", "content": "".join(
                    c["choices"][0]["delta"].get("content") or "" for c in finished if c["choices"])},
                    {"role": "user", "content": "And then?"}]
                chunks, _ = turn(url, messages, "drain")
                assert chunks[-1]["usage"]["completion_tokens"] > 0
                assert resident(urls[other]) == ["drain"]  # the other replica took the conversation over
        finally:
            for server in servers:
                server.kill()
