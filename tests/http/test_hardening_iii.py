"""Hardening III (issue 47): a local server that no web page can drive, idle sockets
cannot starve, heavy bodies cannot freeze; no 500s, nothing silently ignored.

The checks that need no model run on the application alone (Litestar's test
client); the rest on a real front and worker with the scripted executor."""

from __future__ import annotations

import io
import logging
import socket
import sys
import time

import httpx
import pytest
from litestar.testing import TestClient

from musegl_core.config import ServeConfig
from musegl_core.http.app import create_app
from musegl_core.plugins.manager import PluginManager
from musegl_core.testing.server import running_server, scripted_plugin_env
from musegl_core.worker.client import WorkerClient

SCRIPT = [{"when": "special please", "reply": " to=user<|message|>a<|reserved_special_token_5|>b<|eot|>"},
          {"when": "", "reply": " to=user<|message|>ok<|eot|>"}]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


@pytest.fixture(scope="module")
def client():
    """The whole application, every installed plugin's surfaces, no worker (503 after validation)."""
    config = ServeConfig().validate()
    app = create_app(config, PluginManager(), WorkerClient(config), manage_worker=False)
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    with scripted_plugin_env(tmp_path_factory.mktemp("hardening"), SCRIPT):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", max_context=512,
                             header_timeout=1.0, idle_timeout=1.0, max_connections=24)
        with running_server(config) as running:
            yield running


# -- item 1: cross-site requests -------------------------------------------------------------------
@pytest.mark.parametrize("path", GENERATION_ROUTES)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_simple_cross_site_content_type_is_415(client, path, content_type):
    response = client.post(path, content=b'{"messages":[{"role":"user","content":"x"}],"max_tokens":1}',
                           headers={"content-type": content_type})
    assert response.status_code == 415, response.text
    assert "x-request-id" in response.headers
    assert "must be JSON" in response.text  # each surface's envelope (Anthropic's has no code)


def test_json_content_types_pass_the_check(client):
    for content_type in ("application/json", "application/json; charset=utf-8", "application/vnd.x+json"):
        response = client.post("/v1/chat/completions", content=b'{"messages": 1}', headers={"content-type": content_type})
        assert response.status_code == 400, response.text  # validation, not the media type


@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_a_foreign_origin_is_refused_on_a_keyless_server(client, path):
    response = client.post(path, json=CHAT, headers={"origin": "http://evil.example"})
    assert response.status_code == 403, response.text
    assert "--cors-allow-origin" in response.text
    assert client.post(path, json=CHAT, headers={"origin": "null"}).status_code == 403


def test_the_servers_own_origin_and_allowed_origins_pass(tmp_path):
    config = ServeConfig(cors_allow_origins=("https://app.example",)).validate()
    app = create_app(config, PluginManager(only=[]), WorkerClient(config), manage_worker=False)
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        own = c.post("/v1/chat/completions", json={"messages": 1}, headers={"origin": "http://127.0.0.1:8000"})
        assert own.status_code == 400
        allowed = c.post("/v1/chat/completions", json={"messages": 1}, headers={"origin": "https://app.example"})
        assert allowed.status_code == 400
        other_port = c.post("/v1/chat/completions", json={"messages": 1}, headers={"origin": "http://127.0.0.1:9"})
        assert other_port.status_code == 403
    keyed = ServeConfig(api_key="k").validate()
    app = create_app(keyed, PluginManager(only=[]), WorkerClient(keyed), manage_worker=False)
    with TestClient(app) as c:  # with a key, a page cannot authenticate without a preflight
        response = c.post("/v1/chat/completions", json={"messages": 1},
                          headers={"origin": "http://evil.example", "authorization": "Bearer k"})
        assert response.status_code == 400


def test_a_text_plain_csrf_post_cannot_take_a_session(server):
    """The issue's reproduction: a page's text/plain POST with a session_id."""
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                          headers={"origin": "http://evil.example", "content-type": "text/plain"},
                          content=b'{"messages":[{"role":"user","content":"x"}],"max_tokens":1,"session_id":"csrf1"}')
    assert response.status_code in (403, 415)
    sessions = httpx.get(f"{server.url}/v1/sessions", timeout=30).json()
    assert "csrf1" not in str(sessions)


# -- item 2: DNS rebinding -------------------------------------------------------------------------
def test_a_foreign_host_is_refused_on_a_loopback_bind(server):
    response = httpx.get(f"{server.url}/v1/sessions", headers={"host": "attacker.test:8000"}, timeout=30)
    assert response.status_code == 403 and "host_not_allowed" in response.text
    for host in ("localhost", f"127.0.0.1:{server.config.port}", "[::1]:1", "app.localhost"):
        assert httpx.get(f"{server.url}/v1/models", headers={"host": host}, timeout=30).status_code == 200


def test_allowed_host_admits_a_name():
    from musegl_core.http.guards import BrowserGuard

    guard = BrowserGuard(ServeConfig(allowed_hosts=("musegl.lan",)))
    assert guard.host_allowed("musegl.lan:8000") and not guard.host_allowed("attacker.test")
    assert BrowserGuard(ServeConfig(allowed_hosts=("*",))).host_allowed("attacker.test")


# -- item 5: --api-key in the process list -----------------------------------------------------------
def test_an_api_key_on_the_command_line_is_warned_about():
    from musegl_core.cli.serve import key_on_command_line

    assert "MUSEGL_API_KEY" in key_on_command_line(["--api-key", "s3cret"])
    assert "MUSEGL_API_KEY" in key_on_command_line(["--api-key=s3cret"])
    assert key_on_command_line(["--port", "8000"]) is None


# -- item 6: idle sockets --------------------------------------------------------------------------
def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def test_partial_headers_and_a_silent_body_are_closed_on_time(server):
    port = server.config.port
    with socket.create_connection(("127.0.0.1", port)) as headers_only:
        headers_only.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.monotonic()
        assert _closed_within(headers_only, 5), "partial headers were kept open"
        assert time.monotonic() - started < 4
    with socket.create_connection(("127.0.0.1", port)) as silent:
        assert _closed_within(silent, 5), "a connection that never sent a byte was kept open"
    with socket.create_connection(("127.0.0.1", port)) as body:
        body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"messages\"")
        assert _closed_within(body, 5), "a body that went silent was kept open"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_connections_beyond_the_cap_are_closed_and_health_recovers(server):
    port = server.config.port
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        for sock in held:
            sock.sendall(b"GET /health HTTP/1.1\r\n")  # never finished
        time.sleep(0.3)
        closed = sum(_closed_within(sock, 0.05) for sock in held)
        assert closed >= 40 - 24, closed  # the cap (24) holds: the rest were closed at once
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# -- items 7 and 8: the log is bounded ----------------------------------------------------------------
def test_repeated_lines_are_rate_limited_and_client_strings_cut(monkeypatch):
    from musegl_core import logs

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        logs.configure("info", "front")
        log = logging.getLogger("asyncio")
        for _ in range(10_000):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                log.exception("socket.accept() out of system resource")
        logging.getLogger("musegl.http").warning("bad type %r", "x" * (20 << 20))
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    text = stream.getvalue()
    assert text.count("socket.accept() out of system resource") == logs.BURST
    assert len(text) < 200_000, len(text)  # 10,000 tracebacks and a 20 MiB string were written whole before
    assert "more characters left out" in text


def test_a_window_that_dropped_lines_says_how_many():
    from musegl_core.logs import RepeatLimit

    now = [0.0]
    limit = RepeatLimit(burst=2, window=10, clock=lambda: now[0])

    def record():
        return logging.LogRecord("x", logging.ERROR, "f.py", 1, "same %s", ("line",), None)

    assert [limit.filter(record()) for _ in range(5)] == [True, True, False, False, False]
    now[0] = 11
    later = record()
    assert limit.filter(later) and "3 more like this" in later.getMessage()


# -- item 12: raw surrogate bytes ------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}], "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "\xed\xbf\xbf", "max_tokens": 1}'),
    ("/v1/messages", b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'),
    ("/v1/responses", b'{"model": "m", "input": "\xed\xa0\x80"}'),
    ("/tokenize", b'{"prompt": "\xed\xa0\x80"}'),
])
def test_raw_utf8_surrogate_bytes_are_the_invalid_unicode_400(client, path, body):
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert "surrogate" in response.text


# -- item 14: JSON nested inside an arguments string -------------------------------------------------
@pytest.mark.parametrize("depth", [5000, 200])
def test_deep_json_inside_tool_call_arguments_is_a_400(client, depth):
    arguments = '{"a":' + "[" * depth + "]" * depth + "}"
    body = {"messages": [{"role": "user", "content": "x"},
                         {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "f", "arguments": arguments}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 1}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "json_too_deep" and error["param"] == "messages[1].tool_calls[0].function.arguments"


# -- item 16: a client that hangs up while uploading -------------------------------------------------
def test_a_client_gone_mid_body_is_499_not_500(server):
    def count(status: str) -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("musegl_http_requests_total{") and f'status="{status}"' in line)

    before_500, before_499 = count("500"), count("499")
    with socket.create_connection(("127.0.0.1", server.config.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"messages\": [")
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while count("499") == before_499 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert count("499") == before_499 + 1
    assert count("500") == before_500


# -- items 17 and 22: /v1/completions ----------------------------------------------------------------
def test_completions_context_errors_name_the_prompt(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello " * 600, "max_tokens": 4}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "messages" not in error["message"]


def test_completions_default_to_16_tokens(server):
    from musegl_core.http.schemas import structure_body
    from musegl_core.openai import schemas as s
    from musegl_core.openai.completions import plan_completion

    plan = plan_completion(structure_body({"prompt": "hi"}, s.CompletionRequest), request_id="r",
                           config=server.config)
    assert plan.generate.max_tokens == 16  # None before: the whole context budget (8,191 tokens in 75 s)
    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "ignore_eos": True}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 16
    given = plan_completion(structure_body({"prompt": "hi", "max_tokens": 40}, s.CompletionRequest),
                            request_id="r", config=server.config)
    assert given.generate.max_tokens == 40


# -- item 13: a panic in the grammar library --------------------------------------------------------
@pytest.fixture(scope="module")
def tools_client():
    config = ServeConfig(tool_parser="atem").validate()
    app = create_app(config, PluginManager(), WorkerClient(config), manage_worker=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_a_panic_in_the_grammar_library_is_a_json_400(tools_client, monkeypatch):
    """llguidance answered 256+ forced tools with a Rust panic ("class too large"), a
    BaseException that passed every handler: a plain-text 500 without X-Request-Id."""
    import llguidance

    panic = type("PanicException", (BaseException,), {})

    def panicking(grammar):
        raise panic("class too large")

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", staticmethod(panicking))
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}
             for i in range(300)]
    response = tools_client.post("/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": "required"})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "class too large" in error["message"]
    assert "internal limits" in error["message"] and "x-request-id" in response.headers


def test_a_base_exception_past_the_handlers_is_a_json_500_with_the_request_id(tools_client, monkeypatch):
    from musegl_core.openai import schemas as s

    def panicking(payload):
        raise type("PanicException", (BaseException,), {})("boom")

    monkeypatch.setattr(s, "structure_request", panicking)
    response = tools_client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    assert "x-request-id" in response.headers


# -- item 23: whole, plain error messages -----------------------------------------------------------
def test_a_regex_error_is_given_whole(client):
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "pattern": "a{"}}}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("the output constraint cannot be enforced: regex parse error:")
    assert len(message) > len("the output constraint cannot be enforced: regex parse error:") + 10, message
    assert "\n" not in message


def test_a_huge_integer_names_no_python_internals(client):
    raw = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": ' + b"9" * 100_000 + b"}"
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "sys.set_int_max_str_digits" not in message and "4300 digits" in message


# -- item 20: nothing silently ignored on Chat Completions ------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]), ("function_call", {"name": "f"}),
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
    ("verbosity", "low"), ("service_tier", "flex"), ("store", True), ("metadata", {"k": 1}),
    ("some_vendor_key", {"x": 1}), ("provider", {"order": ["a"]}), ("transforms", ["middle-out"]), ("models", ["a"]),
])
def test_chat_completions_refuse_what_they_would_ignore(client, field, value):
    response = client.post("/v1/chat/completions", json={**CHAT, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter"


@pytest.mark.parametrize("field, value", [
    ("user", "u-1"), ("safety_identifier", "h"), ("metadata", {"k": "v"}), ("store", False),
    ("service_tier", "auto"), ("service_tier", "default"), ("modalities", ["text"]), ("verbosity", "medium"),
])
def test_chat_completions_take_fields_that_change_nothing(client, field, value):
    response = client.post("/v1/chat/completions", json={**CHAT, field: value})
    assert response.status_code == 503, response.text  # past validation: no worker here


# -- item 10: extreme aspect ratios stay under the patch cap -------------------------------------------
@pytest.mark.parametrize("width, detail, cap", [(200_000, None, 1024), (200_000, "low", 64), (1_000_000, "low", 64),
                                                (1_000_000, None, 1024)])
def test_a_one_pixel_high_png_stays_under_the_row_cap(width, detail, cap):
    from PIL import Image

    from musegl_core.vision.preprocess import ImagePreprocessor

    buffer = io.BytesIO()
    Image.new("RGB", (width, 1), (10, 20, 30)).save(buffer, "PNG")
    assert len(buffer.getvalue()) < 5000  # hundreds of bytes: the 662-byte PNG
    for size in ((width, 1), (1, width)):
        buffer = io.BytesIO()
        Image.new("RGB", size, (10, 20, 30)).save(buffer, "PNG")
        image = ImagePreprocessor(max_vision_patches=4096).preprocess_bytes(buffer.getvalue(), "image/png", detail)
        assert 1 <= image.rows <= cap, (size, detail, image.rows)  # 7,140 / 3,575 / 8,000 rows before


# -- item 19: a linear $ref chain counts what is expanded ------------------------------------------------
def ref_chain(length: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length - 1)}
    defs[f"d{length - 1}"] = {"type": "string"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": defs}


@pytest.mark.parametrize("length", [60, 91, 200])
def test_a_linear_ref_chain_is_counted_once(tools_client, length):
    """91 definitions were refused as "more than 4096 subschemas": every definition was
    expanded once from $defs and again along the chain (n^2 / 2 nodes)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": ref_chain(length)}}]
    response = tools_client.post("/v1/chat/completions", json={**CHAT, "tools": tools})
    assert response.status_code == 503, response.text[:400]  # past every check: no worker here


def test_a_chain_past_the_hop_limit_says_so():
    from musegl_atem.schemas import MAX_PREFLIGHT_VISITS, MAX_REFERENCE_HOPS, SchemaRejected, compile_tool

    def root_chain(length: int) -> dict:  # the root's alternatives are expanded along the chain
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length - 1)}
        defs[f"d{length - 1}"] = {"type": "object", "properties": {"a": {"type": "string"}}}
        return {"$ref": "#/$defs/d0", "$defs": defs}

    assert compile_tool("t", root_chain(91), MAX_PREFLIGHT_VISITS).expanded_nodes == 93
    with pytest.raises(SchemaRejected, match="chain more than"):
        compile_tool("t", root_chain(MAX_REFERENCE_HOPS + 10), MAX_PREFLIGHT_VISITS)


# -- item 9: heavy bodies do not freeze the front --------------------------------------------------------
@pytest.mark.parametrize("where", ["response_format", "tool"])
def test_a_huge_enum_is_refused_by_its_bound(tools_client, where):
    enum = [f"value-{i}" for i in range(100_000)]
    if where == "response_format":
        body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "schema": {"type": "string", "enum": enum}}}}
    else:
        body = {**CHAT, "tool_choice": "required", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"enum": enum}}}}}]}
    started = time.monotonic()
    response = tools_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text[:300]
    assert "more than 10000 values" in response.json()["error"]["message"]
    assert time.monotonic() - started < 5


def test_health_is_answered_while_a_heavy_body_is_prepared(server):
    """Order of events: while 100,000 messages are parsed and checked (1.6 s on the event loop
    before), /health answers, each time in a fraction of the heavy request's time."""
    import threading

    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": f"m{i}"} for i in range(100_000)]}
    done: list[float] = []

    def heavy():
        started = time.monotonic()
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        done.append(time.monotonic() - started)

    thread = threading.Thread(target=heavy)
    thread.start()
    time.sleep(0.3)  # the body is sent and being prepared
    waits = []
    while thread.is_alive() and len(waits) < 50:
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        waits.append(time.monotonic() - started)
        time.sleep(0.02)
    thread.join()
    assert waits, "the heavy request ended before /health was asked"
    assert max(waits) < done[0] / 2, (max(waits), done[0])


def test_the_preparation_lane_is_bounded():
    import asyncio
    import threading

    from musegl_core.errors import ApiError
    from musegl_core.http.offload import Lane

    lane, release = Lane(threads=1, waiting=1), threading.Event()

    async def main():
        first = asyncio.ensure_future(lane.run(release.wait, 10))
        second = asyncio.ensure_future(lane.run(lambda: "ran"))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as busy:
            await lane.run(lambda: None)
        assert busy.value.status == 503 and busy.value.code == "server_busy"
        release.set()
        assert await first and await second == "ran"
        assert await lane.run(lambda: 7) == 7

    asyncio.run(main())


def test_a_heavy_body_is_prepared_on_the_heavy_lane_at_a_lower_priority_and_small_ones_pass_it():
    import asyncio
    import os
    import threading

    from musegl_core.http import offload
    from musegl_core.http.request_log import CURRENT, RequestRecord

    def where():
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    release = threading.Event()

    async def as_request(body_bytes, fn, *args):
        token = CURRENT.set(RequestRecord(id="t", started=0.0, body_bytes=body_bytes))
        try:
            return await offload.off_loop(fn, *args)
        finally:
            CURRENT.reset(token)

    async def main():
        base = os.getpriority(os.PRIO_PROCESS, 0)
        name, nice = await as_request(offload.HEAVY_BYTES, where)
        assert name.startswith("musegl-prepare-heavy") and nice == min(19, base + offload.HEAVY_NICE)
        # every heavy thread busy: a small request is still prepared at once, at the process's priority
        busy = [asyncio.ensure_future(as_request(offload.HEAVY_BYTES, release.wait, 10))
                for _ in range(offload.THREADS)]
        await asyncio.sleep(0.05)
        name, nice = await asyncio.wait_for(as_request(100, where), 5)
        assert name.startswith("musegl-prepare-light") and nice == base
        assert not any(job.done() for job in busy)
        release.set()
        assert all(await asyncio.gather(*busy))

    asyncio.run(main())


# -- item 4: cache_salt on every surface -------------------------------------------------------------
def test_cache_salt_isolates_the_prefix_cache_on_messages_and_responses(server):
    system = "You are a careful assistant. " * 40  # a shared prefix of several blocks

    def messages(salt, text):
        body = {"model": "m", "max_tokens": 2, "system": system, "messages": [{"role": "user", "content": text}]}
        if salt is not None:
            body["cache_salt"] = salt
        response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["cache_read_input_tokens"]

    messages("tenant-a", "first")
    assert messages("tenant-a", "second") > 0  # the same salt reuses the prefix
    assert messages("tenant-b", "third") == 0  # another salt guesses nothing
    assert messages(None, "fourth") == 0

    def responses(salt, text):
        body = {"model": "m", "instructions": system, "input": text, "store": False}
        if salt is not None:
            body["cache_salt"] = salt
        response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["input_tokens_details"]["cached_tokens"]

    responses("tenant-c", "first")
    assert responses("tenant-c", "second") > 0
    assert responses("tenant-d", "third") == 0
    bad = httpx.post(f"{server.url}/v1/responses", json={"model": "m", "input": "x", "cache_salt": ""}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


# -- item 24: the small ones ---------------------------------------------------------------------------
def test_generate_help_lists_no_responses_store_flags():
    import subprocess

    generate = subprocess.run([sys.executable, "-m", "musegl_core.cli.main", "generate", "--help"],
                              capture_output=True, text=True, timeout=120)
    assert generate.returncode == 0, generate.stderr
    assert "--responses-store" not in generate.stdout and "plugin cuda" in generate.stdout
    serve = subprocess.run([sys.executable, "-m", "musegl_core.cli.main", "serve", "--help"],
                           capture_output=True, text=True, timeout=120)
    assert "--responses-store" in serve.stdout


def test_anthropic_text_blocks_carry_no_raw_special_tokens(server):
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "special please"}]}
    reply = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    text = "".join(block.get("text", "") for block in reply.json()["content"])
    assert text == "ab", text  # "a<|reserved_special_token_5|>b" before
