"""What a speculator must not change: a fixed scenario over the HTTP API whose
responses are compared between a plain server and one with drafts.

:func:`scenario` runs, in a fixed order, greedy and seeded sampling, stops and
``max_tokens`` that end inside an accepted block, a batch of 8 requests with a
seed each, a session over three turns, a cancelled stream followed by its
session's next turn, and a session rewind. A speculator plugin's test runs it
on a server without and with its drafts and requires identical results
(:func:`draft_metric` reads the drafting counters). :func:`draws` samples one
short completion under many seeds, for comparing the sampled distributions;
:func:`scenario_config` is the server the scenario is written for.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx

from musegl_core.config import ServeConfig

PROMPTS = [
    [{"role": "user", "content": "Write a few words about the sea."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List three colours " * 5}],
]
SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234}
DRAWS = 160


def scenario_config(model: str, **extra) -> ServeConfig:
    """The server the scenario runs on: the torch CPU executor, room for its batch of 8 and its sessions."""
    return ServeConfig(model=model, executor="torch-cpu", port=0, max_context=1024, max_sessions=12,
                       max_inflight_requests=8, max_decode_sequences=8, extra=extra)


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


def draws(url: str, count: int = DRAWS) -> list[str]:
    """An answer of at most three tokens after a fixed prompt under seeds ``0..count-1`` (temperature
    1.5 flattens it), each as the JSON of its content and reasoning content."""
    def one(seed: int) -> str:
        result = chat(url, [{"role": "user", "content": "Pick a word."}], max_tokens=3, temperature=1.5, seed=seed)
        message = result["message"]
        return json.dumps([message.get("content"), message.get("reasoning_content")])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


def draft_metric(url: str, name: str) -> float:
    """``musegl_<name>`` from /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(rf"^musegl_{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0
