"""Admission fairness over HTTP (issue 47 item 11, docs/engine.md "Admission"): the front
passes each request's peer address to the worker as its client key, and a second client's
request starts before the queue of the first one's."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx

from musegl_core.config import ServeConfig
from musegl_core.service.sessions import peer_key
from musegl_core.testing.server import running_server


def metric(url: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+]+)$", httpx.get(f"{url}/metrics", timeout=30).text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_peer_key_is_the_peer_address():
    class Peer:
        host = "10.1.2.3"

    class Request:
        client = Peer()

    assert peer_key(Request()) == "10.1.2.3"
    assert peer_key(object()) is None


def test_another_clients_request_starts_before_a_busy_clients_queue():
    from musegl_core.tiny import default_model_path

    config = ServeConfig(model=str(default_model_path()), port=0, max_context=1024, max_sessions=16,
                         max_inflight_requests=1, max_queued_requests=32, max_decode_sequences=4)
    finished: list[str] = []

    def ask(name: str, max_tokens: int, source: str = "127.0.0.1") -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": name}], "max_tokens": max_tokens,
                "ignore_eos": True}
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=300) as client:
            assert client.post(f"{server.url}/v1/chat/completions", json=body).status_code == 200
        finished.append(name)

    with running_server(config) as server, concurrent.futures.ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(ask, f"busy{i}", 120) for i in range(6)]
        deadline = time.monotonic() + 120
        while metric(server.url, "musegl_requests_waiting") < 5:  # one runs, five wait
            assert time.monotonic() < deadline, "the busy client's requests did not queue"
            time.sleep(0.05)
        probe = pool.submit(ask, "probe", 1, "127.0.0.2")  # another peer address: another client key
        for future in [*busy, probe]:
            future.result()
    # one request runs at a time, and at least four of the busy client's waited when the probe came:
    # first come first served would finish it last; a fair share starts it after the running one
    assert len(finished) - 1 - finished.index("probe") >= 3, finished
