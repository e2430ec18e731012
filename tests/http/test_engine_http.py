"""The batching engine through the HTTP API: sessions and prefix reuse, slots,
admission, cancellation, the leak test, seeds and the context budget."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import threading
import time

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import metric, running_server, wait_idle
from tests.support.chat_calls import chat

HISTORY = [{"role": "system", "content": "S."}, {"role": "user", "content": "tell me " * 40}]


@pytest.fixture(scope="module")
def tiny():
    from musegl_core.tiny import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module")
def server(tiny):
    config = ServeConfig(model=tiny, port=0, max_context=512, max_sessions=8, max_inflight_requests=3,
                         max_decode_sequences=3)
    with running_server(config) as running:
        yield running


def test_extending_a_named_session_executes_only_the_suffix(server):
    first = chat(server.url, HISTORY, session_id="sess-a").json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reply = first["choices"][0]["message"]["content"]
    longer = HISTORY + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and more"}]
    second = chat(server.url, longer, session_id="sess-a").json()
    prompt1 = first["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt1 <= cached < second["usage"]["prompt_tokens"]
    # The header names the same session.
    reply2 = second["choices"][0]["message"]["content"]
    longest = longer + [{"role": "assistant", "content": reply2}, {"role": "user", "content": "x"}]
    third = chat(server.url, longest, headers={"X-Session-Id": "sess-a"}).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= second["usage"]["prompt_tokens"]


@pytest.mark.parametrize("key", ["claude-code header", "codex header", "prompt_cache_key"])
def test_an_agent_client_key_names_a_soft_session(server, key):
    """Without a session_id, Claude Code's and Codex's conversation keys name a soft session:
    turn 2 of the resent conversation executes only its suffix."""
    conversation = f"conv-{key.replace(' ', '-')}"
    extra = {
        "claude-code header": {"headers": {"X-Claude-Code-Session-Id": conversation}},
        "codex header": {"headers": {"session-id": conversation, "thread-id": conversation}},
        "prompt_cache_key": {"prompt_cache_key": conversation},
    }[key]
    history = [{"role": "system", "content": "S."}, {"role": "user", "content": f"{key}: " + "ask me " * 30}]
    first = chat(server.url, history, **extra).json()
    reply = first["choices"][0]["message"]["content"]
    longer = history + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and more"}]
    second = chat(server.url, longer, **extra).json()
    prompt1, cached = first["usage"]["prompt_tokens"], second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt1 <= cached < second["usage"]["prompt_tokens"]
    # The same turn without the key reuses only whole prefix-cache blocks of the first turn's prompt.
    again = chat(server.url, longer).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] < cached


def test_a_bad_prompt_cache_key_is_400(server):
    response = chat(server.url, HISTORY, prompt_cache_key="")
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_cache_key"


def test_equal_and_shorter_histories_replay_at_least_one_position(server):
    a = chat(server.url, HISTORY, session_id="sess-b").json()
    again = chat(server.url, HISTORY, session_id="sess-b").json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == a["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    shorter = chat(server.url, HISTORY[:1] + [{"role": "user", "content": "tell me"}], session_id="sess-b").json()
    assert shorter["usage"]["prompt_tokens_details"]["cached_tokens"] < shorter["usage"]["prompt_tokens"]
    # An edited earlier message invalidates everything after the edit.
    edited = [{"role": "system", "content": "T."}] + HISTORY[1:]
    out = chat(server.url, edited, session_id="sess-b").json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] < 20


def test_reuse_gives_the_same_tokens_as_a_fresh_run(server):
    messages = HISTORY + [{"role": "user", "content": "same?"}]
    fresh = chat(server.url, messages, max_tokens=8).json()
    chat(server.url, HISTORY, session_id="sess-c")
    reused = chat(server.url, messages, session_id="sess-c", max_tokens=8).json()
    assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert reused["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def one_slot(tiny):
    config = ServeConfig(model=tiny, port=0, max_context=256, max_sessions=1, max_inflight_requests=2,
                         max_queued_requests=1)
    with running_server(config) as running:
        yield running


def test_no_free_slot_is_503_session_capacity(one_slot):
    short = [{"role": "user", "content": "hi"}]
    assert chat(one_slot.url, short, session_id="resident").status_code == 200
    r = chat(one_slot.url, short, session_id="newcomer")  # a new named session: no slot, no eviction
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "session_capacity"
    assert "DELETE /v1/sessions/{id}" in r.json()["error"]["message"]
    assert "retry-after" not in r.headers  # the slot never frees on its own: no time to promise
    # anonymous work always finds room: the idle named session gives way (issue 47 item 11)
    assert chat(one_slot.url, short).status_code == 200
    assert chat(one_slot.url, short, session_id="resident").status_code == 200


def test_a_full_queue_is_503_server_busy_with_a_retry_after(one_slot):
    assert httpx.delete(f"{one_slot.url}/v1/sessions/resident", timeout=30).status_code in (200, 404)
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 150, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[client.post(f"{one_slot.url}/v1/chat/completions", json=body)
                                          for _ in range(3)])

    # One slot: one request runs, one waits for its slot (--max-queued-requests 1), the third is refused.
    responses = asyncio.run(burst())
    assert sorted(r.status_code for r in responses) == [200, 200, 503]
    (busy,) = [r for r in responses if r.status_code == 503]
    assert busy.json()["error"]["code"] == "server_busy"
    assert int(busy.headers["retry-after"]) >= 1
    assert metric(one_slot.url, "musegl_requests_refused_queue_full") == 1


def test_context_budget_is_checked_before_generation(server):
    r = chat(server.url, [{"role": "user", "content": "word " * 600}], max_tokens=8)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "512" in error["message"]


@pytest.fixture(scope="module")
def evicting(tiny):
    config = ServeConfig(model=tiny, port=0, max_context=256, max_sessions=1, max_inflight_requests=2,
                         evict_idle_sessions=True)
    with running_server(config) as running:
        yield running


def test_idle_sessions_are_evicted_lru_and_recreated(evicting):
    short = [{"role": "user", "content": "hi"}]
    assert chat(evicting.url, short, session_id="one").status_code == 200
    assert chat(evicting.url, short, session_id="two").status_code == 200  # evicts "one"
    assert metric(evicting.url, "musegl_sessions_evicted") >= 1
    hits = metric(evicting.url, "musegl_prefix_cache_hits")
    back = chat(evicting.url, short, session_id="one").json()  # recreated from its full history
    # Its transcript is gone; only whole blocks come back, through the prefix cache.
    cached = back["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0 and cached < back["usage"]["prompt_tokens"] - 1
    assert metric(evicting.url, "musegl_prefix_cache_hits") == hits + 1
    # Anonymous requests may evict idle named sessions too, and give the slot back afterwards.
    assert chat(evicting.url, short).status_code == 200
    assert metric(evicting.url, "musegl_sessions_anonymous") == 0


def test_a_busy_session_slot_is_never_evicted(evicting):
    long_body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 150,
                 "ignore_eos": True, "session_id": "busy"}
    done = {}

    def run_long():
        done["r"] = httpx.post(f"{evicting.url}/v1/chat/completions", json=long_body, timeout=120)

    thread = threading.Thread(target=run_long)
    thread.start()
    deadline = time.monotonic() + 30
    while metric(evicting.url, "musegl_requests_running") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    evicted = metric(evicting.url, "musegl_sessions_evicted")
    # The only slot is busy: the new session waits in the queue (holding nothing) until the
    # running request ends, then evicts the now idle session.
    r = chat(evicting.url, [{"role": "user", "content": "hi"}], session_id="other")
    assert r.status_code == 200
    assert "r" in done and done["r"].status_code == 200  # the busy session finished first, unharmed
    thread.join()
    assert metric(evicting.url, "musegl_sessions_evicted") == evicted + 1


@pytest.fixture(scope="module")
def wide(tiny):
    config = ServeConfig(model=tiny, port=0, max_context=256, max_sessions=256, max_inflight_requests=256,
                         max_decode_sequences=16, max_prefill_chunk=256)
    with running_server(config) as running:
        yield running


def test_requests_beyond_the_inflight_limit_queue_and_all_succeed(server):
    wait_idle(server.url)
    waited = metric(server.url, "musegl_request_queue_seconds_sum")
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 48, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[client.post(f"{server.url}/v1/chat/completions", json=body) for _ in range(8)])

    responses = asyncio.run(burst())  # 8 requests, 3 running places (--max-inflight-requests 3)
    assert [r.status_code for r in responses] == [200] * 8
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in responses)
    assert metric(server.url, "musegl_request_queue_seconds_sum") > waited  # some waited, and it shows


def test_disconnect_cancels_within_a_step(server):
    wait_idle(server.url)
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(f"{server.url}/v1/chat/completions", json=body)
    wait_idle(server.url, timeout=5)


def test_same_seed_same_tokens_whatever_the_batch(server):
    wait_idle(server.url)
    body = {"model": "m", "messages": [{"role": "user", "content": "seeded"}], "max_tokens": 12,
            "temperature": 1.0, "seed": 1234}
    alone = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    noise = {"model": "m", "messages": [{"role": "user", "content": "noise " * 30}], "max_tokens": 30,
             "temperature": 1.0, "ignore_eos": True}

    async def together():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                client.post(f"{server.url}/v1/chat/completions", json=noise),
                client.post(f"{server.url}/v1/chat/completions", json=body),
            )

    batched = asyncio.run(together())[1].json()
    assert batched["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_200_streams_cancelled_at_random_points_leak_nothing(wide):
    url = wide.url
    wait_idle(url)
    baseline = (metric(url, "musegl_kv_blocks_used"), metric(url, "musegl_kv_blocks_reserved"))
    rng = random.Random(7)
    plans = [rng.choice(["finish", "before-headers", "after-chunks"]) for _ in range(200)]

    async def one(client: httpx.AsyncClient, i: int, plan: str):
        body = {"model": "m", "messages": [{"role": "user", "content": f"stream {i} " + "x " * rng.randint(1, 60)}],
                "max_tokens": 24, "ignore_eos": True, "stream": True}
        if plan == "before-headers":
            try:
                await asyncio.wait_for(client.post(f"{url}/v1/chat/completions", json=body), rng.uniform(0.01, 0.5))
            except asyncio.TimeoutError:
                pass
            return
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            stop_after = rng.randint(1, 20) if plan == "after-chunks" else None
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if stop_after is not None and seen >= stop_after:
                        return  # leaving the context closes the connection

    async def run_all():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            await asyncio.gather(*[one(client, i, p) for i, p in enumerate(plans)])

    asyncio.run(run_all())
    wait_idle(url, timeout=120)
    assert (metric(url, "musegl_kv_blocks_used"), metric(url, "musegl_kv_blocks_reserved")) == baseline
    # The finished streams' full blocks stay in the pool as cached-free blocks, counted apart.
    assert metric(url, "musegl_kv_blocks_cached") > 0
    assert metric(url, "musegl_sessions_anonymous") == 0


def test_an_interrupted_turn_makes_the_session_replay_once(server):
    wait_idle(server.url)
    assert chat(server.url, HISTORY, session_id="dirty").status_code == 200
    body = {"model": "m", "messages": HISTORY, "max_tokens": 240, "ignore_eos": True, "session_id": "dirty"}
    with httpx.Client(timeout=0.5) as client:
        try:
            r = client.post(f"{server.url}/v1/chat/completions", json=body)
            pytest.fail(f"expected a timeout, got {r.status_code} {r.text[:300]}")
        except httpx.ReadTimeout:
            pass
    wait_idle(server.url, timeout=5)
    replayed = chat(server.url, HISTORY, session_id="dirty").json()
    # Dirty: its own transcript is not trusted; only whole keyed blocks come back (prefix cache).
    cached = replayed["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0 and cached < replayed["usage"]["prompt_tokens"] - 1
    again = chat(server.url, HISTORY, session_id="dirty").json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1


def test_a_generation_request_logs_one_summary_line_with_its_figures(server, caplog):
    wait_idle(server.url)
    with caplog.at_level(logging.INFO, logger="musegl.http"):
        r = chat(server.url, [{"role": "user", "content": "summary"}], headers={"X-Request-Id": "gen-42"},
                 max_tokens=5, ignore_eos=True)
        assert r.status_code == 200 and r.headers["x-request-id"] == "gen-42"
        # the middleware logs once the application has returned, which can be just after the
        # client has read the whole answer: wait for the line (a loaded CI machine lost the race)
        deadline = time.monotonic() + 10
        while not any("gen-42" in rec.getMessage() for rec in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.02)
    usage = r.json()["usage"]
    (line,) = [rec.getMessage() for rec in caplog.records if "gen-42" in rec.getMessage()]
    assert line.startswith(f"request gen-42 POST /v1/chat/completions 200 prompt={usage['prompt_tokens']} "
                           f"cached={usage['prompt_tokens_details']['cached_tokens']} completion=5 queue=")
    assert re.search(r" ttft=\d+\.\d{3}s total=\d+\.\d{3}s$", line)
