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
from tests.support.server import running_server


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
