"""``cache_salt`` through the HTTP API: the prefix cache (and snapshots) are no
cross-user oracle for requests that carry a salt, named sessions keep their
salt, and a bad salt is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server

SECRET = [{"role": "user", "content": "my account number is 4417 1234 5678 9113 " * 6}]
GUESS = [{"role": "user", "content": "my account number is 0000 0000 0000 0000 " * 6}]


@pytest.fixture(scope="module")
def server():
    from musegl_core.tiny import default_model_path

    # Snapshots on as well: they are a second way to reuse another request's KV.
    config = ServeConfig(model=str(default_model_path()), port=0, max_context=512, max_sessions=4,
                         max_inflight_requests=2, prefix_cache_entries=2)
    with running_server(config) as running:
        yield running


def post(server, messages, path="/v1/chat/completions", **extra) -> httpx.Response:
    body = {"model": "m", "max_tokens": 2, "temperature": 0, **extra}
    body["messages" if path.endswith("chat/completions") else "prompt"] = messages
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_salt_cannot_tell_a_right_guess_from_a_wrong_one(server):
    victim = post(server, SECRET, cache_salt="alice")
    prompt = victim.json()["usage"]["prompt_tokens"]
    assert cached(victim) == 0 and prompt > 64
    # Another salt's space holds nothing: the exact prompt reuses as little as a wrong guess.
    assert cached(post(server, SECRET, cache_salt="mallory")) == 0
    assert cached(post(server, GUESS, cache_salt="mallory-2")) == 0
    # Nor does the unsalted space: at most the chat template's head, which every prompt shares.
    assert cached(post(server, SECRET)) < 32
    # The same salt shares: the victim's next identical request reuses its KV.
    assert cached(post(server, SECRET, cache_salt="alice")) >= prompt - 16


def test_completions_honour_the_salt_too(server):
    prompt = "a raw prompt that only bob has sent so far " * 6
    path = "/v1/completions"
    assert cached(post(server, prompt, path=path, cache_salt="bob")) == 0
    assert cached(post(server, prompt, path=path, cache_salt="eve")) == 0
    assert cached(post(server, prompt, path=path)) == 0
    assert cached(post(server, prompt, path=path, cache_salt="bob")) > 32


def test_a_named_session_keeps_its_salt(server):
    first = post(server, SECRET, cache_salt="carol", session_id="salted")
    assert cached(first) < 32
    for other in ({"cache_salt": "dave"}, {}):
        refused = post(server, SECRET, session_id="salted", **other)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("cache_salt_mismatch", "cache_salt")
    again = post(server, SECRET, cache_salt="carol", session_id="salted")  # the session is unharmed
    assert cached(again) == first.json()["usage"]["prompt_tokens"] - 1
    assert httpx.delete(f"{server.url}/v1/sessions/salted", timeout=30).status_code in (200, 204)
    assert post(server, SECRET, cache_salt="dave", session_id="salted").status_code == 200  # a new session


def test_a_null_salt_is_the_unsalted_space(server):
    assert post(server, SECRET, cache_salt=None).status_code == 200
    assert post(server, "x" * 10, path="/v1/completions", cache_salt="x" * 256).status_code == 200
