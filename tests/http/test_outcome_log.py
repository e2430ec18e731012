"""How a request ended, in its summary line and the counters (issue 49 item 5): a streaming client that
goes away mid-answer is logged 499, a stream that ends with an error event names the error, and the
generation counters count the tokens of both."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import metric, running_server, scripted_plugin_env, wait_idle
from musegl_core.tiny import default_model_path

WRITE = {"type": "function", "function": {"name": "Write", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"]}}}
BAD_CALL = (' to=Write.Write<|message|><atem:function_calls>\n<atem:invoke name="Write.Write">\n'
            '<atem:parameter name="path">a.txt</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eot|>')
SCRIPT = [
    {"when": "Bad call", "reply": BAD_CALL},
    {"when": "Ramble", "reply": " to=user<|message|>word", "eos": False, "token_delay": 0.01},
    {"when": "", "reply": " to=user<|message|>ok<|eot|>"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with scripted_plugin_env(tmp_path_factory.mktemp("outcome"), SCRIPT):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", tool_parser="atem",
                             max_context=4096, max_sessions=2)
        with running_server(config) as running:
            yield running


def summary(caplog, request_id: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"request {request_id} ")]
        if lines:
            return lines[0]
        time.sleep(0.05)
    raise AssertionError(f"no summary line for {request_id}")


def completion(line: str) -> int:
    return int(line.split(" completion=")[1].split()[0])


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Ramble"}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Ramble"}]}),
    ("/v1/responses", {"input": "Ramble"}),
])
def test_a_client_that_leaves_mid_stream_is_logged_499_and_its_tokens_are_counted(server, caplog, path, body):
    caplog.set_level(logging.INFO, logger="musegl.http")
    before = metric(server.url, "musegl_generated_tokens", 0.0)
    limit = {"max_output_tokens" if path == "/v1/responses" else "max_tokens": 3000}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.url}{path}", headers={"X-Request-Id": f"leave-{path[4:8]}"},
                           json={"model": "m", "stream": True, **limit, **body}) as response:
            assert response.status_code == 200
            read = 0
            for line in response.iter_lines():
                read += line.startswith("data:")
                if read >= 40:
                    break  # and close the connection mid-answer
    wait_idle(server.url)
    line = summary(caplog, f"leave-{path[4:8]}")
    assert f" {path} 499 " in line, line
    assert 30 <= completion(line) < 3000, line
    assert metric(server.url, "musegl_generated_tokens") - before >= completion(line)


def test_a_stream_that_ends_in_an_error_event_is_logged_with_its_error(server, caplog):
    caplog.set_level(logging.INFO, logger="musegl.http")
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={"X-Request-Id": "bad-call"}, timeout=60,
                      json={"model": "m", "stream": True, "max_tokens": 200, "tools": [WRITE],
                            "messages": [{"role": "user", "content": "Bad call"}]}) as response:
        text = response.read().decode()
    assert response.status_code == 200 and '"error"' in text
    line = summary(caplog, "bad-call")
    assert " /v1/chat/completions 200 error=" in line, line
    assert completion(line) > 10, line
