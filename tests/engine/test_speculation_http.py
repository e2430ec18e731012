"""Multi-token commits through the HTTP API: a speculator's drafts change the speed, never the output.

Three servers run the same scenario on the demo checkpoint (torch executor):
without a speculator, with a do-nothing speculator (which records the
sequences it sees), and with a speculator that replays those recordings as
drafts of up to 4 tokens, one of them corrupted at a varying index, so the
target accepts 0..4 drafts per step. Every response must be identical to the
plain server's: greedy and seeded sampling, stops and ``max_tokens`` inside
an accepted block, batches of 8, multi-turn sessions, a cancelled stream
followed by its session's next turn, and a session rewind.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import pytest

from musegl_core.config import ServeConfig
from tests.support.server import running_server, support_plugin_env

K = 4
PROMPTS = [
    [{"role": "user", "content": "Write a few words about the sea."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List three colours " * 5}],
]
SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234}


def chat(url: str, messages, **extra) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    return {"message": data["choices"][0]["message"], "finish": data["choices"][0]["finish_reason"],
            "usage": data["usage"]}


def cancel_stream(url: str, messages, session: str, after: int = 2) -> None:
    """Start a streamed answer on ``session`` and drop the connection after ``after`` chunks."""
    body = {"model": "m", "messages": messages, "max_tokens": 200, "temperature": 0, "stream": True,
            "session_id": session}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen >= after:
                    break


def scenario(url: str, stops: dict) -> dict:
    """Every case, in a fixed order; returns comparable results."""
    out: dict = {}
    for i, messages in enumerate(PROMPTS):
        out[f"greedy{i}"] = chat(url, messages)
        out[f"seeded{i}"] = chat(url, messages, **SEEDED)
        out[f"short{i}"] = chat(url, messages, max_tokens=6)  # ends inside the second block
        if f"stop{i}" not in stops:  # the plain run picks a stop string from the middle of its answer
            text = out[f"greedy{i}"]["message"].get("content") or out[f"greedy{i}"]["message"].get(
                "reasoning_content") or ""
            stops[f"stop{i}"] = text[len(text) // 2: len(text) // 2 + 3] or "zz"
        out[f"stop{i}"] = chat(url, messages, stop=[stops[f"stop{i}"]])

    # Eight at once, each with its own seed: each must equal its own run alone.
    def one(seed: int) -> dict:
        return chat(url, PROMPTS[seed % 2], **{**SEEDED, "seed": seed})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        out["batch8"] = list(pool.map(one, range(8)))
    if "alone" not in stops:  # once (plain server): each of the eight alone
        stops["alone"] = [one(seed) for seed in range(8)]

    # A session over three turns.
    history = list(PROMPTS[0])
    for turn in range(3):
        result = chat(url, history, session_id="multi", max_tokens=12)
        out[f"session{turn}"] = result
        history += [{"role": "assistant", "content": result["message"].get("content") or ""},
                    {"role": "user", "content": f"and then {turn}?"}]

    # A stream cancelled mid-answer; the session's next turn replays from scratch.
    cancel_stream(url, PROMPTS[1], "cancelled")
    out["after_cancel"] = chat(url, PROMPTS[1], session_id="cancelled")

    # A rewind: a longer history, then a shorter one on the same session (seeded).
    longer = PROMPTS[0] + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
    chat(url, longer, session_id="rewind", **SEEDED)
    out["rewound"] = chat(url, PROMPTS[0], session_id="rewind", **SEEDED)
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(rf"^musegl_{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    tmp = tmp_path_factory.mktemp("drafts")
    config = ServeConfig(model=str(default_model_path()), executor="torch-cpu", port=0, max_context=1024,
                         max_sessions=12, max_inflight_requests=8, max_decode_sequences=8)
    stops: dict = {}
    results, figures = {}, {}
    with running_server(config) as server:
        results["plain"] = scenario(server.url, stops)
    record = tmp / "record.jsonl"
    with support_plugin_env(tmp, "drafts", "musegl_drafts", {"MUSEGL_DRAFTS": f"record:{record}"}):
        with running_server(config) as server:
            results["nothing"] = scenario(server.url, stops)
            figures["nothing"] = (metric(server.url, "spec_drafted_tokens"), metric(server.url, "engine_steps"))
    with support_plugin_env(tmp, "drafts", "musegl_drafts", {"MUSEGL_DRAFTS": f"replay:{record}:{K}"}):
        with running_server(config) as server:
            results["drafts"] = scenario(server.url, stops)
            figures["drafts"] = (metric(server.url, "spec_drafted_tokens"),
                                 metric(server.url, "spec_accepted_tokens"), metric(server.url, "engine_steps"))
    results["alone"] = stops["alone"]
    return results, figures


def test_a_do_nothing_speculator_changes_nothing(runs):
    results, figures = runs
    assert results["nothing"] == results["plain"]
    assert figures["nothing"][0] == 0


@pytest.mark.parametrize("case", ["greedy0", "greedy1", "seeded0", "seeded1", "short0", "short1", "stop0",
                                  "stop1", "batch8", "session0", "session1", "session2", "after_cancel",
                                  "rewound"])
def test_verified_drafts_give_exactly_the_plain_output(runs, case):
    results, _ = runs
    assert json.dumps(results["drafts"][case], sort_keys=True) == json.dumps(results["plain"][case], sort_keys=True)


def test_drafts_were_proposed_partly_accepted_and_saved_steps(runs):
    results, figures = runs
    drafted, accepted, steps = figures["drafts"]
    assert drafted > 0 and 0 < accepted < drafted
    assert steps < figures["nothing"][1]  # accepted drafts commit several tokens per step


def test_stops_and_max_tokens_end_inside_blocks(runs):
    results, _ = runs
    for i in range(len(PROMPTS)):
        assert results["drafts"][f"short{i}"]["usage"]["completion_tokens"] == 6
        assert results["drafts"][f"short{i}"]["finish"] == "length"


def test_seeded_sampling_is_the_same_alone_batched_and_after_a_rewind(runs):
    results, _ = runs
    plain = results["plain"]
    assert plain["batch8"] == results["alone"]
    assert plain["rewound"]["message"] == plain["seeded0"]["message"]
    assert plain["rewound"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the rewind reused a prefix
    solo = [plain["batch8"][seed] for seed in range(8)]
    assert len({json.dumps(r["message"], sort_keys=True) for r in solo}) > 1  # seeds matter
