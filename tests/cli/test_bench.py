"""``musegl bench`` against the in-process server on the tiny checkpoint.

Small numbers only: these tests check the report's structure and that its
counts add up, never timings.
"""

from __future__ import annotations

import json

import pytest

import musegl_core.tiny
from musegl_core.bench import BenchConfig, run_bench
from musegl_core.bench.report import percentile
from musegl_core.bench.workloads import Conversation, chat_prompt, filler_text
from musegl_core.cli.main import main as cli_main
from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server():
    config = ServeConfig(
        model=str(musegl_core.tiny.default_model_path()), demo=True, port=0, max_context=16384,
        tool_parser="atem",  # the --api replays send tools
        max_sessions=4, max_inflight_requests=4, max_decode_sequences=4,
        prefix_caching=False,  # only sessions reuse KV, so the reports' cached counts are exact
    )
    with running_server(config) as running:
        yield running


def test_filler_is_deterministic_and_distinct():
    assert filler_text(3, "chat", 1, words=40) == filler_text(3, "chat", 1, words=40)
    assert filler_text(3, "chat", 1, words=40) != filler_text(3, "chat", 2, words=40)
    assert filler_text(3, "chat", 1, words=40) != filler_text(4, "chat", 1, words=40)
    assert len(filler_text(0, "x", words=50).split()) == 50 + 1  # "Request x:" label + 49 words
    assert chat_prompt(0, 5, words=10).messages[0]["role"] == "user"


def test_conversation_grows_by_reply_and_user_turn():
    conversation = Conversation(0, "s", seed=1, turn_words=20)
    first = conversation.next_user_turn()
    assert [m["role"] for m in first] == ["system", "user"]
    conversation.record_reply("answer", "")
    second = conversation.next_user_turn()
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[:2] == first and second[2] == {"role": "assistant", "content": "answer"}
    assert second[3]["content"] != first[1]["content"]


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_chat_report_counts_add_up(server):
    config = BenchConfig(url=server.url, workload="chat", concurrency=3, requests=5,
                         max_tokens=MAX_TOKENS, prompt_tokens=120, timeout=120)
    report = run_bench(config, progress=False)
    assert (report.requests, report.succeeded, report.errors) == (5, 5, 0)
    assert report.error_kinds == {}
    assert report.output_tokens == 5 * MAX_TOKENS  # ignore_eos: exactly max_tokens each
    assert report.ttft.count == 5 and report.latency.count == 5
    assert report.ttft.p50 is not None and report.ttft.p50 <= report.ttft.p95
    assert report.itl.count > 0
    assert report.cached_tokens == 0 and report.cached_ratio == 0.0
    assert report.tokens_per_word > 0 and report.prompt_overhead >= 0
    assert 60 <= report.prompt_tokens / 5 <= 240  # about --prompt-tokens, after calibration
    assert report.requests_per_s > 0 and report.output_tokens_per_s > 0
    assert report.turns == () and report.sessions is None
    spec = report.speculation  # from /metrics: no speculator here, so no drafts
    assert spec is not None and spec.drafted_tokens == spec.verify_blocks == 0 and spec.acceptance_length is None
    assert spec.target_steps >= MAX_TOKENS  # batched decoding shares steps between the 3 clients
    assert spec.tokens_per_target_step == round(report.output_tokens / spec.target_steps, 3)


def test_agent_report_turns_and_baseline(server):
    config = BenchConfig(url=server.url, workload="agent", concurrency=2, conversations=2, turns=3,
                         max_tokens=MAX_TOKENS, prompt_tokens=40, timeout=120)
    report = run_bench(config, progress=False)
    assert (report.requests, report.succeeded, report.errors) == (6, 6, 0)
    assert [t.turn for t in report.turns] == [1, 2, 3]
    assert all(t.requests == 2 for t in report.turns)
    assert sum(t.prompt_tokens for t in report.turns) == report.prompt_tokens
    assert sum(t.cached_tokens for t in report.turns) == report.cached_tokens
    assert report.turns[0].cached_tokens == 0  # a new session has nothing to reuse
    assert report.turns[1].prompt_tokens > report.turns[0].prompt_tokens  # the history grows
    assert report.cached_tokens > 0  # later turns extend their session
    comparison = report.sessions
    assert comparison is not None and comparison.turn == 3
    assert comparison.session_ttft.count == 2 and comparison.anonymous_ttft.count == 2
    assert comparison.anonymous_cached_tokens == 0  # no session, no snapshots: full prefill
    assert comparison.ratio is not None and comparison.ratio > 0


def test_cli_json(server, capsys):
    rc = cli_main(["bench", "--url", server.url, "--requests", "2", "--concurrency", "2",
                   "--max-tokens", "3", "--prompt-tokens", "80", "--json", "--no-progress"])
    assert rc == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["workload"] == "chat" and payload["requests"] == 2 and payload["errors"] == 0
    assert payload["output_tokens"] == 6
    assert set(payload["ttft"]) == {"count", "p50", "p95", "p99", "mean"}


def test_cli_reports_unreachable_server(capsys):
    rc = cli_main(["bench", "--url", "http://127.0.0.1:9", "--requests", "1", "--no-progress", "--timeout", "5"])
    assert rc == 1
    assert "calibration request" in capsys.readouterr().err


def test_cli_rejects_bad_values(capsys):
    assert cli_main(["bench", "--concurrency", "0"]) == 2
    assert "concurrency" in capsys.readouterr().err


def test_speculation_figures_from_counter_deltas():
    from musegl_core.bench.report import build_report
    from musegl_core.bench.client import RequestResult

    results = [RequestResult("chat", output_tokens=30, ttft=0.1, latency=1.0)]
    before = {"engine_steps": 100, "spec_drafted_tokens": 40, "spec_accepted_tokens": 10, "spec_verify_blocks": 10}
    after = {"engine_steps": 110, "spec_drafted_tokens": 80, "spec_accepted_tokens": 30, "spec_verify_blocks": 20}
    report = build_report(results, url="u", workload="chat", concurrency=1, max_tokens=30, tokens_per_word=1.0,
                          prompt_overhead=0, duration_s=1.0, counters=(before, after))
    spec = report.speculation
    assert (spec.target_steps, spec.drafted_tokens, spec.accepted_tokens, spec.verify_blocks) == (10, 40, 20, 10)
    assert spec.acceptance_length == 3.0 and spec.tokens_per_target_step == 3.0


def bench_sessions(url: str) -> list[str]:
    import httpx

    listed = httpx.get(f"{url}/v1/sessions", timeout=30).json()["data"]
    return [s["id"] for s in listed if s["id"].startswith("bench-")]


def test_agent_runs_delete_their_sessions_so_the_next_run_succeeds(server):
    config = BenchConfig(url=server.url, workload="agent", concurrency=3, conversations=3, turns=2,
                         max_tokens=MAX_TOKENS, prompt_tokens=40, timeout=120)
    for _ in range(2):  # 3 sessions + 3 anonymous baselines fit 4 slots only if the sessions go
        report = run_bench(config, progress=False)
        assert (report.errors, report.sessions_deleted, report.sessions_left) == (0, 3, {})
        assert report.sessions is not None and report.sessions.anonymous_ttft.count == 3
        assert bench_sessions(server.url) == []


def test_the_report_names_the_limit_that_refused(server):
    config = BenchConfig(url=server.url, workload="agent", concurrency=6, conversations=6, turns=1,
                         max_tokens=MAX_TOKENS, prompt_tokens=40, timeout=120, baseline=False)
    report = run_bench(config, progress=False)  # 6 new sessions, 4 slots (--max-sessions 4)
    assert report.succeeded == 4 and report.error_kinds == {"HTTP 503 session_capacity": 2}
    assert "--max-sessions" in report.error_messages["HTTP 503 session_capacity"]
    assert report.sessions_deleted == 4 and bench_sessions(server.url) == []


def test_an_interrupted_agent_run_deletes_its_sessions(server):
    import asyncio

    import httpx

    from musegl_core.bench.runner import run_bench_async

    config = BenchConfig(url=server.url, workload="agent", concurrency=2, conversations=2, turns=50,
                         max_tokens=40, prompt_tokens=40, timeout=120)

    async def interrupt() -> None:
        task = asyncio.create_task(run_bench_async(config, progress=False))
        async with httpx.AsyncClient(timeout=30) as client:
            while not task.done():
                listed = (await client.get(f"{server.url}/v1/sessions")).json()["data"]
                if any(s["id"].startswith("bench-") for s in listed):
                    break
                await asyncio.sleep(0.05)
        task.cancel()  # what Ctrl-C does to asyncio.run's main task
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupt())
    assert bench_sessions(server.url) == []


def test_cli_without_httpx_says_how_to_install_it(monkeypatch, capsys):
    import sys

    for name in [name for name in sys.modules if name == "musegl_core.bench" or name.startswith("musegl_core.bench.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "httpx", None)  # `import httpx` now fails as if it were not installed
    assert cli_main(["bench", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("musegl bench: error: ") and "pip install 'musegl[bench]'" in err
    assert len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as help_exit:  # --help needs no httpx
        cli_main(["bench", "--help"])
    assert help_exit.value.code == 0


# -- --api messages|responses: the agent conversation as Claude Code and Codex CLI send it ---------


def replay_config(server, api: str, **overrides) -> BenchConfig:
    options = dict(url=server.url, workload="agent", api=api, turns=3, system_tokens=150, prompt_tokens=30,
                   max_tokens=MAX_TOKENS, timeout=120)
    return BenchConfig(**(options | overrides))


def run_recording(config: BenchConfig) -> tuple[object, list[tuple[str, dict, dict]]]:
    """Run ``config`` and return the report and every generation request sent (url, headers, body)."""
    import asyncio

    from musegl_core.bench.runner import run_bench_async

    sent: list[tuple[str, dict, dict]] = []

    async def record(request) -> None:
        if request.method == "POST" and request.url.path != "/v1/chat/completions" or b"session_id" in request.content:
            sent.append((str(request.url), dict(request.headers), json.loads(request.content)))

    report = asyncio.run(run_bench_async(config, progress=False, event_hooks={"request": [record]}))
    return report, sent


def soft_and_bench_sessions(url: str) -> list[str]:
    import httpx

    listed = httpx.get(f"{url}/v1/sessions", timeout=30).json()["data"]
    return [s["id"] for s in listed if s["id"].startswith(("bench-", "claude-code:", "codex:"))]


def check_summary_adds_up(report, api: str) -> None:
    assert report.error_messages == {} and (report.errors, report.api, report.workload) == (0, api, "agent")
    replay = report.replay
    cli, reference = replay.cli, replay.reference
    assert [t.turn for t in cli.turns] == [t.turn for t in reference.turns] == [1, 2, 3]
    assert sum(t.prompt_tokens for t in cli.turns) == report.prompt_tokens  # the CLI's turns are the measured ones
    assert report.requests == 3 and report.turns == cli.turns
    first, later = cli.turns[0], cli.turns[1:]
    assert cli.first_turn_ttft == first.ttft.mean
    assert cli.later_ttft == pytest.approx(sum(t.ttft.mean for t in later) / 2)
    assert cli.ttft_ratio == pytest.approx(cli.later_ttft / cli.first_turn_ttft)
    share = sum(t.cached_tokens for t in later) / sum(t.prompt_tokens for t in later)
    assert cli.later_cached_share == pytest.approx(share)
    assert cli.min_cached_share == pytest.approx(min(t.cached_tokens / t.prompt_tokens for t in later))
    # the soft session keeps turn 1: turn 2 reuses at least its whole prompt (no prefix cache on this server)
    assert first.cached_tokens == 0 and cli.turns[1].cached_tokens >= first.prompt_tokens
    assert reference.turns[1].cached_tokens >= reference.turns[0].prompt_tokens  # the named chat session too
    # paired over the same turns, so the ratio of sums is the ratio of the means
    assert replay.front_overhead == pytest.approx(cli.later_ttft / reference.later_ttft - 1)
    assert replay.front_overhead_s == pytest.approx(cli.later_ttft - reference.later_ttft)
    assert replay.first_turn_overhead == pytest.approx(cli.first_turn_ttft / reference.first_turn_ttft - 1)
    assert replay.meets == {"ttft_ratio": cli.ttft_ratio <= 0.2, "cached_share": share >= 0.9,
                            "front_overhead": replay.front_overhead <= 0.05}
    assert cli.first_request_bytes > 0 and reference.first_request_bytes > 0
    assert report.sessions_deleted == 2 and report.sessions_left == {}  # the soft session and the named one


def check_full_history(bodies: list[dict], key: str) -> None:
    for earlier, later in zip(bodies, bodies[1:]):
        assert later[key][: len(earlier[key])] == earlier[key]  # everything sent before is sent again
        assert len(later[key]) >= len(earlier[key]) + 2  # the answer, then a user message or tool results


def test_messages_replay_sends_what_claude_code_sends(server):
    report, sent = run_recording(replay_config(server, "messages"))
    cli = [(h, b) for url, h, b in sent if "/v1/messages" in url]
    chat = [b for url, _h, b in sent if url.endswith("/v1/chat/completions")]
    assert [url for url, _h, _b in sent if "/v1/messages" in url] == [f"{server.url}/v1/messages?beta=true"] * 3
    assert len(chat) == 3 and len({b["session_id"] for b in chat}) == 1
    session_ids = {h["x-claude-code-session-id"] for h, _b in cli}
    assert len(session_ids) == 1 and all(h["anthropic-version"] == "2023-06-01" for h, _b in cli)
    billing = [b["system"][0]["text"] for _h, b in cli]
    assert all(t.startswith("x-anthropic-billing-header: cc_version=") and "cc_entrypoint=cli;" in t for t in billing)
    nonces = [t.split("cch=")[1] for t in billing]
    assert len(set(nonces)) == 3  # a new cch on every request
    bodies = [b for _h, b in cli]
    assert all(b["stream"] is True and b["system"][1] == bodies[0]["system"][1] for b in bodies)
    assert {"Write", "Read", "Edit", "Bash"} <= {t["name"] for t in bodies[0]["tools"]}
    assert len(bodies[0]["tools"]) == 10
    check_full_history(bodies, "messages")
    assert [m["role"] for m in bodies[2]["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    check_summary_adds_up(report, "messages")
    assert soft_and_bench_sessions(server.url) == []


def test_responses_replay_sends_what_codex_sends(server):
    report, sent = run_recording(replay_config(server, "responses"))
    cli = [(h, b) for url, h, b in sent if url == f"{server.url}/v1/responses"]
    assert len(cli) == 3 and len([u for u, _h, _b in sent if u.endswith("/v1/chat/completions")]) == 3
    keys = {(h["session-id"], h["thread-id"], b["prompt_cache_key"]) for h, b in cli}
    assert len(keys) == 1 and len(set(next(iter(keys)))) == 1  # one key, the same in all three places
    bodies = [b for _h, b in cli]
    assert all(b["store"] is False and b["stream"] is True and b["instructions"] == bodies[0]["instructions"]
               for b in bodies)
    assert "previous_response_id" not in bodies[2]
    assert "exec_command" in {t["name"] for t in bodies[0]["tools"]}
    assert any(t["type"] == "custom" and t["name"] == "apply_patch" for t in bodies[0]["tools"])
    check_full_history(bodies, "input")
    assistant = [item for item in bodies[2]["input"] if item.get("role") == "assistant"]
    assert assistant and all("id" not in item and "status" not in item for item in assistant)
    check_summary_adds_up(report, "responses")
    assert soft_and_bench_sessions(server.url) == []


def test_a_tool_call_is_answered_with_its_result_and_cch_changes():
    from musegl_core.bench.cli_wire import MessagesConversation, ResponsesConversation, Sizes
    from musegl_core.bench.client import RequestResult

    conversation = MessagesConversation(0, 1, Sizes(20, 5), "http://x", "m", 8)
    _url, _headers, first = conversation.next_request()
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/a"}}
    conversation.record(RequestResult("turn", reply=[{"type": "text", "text": "reading"}, call]))
    _url, _headers, second = conversation.next_request()
    assert second["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "reading"}, call]}
    assert second["messages"][2]["content"][0]["type"] == "tool_result"
    assert second["messages"][2]["content"][0]["tool_use_id"] == "toolu_1"
    assert first["system"][0]["text"] != second["system"][0]["text"]  # the cch nonce
    assert first["system"][1] == second["system"][1]

    codex = ResponsesConversation(0, 1, Sizes(20, 5), "http://x", "m", 8)
    codex.next_request()
    codex.record(RequestResult("turn", reply=[
        {"id": "rs_1", "type": "reasoning", "summary": [], "encrypted_content": "seal", "status": "completed"},
        {"id": "fc_1", "type": "function_call", "name": "exec_command", "call_id": "call_1",
         "arguments": "{}", "status": "completed"}]))
    _url, _headers, body = codex.next_request()
    assert body["input"][-3:] == [
        {"type": "reasoning", "summary": [], "encrypted_content": "seal"},
        {"type": "function_call", "name": "exec_command", "call_id": "call_1", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": body["input"][-1]["output"]}]


def test_replay_options_are_checked(capsys):
    with pytest.raises(ValueError, match="concurrency must be 1"):
        BenchConfig(workload="agent", api="messages", concurrency=2)
    with pytest.raises(ValueError, match="workload must be agent"):
        BenchConfig(workload="chat", api="responses")
    assert cli_main(["bench", "--api", "messages", "--workload", "chat"]) == 2
    assert "--workload agent" in capsys.readouterr().err


def test_each_replayed_conversation_frees_its_sessions_for_the_next(server):
    # 3 conversations of 2 sessions each on 4 slots: kept to the end, the first ones' soft sessions
    # would be evicted (not deleted) and the named chat sessions would crowd the later ones out
    report = run_bench(replay_config(server, "messages", conversations=3, turns=2), progress=False)
    assert report.error_messages == {} and report.errors == 0
    assert report.sessions_deleted == 6 and report.sessions_left == {}
    assert [t.requests for t in report.replay.cli.turns] == [3, 3]
    assert all(r.turns[1].cached_tokens >= r.turns[0].prompt_tokens for r in (report.replay.cli, report.replay.reference))
    assert soft_and_bench_sessions(server.url) == []


def test_agent_shares_a_long_system_prompt_and_sends_tools(server):
    config = BenchConfig(url=server.url, workload="agent", concurrency=2, conversations=2, turns=2,
                         max_tokens=MAX_TOKENS, prompt_tokens=40, timeout=120, baseline=False,
                         shared_system_tokens=600, tools=True)
    report, sent = run_recording(config)
    assert report.errors == 0 and len(sent) == 4
    systems = {body["messages"][0]["content"] for _, _, body in sent}
    assert len(systems) == 1 and len(next(iter(systems)).split()) > 150  # one long prompt, shared
    assert all(len(body["tools"]) == 10 and body["tools"][0]["type"] == "function" for _, _, body in sent)
    first_turns = [t for t in report.turns if t.turn == 1]
    assert first_turns[0].prompt_tokens / 2 >= 600  # each first turn holds the system prompt (and tools)
    with pytest.raises(ValueError, match="agent workload over Chat Completions"):
        BenchConfig(workload="chat", shared_system_tokens=100)


def test_tool_calls_are_answered_before_the_next_user_message():
    conversation = Conversation(0, "s", seed=1, turn_words=10)
    conversation.next_user_turn()
    conversation.record_reply("", "", [{"type": "function", "function": {"name": "Read", "arguments": "{}"}}])
    history = conversation.next_user_turn()
    assert [m["role"] for m in history] == ["system", "user", "assistant", "tool", "user"]
    assert history[3]["tool_call_id"] == history[2]["tool_calls"][0]["id"]


def test_tensor_parallel_size_gives_the_throughput_per_device(capsys):
    from musegl_core.bench.client import RequestResult
    from musegl_core.bench.report import build_report

    results = [RequestResult("chat", output_tokens=40, ttft=0.1, latency=1.0)]
    report = build_report(results, url="u", workload="chat", concurrency=1, max_tokens=40, tokens_per_word=1.0,
                          prompt_overhead=0, duration_s=2.0, tensor_parallel_size=4)
    assert report.output_tokens_per_s == 20.0 and report.output_tokens_per_s_per_device == 5.0
    assert report.to_dict()["tensor_parallel_size"] == 4
    assert cli_main(["bench", "--tensor-parallel-size", "0"]) == 2
    assert "tensor-parallel-size" in capsys.readouterr().err


def test_agent_sessions_with_contexts_of_their_own_subagents_and_interleaved_turns(server):
    """The AgentX shape in small: each conversation opens with a long context of its own, spawns a
    subagent (its own session, its own context) at its turn 2, and with ``interleave`` every
    conversation is open at once; the report's warm turns and sessions held count them all."""
    config = BenchConfig(url=server.url, workload="agent", concurrency=2, conversations=2, turns=3,
                         max_tokens=MAX_TOKENS, prompt_tokens=20, timeout=120, baseline=False,
                         context_tokens=2000, subagents=2, subagent_turns=2, subagent_context_tokens=1000,
                         interleave=True)
    assert config.measured_requests == 2 * 3 + 2 * 2
    report, sent = run_recording(config)
    assert (report.requests, report.errors) == (10, 0)
    order = [body["session_id"] for _, _, body in sent]
    parents = sorted({s for s in order if "-sub" not in s})
    subagents = sorted({s for s in order if "-sub" in s})
    assert len(parents) == 2 and len(subagents) == 2 and order.count(subagents[0]) == 2
    for k, sub in enumerate(subagents):  # spawned by conversation k % 2 once its first turn was answered
        parent = next(p for p in parents if p.endswith(f"-{k % 2}"))
        assert order.index(sub) > order.index(parent)
    first = {body["session_id"]: body for _, _, body in reversed(sent)}  # each session's first request
    parent_words = len(first[parents[0]]["messages"][1]["content"].split())
    sub_words = len(first[subagents[0]]["messages"][1]["content"].split())
    assert parent_words > 1.6 * sub_words > 1.6 * 200  # contexts of 2000 and 1000 tokens (and 20 a turn)
    assert report.turns[0].cached_tokens == 0 and report.turns[0].prompt_tokens >= 2 * 2000 + 2 * 1000
    warm = report.warm
    assert warm is not None and warm.sessions == 4 and warm.warm_turns == 2 * 2 + 2 * 1
    assert warm.ttft.count == warm.warm_turns
    assert warm.sessions_held == 4 and warm.warm_turns_held == warm.warm_turns  # all kept: >= 95 % cached
    with pytest.raises(ValueError, match="agent workload over Chat Completions"):
        BenchConfig(workload="chat", subagents=1)


def test_sessions_held_needs_every_warm_turn_cached():
    from musegl_core.bench.client import RequestResult
    from musegl_core.bench.report import WarmStats

    def turn(conversation: int, number: int, prompt: int, cached: int, error: str | None = None):
        return RequestResult("turn", conversation, number, ttft=0.1 * number, prompt_tokens=prompt,
                             cached_tokens=cached, error=error, latency=1.0, output_tokens=1)

    warm = WarmStats.of([turn(0, 1, 1000, 0), turn(0, 2, 1100, 1050), turn(0, 3, 1200, 1150),
                         turn(1, 1, 1000, 0), turn(1, 2, 1100, 1050), turn(1, 3, 1200, 200),  # re-prefilled
                         turn(2, 1, 1000, 0), turn(2, 2, 1100, 0, error="HTTP 503"),
                         turn(3, 1, 500, 0)])  # no warm turn
    assert (warm.sessions, warm.sessions_held, warm.warm_turns, warm.warm_turns_held) == (4, 1, 5, 3)
    assert warm.ttft.count == 4
