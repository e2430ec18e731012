"""Logging: X-Request-Id on every response, one summary line per request, /health
polls at DEBUG, one format in both processes, and --log-level honoured by both."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from litestar.testing import TestClient

from musegl_core.config import ServeConfig
from musegl_core.http.app import create_app
from musegl_core.http.request_log import request_id
from musegl_core.logs import FORMAT, configure
from musegl_core.plugins.manager import PluginManager
from musegl_core.worker.client import WorkerClient
from musegl_core.testing.server import free_port


@pytest.fixture(scope="module")
def client():
    config = ServeConfig(max_context=321, api_key="sekret").validate()
    app = create_app(config, PluginManager(only=[]), WorkerClient(config), manage_worker=False)
    with TestClient(app) as c:
        yield c


KEY = {"Authorization": "Bearer sekret"}


def test_a_sane_incoming_request_id_is_kept_and_anything_else_replaced():
    assert request_id([(b"X-Request-Id", b"trace-01:ab/CD+=@x")]) == "trace-01:ab/CD+=@x"
    for bad in (b"", b"has space", b"a" * 129, b"new\nline", b"quote\"d"):
        made = request_id([(b"x-request-id", bad)])
        assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert request_id([]) != request_id([])


@pytest.mark.parametrize("method, path, headers, status", [
    ("GET", "/v1/models", KEY, 200),
    ("GET", "/v1/models", {}, 401),
    ("GET", "/no/such/route", KEY, 404),
    ("GET", "/health", {}, 503),  # the worker is not started here
    ("POST", "/v1/chat/completions", KEY, 400),
])
def test_every_response_carries_the_request_id(client, method, path, headers, status):
    response = client.request(method, path, headers={**headers, "X-Request-Id": "given-1"}, content=b"{}")
    assert response.status_code == status
    assert response.headers["x-request-id"] == "given-1"
    fresh = client.request(method, path, headers=headers, content=b"{}")
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])


def test_one_summary_line_per_request_and_polls_only_at_debug(client, caplog):
    with caplog.at_level(logging.INFO, logger="musegl.http"):
        client.get("/v1/models", headers={**KEY, "X-Request-Id": "sum-1"})
        client.get("/health", headers={"X-Request-Id": "poll-1"})
        client.get("/metrics", headers={**KEY, "X-Request-Id": "poll-2"})
    lines = [r.getMessage() for r in caplog.records if r.name == "musegl.http"]
    assert len([line for line in lines if "sum-1" in line]) == 1
    (line,) = [line for line in lines if "sum-1" in line]
    assert re.fullmatch(r"request sum-1 GET /v1/models 200 total=\d+\.\d{3}s", line)
    assert not any("poll-" in line for line in lines)  # /health and /metrics polls: DEBUG
    with caplog.at_level(logging.DEBUG, logger="musegl.http"):
        client.get("/health", headers={"X-Request-Id": "poll-3"})
    assert any("request poll-3 GET /health 503" in r.getMessage() and r.levelno == logging.DEBUG
               for r in caplog.records)


def test_one_format_names_the_process(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure("warning", "worker")
        logging.getLogger("musegl.engine").info("hidden")
        logging.getLogger("musegl.engine").warning("shown")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING worker musegl.engine: shown\n", err)
    assert "{role}" in FORMAT


def test_log_level_error_silences_both_processes():
    """`musegl serve --log-level error`: no INFO line (front, worker, uvicorn), no progress bar,
    while the server loads, answers and shuts down."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "musegl_core.cli.main", "serve", "--log-level", "error",
                             "--port", str(port), "--max-context", "512", "--throughput-log-interval", "0.01"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.headers["x-request-id"]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert " INFO " not in text and "INFO:" not in text, text
    assert "loading" not in text and "━" not in text, text  # no progress bar either
