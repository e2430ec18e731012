"""Why a prefix missed (issue 45 item 6): each cause, from real requests on a real server (the scripted
model), named on the X-Prefix-Cache-Miss header, the summary line and musegl_prefix_cache_miss_total."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server, scripted_plugin_env
from musegl_core.tiny import default_model_path

SYSTEM = "You are a careful assistant. " * 12  # several KV blocks before anything differs
SCRIPT = [
    {"when": "Think", "reply": " to=self<|message|>Let me think.<|eom|><|start|>assistant to=user<|message|>Done.<|eot|>"},
    {"when": "", "reply": " to=user<|message|>ok<|eot|>"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with scripted_plugin_env(tmp_path_factory.mktemp("miss"), SCRIPT):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", max_context=2048,
                             max_sessions=2)
        with running_server(config) as running:
            yield running


def chat(server, messages, headers=None, **extra) -> httpx.Response:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, headers=headers or {},
                          json={"model": "m", "max_tokens": 16, "messages": messages, **extra})
    assert response.status_code == 200, response.text
    return response


def miss(response: httpx.Response) -> dict | None:
    value = response.headers.get("x-prefix-cache-miss")
    return None if value is None else json.loads(value)


def counter(server, cause: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(re.search(rf'^musegl_prefix_cache_miss_total{{cause="{cause}"}} (\S+)$', text, re.M).group(1))


def test_a_client_nonce_in_the_system_prompt(server):
    def ask(nonce: str) -> httpx.Response:
        return chat(server, [{"role": "system", "content": SYSTEM + f"Request id: {nonce}. " + SYSTEM},
                             {"role": "user", "content": "Hello"}])
    before = counter(server, "nonce")
    assert miss(ask("3f9a0c1d")) is None
    found = miss(ask("b71e22aa"))
    assert found is not None and found["cause"] == "nonce", found
    assert "Request id:" in found["before"] and "3f9a0c1d"[-4:] in found["held_text"]
    assert "b71e22aa"[-4:] in found["prompt_text"] and found["held"] > found["reused"]
    assert counter(server, "nonce") == before + 1
    # a stream carries it too: its headers go out once the worker admitted the request
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [
        {"role": "system", "content": SYSTEM + "Request id: 55aa01ee. " + SYSTEM}, {"role": "user", "content": "Hello"}]}
    for path, extra in (("/v1/chat/completions", {}), ("/v1/messages", {})):
        with httpx.stream("POST", f"{server.url}{path}", json={**body, **extra}, timeout=60) as response:
            assert response.status_code == 200
            found = miss(response)
            response.read()
        assert found is not None and found["cause"] == "nonce", (path, found)
        body["messages"][0]["content"] = SYSTEM + "Request id: 77bb02ff. " + SYSTEM


def test_a_session_whose_history_was_edited_or_whose_reasoning_was_dropped(server):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Think about cats"}]
    answer = chat(server, first, {"X-Session-Id": "edit-me"}).json()["choices"][0]["message"]
    assert answer["reasoning_content"] == "Let me think."
    turn = {"role": "assistant", "content": answer["content"], "reasoning_content": answer["reasoning_content"]}
    follow = {"role": "user", "content": "And dogs?"}
    assert miss(chat(server, [*first, turn, follow], {"X-Session-Id": "edit-me"})) is None  # extends its history
    edited = [first[0], {"role": "user", "content": "Think about owls"}, turn, follow]
    found = miss(chat(server, edited, {"X-Session-Id": "edit-me"}))
    assert found["cause"] == "history_edited" and "owls" in found["prompt_text"], found
    chat(server, [*first, turn, follow], {"X-Session-Id": "drop-it"})
    no_reasoning = [*first, {"role": "assistant", "content": answer["content"]}, follow, turn, follow]
    found = miss(chat(server, no_reasoning, {"X-Session-Id": "drop-it"}))
    assert found["cause"] == "reasoning", found
    for name in ("edit-me", "drop-it"):
        assert httpx.delete(f"{server.url}/v1/sessions/{name}").status_code == 200


def test_a_template_variable_and_a_salt(server):
    messages = [{"role": "user", "content": SYSTEM + "Hello there"}]
    chat(server, messages, chat_template_kwargs={"current_date": "2026-12-06"})
    found = miss(chat(server, messages, chat_template_kwargs={"current_date": "2026-12-07"}))
    assert found["cause"] == "template" and found["before"].endswith("date: 2026-12-0"), found
    chat(server, messages, cache_salt="tenant-a", chat_template_kwargs={"current_date": "2026-12-08"})
    found = miss(chat(server, messages, cache_salt="tenant-b", chat_template_kwargs={"current_date": "2026-12-08"}))
    assert found["cause"] == "salt", found


def test_a_soft_session_evicted_while_its_blocks_stay_cached_is_no_miss(server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello evicted"}]
    headers = {"X-Claude-Code-Session-Id": "soft-one"}
    chat(server, messages, headers)
    for other in ("a", "b", "c"):  # two slots: the soft session gives way
        chat(server, [{"role": "user", "content": f"Unrelated {other} " * 40}], {"X-Claude-Code-Session-Id": other})
    again = chat(server, messages, headers)
    assert miss(again) is None  # the prefix cache still held its blocks: all reused
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
