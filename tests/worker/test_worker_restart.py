"""A dying worker fails in-flight requests with 503, /health says 503, the front restarts it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server


@pytest.fixture(scope="module")
def server():
    from musegl_core.tiny import default_model_path

    config = ServeConfig(model=str(default_model_path()), demo=True, port=0, max_context=8192)
    with running_server(config) as running:
        yield running


def long_request(stream: bool) -> dict:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": "Talk for a long time."}],
        "max_tokens": 6000,
        "ignore_eos": True,
        "stream": stream,
    }


def test_killed_worker_fails_inflight_requests_and_comes_back(server):
    url = server.url
    old_pid = server.worker.pid
    outcome: dict = {}

    def non_streaming():
        response = httpx.post(f"{url}/v1/chat/completions", json=long_request(False), timeout=120)
        outcome["status"] = response.status_code
        outcome["body"] = response.json()

    blocking = threading.Thread(target=non_streaming)
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=long_request(True)) as response:
            assert response.status_code == 200
            blocking.start()
            lines = response.iter_lines()
            seen_content = 0
            for line in lines:
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    seen_content += 1
                    if seen_content == 3:
                        break
            time.sleep(0.3)  # let the non-streaming request get admitted too
            os.kill(old_pid, signal.SIGKILL)
            payloads = [line[6:] for line in lines if line.startswith("data: ")]
        # The stream ended with the worker's death; the replacement takes seconds to load.
        health_during = httpx.get(f"{url}/health", timeout=10)
    blocking.join(60)

    errors = [json.loads(p)["error"] for p in payloads if p != "[DONE]" and "error" in json.loads(p)]
    assert errors, f"the stream must end with an SSE error event, got {payloads[-3:]}"
    assert errors[0]["type"] == "unavailable_error"
    assert payloads[-1] == "[DONE]"
    assert outcome["status"] == 503
    assert outcome["body"]["error"]["type"] == "unavailable_error"

    assert health_during is not None and health_during.status_code == 503
    assert health_during.json()["error"]["type"] == "unavailable_error"

    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.2)
    assert server.worker.pid != old_pid
    again = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "demo", "messages": [{"role": "user", "content": "Hi again"}], "max_tokens": 4},
        timeout=120,
    )
    assert again.status_code == 200
    assert again.json()["usage"]["completion_tokens"] >= 1


@pytest.fixture(scope="module")
def busy_server():
    from musegl_core.tiny import default_model_path

    config = ServeConfig(model=str(default_model_path()), demo=True, port=0, max_context=1024, max_sessions=16,
                         max_inflight_requests=24, max_decode_sequences=8)
    with running_server(config) as running:
        yield running


def test_killing_the_worker_under_concurrent_load_fails_every_request_and_leaks_nothing(busy_server):
    import asyncio

    from musegl_core.testing.server import metric, wait_idle

    url = busy_server.url
    old_pid = busy_server.worker.pid
    streaming_started = 0
    enough = asyncio.Event()

    def body(i: int, stream: bool) -> dict:
        extra = {"session_id": f"kill-{i % 4}"} if i % 3 == 0 else {}  # some share a session: queued
        return {"model": "m", "messages": [{"role": "user", "content": f"request {i} " + "go " * (i % 7)}],
                "max_tokens": 900, "ignore_eos": True, "stream": stream, **extra}

    async def streaming(client: httpx.AsyncClient, i: int) -> dict:
        nonlocal streaming_started
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body(i, True)) as response:
            if response.status_code != 200:
                return {"status": response.status_code, "error": json.loads(await response.aread())["error"]}
            payloads, counted = [], False
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    payloads.append(line[6:])
                    if not counted and '"content"' in line:
                        counted = True
                        streaming_started += 1
                        if streaming_started >= 6:
                            enough.set()
            return {"status": 200, "payloads": payloads}

    async def plain(client: httpx.AsyncClient, i: int) -> dict:
        response = await client.post(f"{url}/v1/chat/completions", json=body(i, False))
        return {"status": response.status_code, "error": response.json().get("error")}

    async def killer():
        await asyncio.wait_for(enough.wait(), 120)
        os.kill(old_pid, signal.SIGKILL)

    async def run_all():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            tasks = [streaming(client, i) for i in range(14)] + [plain(client, 100 + i) for i in range(4)]
            results = await asyncio.gather(killer(), *tasks)
        return results[1:]

    results = asyncio.run(run_all())
    for result in results:
        if result["status"] == 200:  # a stream that had its headers: an SSE error, then [DONE]
            payloads = result["payloads"]
            assert payloads[-1] == "[DONE]"
            errors = [json.loads(p)["error"] for p in payloads[:-1] if "error" in json.loads(p)]
            assert errors and errors[0]["type"] == "unavailable_error", payloads[-3:]
        else:  # refused or failed before headers
            assert result["status"] == 503 and result["error"]["type"] == "unavailable_error", result
    assert sum(r["status"] == 200 for r in results) >= 6

    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.2)
    assert busy_server.worker.pid != old_pid
    assert busy_server.worker._queues == {}  # the front forgot every dead request
    wait_idle(url)
    assert metric(url, "musegl_kv_blocks_used") == 0 and metric(url, "musegl_kv_blocks_reserved") == 0

    async def after():  # the new worker serves the same mix and returns to its baseline
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[client.post(f"{url}/v1/chat/completions",
                                                      json={**body(i, False), "max_tokens": 8}) for i in range(8)])

    assert all(r.status_code == 200 for r in asyncio.run(after()))
    wait_idle(url)
    for session in httpx.get(f"{url}/v1/sessions", timeout=30).json()["data"]:
        assert httpx.delete(f"{url}/v1/sessions/{session['id']}", timeout=30).status_code == 200
    assert metric(url, "musegl_kv_blocks_used") == 0 and metric(url, "musegl_kv_blocks_reserved") == 0
