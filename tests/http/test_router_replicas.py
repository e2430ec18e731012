"""Two ``musegl serve`` replicas behind vLLM's router (``vllm-router``, the test extra), as
docs/scaling.md ("Replicas") deploys them: the bench's agent workload (multi-turn
conversations in named sessions, each turn resending the whole history) runs through the
router, and every conversation stays on one replica (its ``cached_tokens`` grow every turn,
its session is resident on that replica only) while the conversations spread over both."""

from __future__ import annotations

import asyncio
import contextlib
import re
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
from musegl_core.testing.server import free_port, running_server

pytest.importorskip("vllm_router", reason="vllm-router (the test extra, Linux x86-64) is not installed")

pytestmark = pytest.mark.slow

CONVERSATIONS = 6
TURNS = 3
CONCURRENCY = 3


@contextlib.contextmanager
def router(workers: list[str], policy: str) -> Iterator[str]:
    """``vllm-router`` in front of ``workers``; yields its URL once it answers ``/readiness``."""
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-c", "from vllm_router.launch_router import main; main()",
               "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
               "--health-check-interval-secs", "2", "--log-level", "warning"]
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
