"""Input that used to kill the worker or stall other requests (issue 25, items 1 and 2).

* 10 MiB of one repeated letter made ``tokenizers`` panic (a BaseException)
  inside the worker's preparation: the worker died and every request failed.
  Now it is that request's 400, the worker keeps its pid, other requests go on;
  on ``/tokenize`` (a plain-text 500 before) the text is tokenized in pieces
  (a slow test), and a tokenizer failure is a 400 with the error envelope.
* A request's preparation (a large image decoded and resized) ran on the
  control thread and delayed every other request; now it runs in the
  preparation pool's heavy lane while a small request completes.
"""

from __future__ import annotations

import base64
import io
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server

TEN_MIB = 10 << 20


@pytest.fixture(scope="module")
def server():
    from musegl_core.tiny import default_model_path, demo_mmproj_path

    path = default_model_path()
    config = ServeConfig(model=str(path), demo=True, mmproj=str(demo_mmproj_path(path)), port=0,
                         max_vision_patches=64)
    with running_server(config) as running:
        yield running


def chat(content, max_tokens: int = 2) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def assert_error_envelope(response: httpx.Response, status: int, code: str | None, param: str) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code", "param"}
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] == param
    return error


def test_a_10_mib_run_of_one_letter_fails_alone_and_the_worker_lives(server):
    url = f"{server.url}/v1/chat/completions"
    pid, restarts = server.worker.pid, server.worker.restarts
    with ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(httpx.post, url, json=chat("A" * TEN_MIB), timeout=300)
        time.sleep(0.2)
        normal = pool.submit(httpx.post, url, json=chat("Hello there"), timeout=300)
        hostile, normal = hostile.result(), normal.result()
    error = assert_error_envelope(hostile, 400, "context_length_exceeded", "messages")
    assert "at least" in error["message"]  # refused from its length, before it was tokenized
    assert normal.status_code == 200 and normal.json()["choices"][0]["message"]["content"] is not None
    # A run the length check lets through is tokenized in pieces, and tokenizing stops at the budget.
    shorter = httpx.post(url, json=chat("A" * 200_000), timeout=300)
    assert "at least" in assert_error_envelope(shorter, 400, "context_length_exceeded", "messages")["message"]
    assert httpx.post(url, json=chat("And now?"), timeout=300).status_code == 200
    assert (server.worker.pid, server.worker.restarts) == (pid, restarts)


@pytest.mark.slow  # 10 MiB tokenized in the front and 10 M ids sent back
def test_tokenize_counts_a_10_mib_run_of_one_letter(server):
    response = httpx.post(f"{server.url}/tokenize", json={"prompt": "A" * TEN_MIB}, timeout=300)
    assert response.status_code == 200, response.text[:300]  # a plain-text 500 before
    tokenizer = server.app.state["front"].tokenizer.tokenizer
    assert response.json()["count"] >= TEN_MIB // tokenizer.longest_token_bytes


def test_tokenize_turns_a_tokenizer_failure_into_a_400(server, monkeypatch):
    url = f"{server.url}/tokenize"
    tokenizer = server.app.state["front"].tokenizer.tokenizer

    class Panicking:  # what tokenizers raises on a regex failure: a BaseException, not an Exception
        def encode(self, *args, **kwargs):
            raise type("PanicException", (BaseException,), {})("Onig: Regex search error: retry-limit-in-match over")

        encode_batch = encode

    monkeypatch.setattr(tokenizer, "_plain_tokenizer", Panicking())
    for body, param in (({"prompt": "some text"}, "prompt"),
                        ({"messages": [{"role": "user", "content": "some text"}]}, "messages")):
        error = assert_error_envelope(httpx.post(url, json=body, timeout=60), 400, None, param)
        assert "retry-limit-in-match" in error["message"]
    monkeypatch.undo()
    assert httpx.post(url, json={"prompt": "fine again"}, timeout=60).status_code == 200


def big_png_url(side: int = 8190) -> str:
    """A one-colour PNG of ``side`` x ``side`` pixels (under the 8192 x 8192 cap):
    a few hundred KB that take seconds to decode and resize."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (120, 30, 200)).save(buffer, "PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def gauge(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} is not in /metrics"
    return float(found.group(1))


def test_a_heavy_preparation_does_not_delay_a_small_request(server):
    """Order of events, not wall-clock figures: while the image request is still
    being prepared (the worker says so), a small text request completes."""
    url = f"{server.url}/v1/chat/completions"
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": big_png_url()}}]
    heavy: dict = {}
    thread = threading.Thread(target=lambda: heavy.update(response=httpx.post(url, json=chat(image, 1), timeout=300)))
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while gauge(server, "musegl_requests_preparing_heavy") < 1:
            assert thread.is_alive() and time.monotonic() < deadline, "the image request was never seen preparing"
            time.sleep(0.01)
        small = httpx.post(url, json=chat("Hi", 2), timeout=300)
        assert small.status_code == 200
        # The small request is done; the image request is still being prepared.
        assert gauge(server, "musegl_requests_preparing_heavy") == 1 and thread.is_alive()
    finally:
        thread.join(300)
    assert heavy["response"].status_code == 200, heavy["response"].text[:300]
    assert heavy["response"].json()["usage"]["prompt_tokens"] > 16 + 2  # the image's 16 rows and its markers
