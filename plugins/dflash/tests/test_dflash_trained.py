"""DFlash with a draft that is actually accepted: a small trained pair through the HTTP API.

The pair comes from ``benchmarks/dflash_pair.py`` at a reduced scale (a few
minutes on a shared CPU, cached in the musegl cache dir, keyed by the
script's content): a target trained on synthetic chat conversations and a
draft trained on the target's answers. Drafts are accepted here, so blocks
commit several tokens at once, and stops, ``max_tokens`` and cancellation
land inside accepted blocks. Every response must equal the plain server's,
and seeded sampling must give the same distribution (and the same token per
seed) with and without the draft.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import os
import sys
from pathlib import Path

import attrs
import httpx
import pytest

from dflash_support import same_draws
from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server
from musegl_core.testing.speculation import cancel_stream, draft_metric as metric

ROOT = Path(__file__).resolve().parents[3]
SYSTEM = {"role": "system", "content": "Answer briefly."}
QUESTIONS = ["Count from 3 to 9.", "Spell the word kidohu.", "Repeat after me: red plum river forest",
             "What is two plus five?", "List 5 numbers in words.", "Count from 0 to 6.",
             "Spell the word mountain.", "Repeat after me: apple blue kosuso"]
DRAWS = 96

# Training the pair takes minutes: the slow tier (CI runs it as its second step).
pytestmark = pytest.mark.slow


def trained_pair() -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import dflash_pair
    finally:
        sys.path.pop(0)
    key = hashlib.sha256((ROOT / "benchmarks" / "dflash_pair.py").read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get("MUSEGL_CACHE_DIR") or _user_cache()) / f"dflash-test-pair-{key}"
    target, draft, _ = dflash_pair.build_pair(root, target_steps=80, draft_steps=80, conversations=400,
                                              draft_sequences=48, batch=16, reuse=True)
    return target, draft


def _user_cache() -> str:
    import platformdirs

    return platformdirs.user_cache_dir("musegl")


def chat(url: str, content: str, **extra) -> dict:
    body = {"model": "m", "messages": [SYSTEM, {"role": "user", "content": content}], "max_tokens": 40,
            "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    data = response.json()
    return {"message": data["choices"][0]["message"], "finish": data["choices"][0]["finish_reason"],
            "usage": data["usage"]}


def scenario(url: str, plan: dict) -> dict:
    out: dict = {}
    for i, question in enumerate(QUESTIONS[:4]):
        out[f"greedy{i}"] = chat(url, question)
        for n in (2, 5, 9, 13):  # max_tokens ends inside a block
            out[f"max{i}_{n}"] = chat(url, question, max_tokens=n)
        if f"stop{i}" not in plan:  # stop strings from the plain answer's middle
            message = out[f"greedy{i}"]["message"]
            text = message.get("content") or message.get("reasoning_content") or ""
            # Two spaces too: this briefly trained target often answers with runs of spaces.
            plan[f"stop{i}"] = [text[len(text) // 2:len(text) // 2 + 2] or "zz", text[-4:-2] or "yy", "  "]
        for j, stop in enumerate(plan[f"stop{i}"]):
            out[f"stop{i}_{j}"] = chat(url, question, stop=[stop])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        out["batch8"] = list(pool.map(lambda q: chat(url, q), QUESTIONS))
        out["batch8_seeded"] = list(pool.map(lambda s: chat(url, QUESTIONS[s], temperature=0.8, seed=s),
                                             range(8)))
    # A session over three turns, a cancelled stream and its session's next turn.
    history = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    for turn in range(3):
        body = {"model": "m", "messages": history, "max_tokens": 30, "temperature": 0, "session_id": "multi"}
        data = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
        out[f"session{turn}"] = data["choices"][0]["message"]
        history += [{"role": "assistant", "content": data["choices"][0]["message"].get("content") or ""},
                    {"role": "user", "content": QUESTIONS[turn + 1]}]
    cancel_stream(url, [SYSTEM, {"role": "user", "content": QUESTIONS[2]}], "cancelled", after=3)
    out["after_cancel"] = chat(url, QUESTIONS[2], session_id="cancelled", max_tokens=30)

    def draw(seed: int) -> str:
        return chat(url, "Count from 3 to 9.", temperature=1.3, seed=seed, max_tokens=6)["message"].get("content")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        out["draws"] = list(pool.map(draw, range(DRAWS)))
    return out


@pytest.fixture(scope="module")
def runs():
    target, draft = trained_pair()
    config = ServeConfig(model=str(target), executor="torch-cpu", port=0, max_context=512, max_sessions=12,
                         max_inflight_requests=8, max_decode_sequences=8)
    plan: dict = {}
    results, figures = {}, {}
    for name, extra in (("plain", {}), ("dflash", {"dflash": str(draft)})):
        with running_server(attrs.evolve(config, extra=extra)) as server:
            results[name] = scenario(server.url, plan)
            figures[name] = {k: metric(server.url, k) for k in ("spec_drafted_tokens", "spec_accepted_tokens",
                                                                "spec_verify_blocks", "engine_steps")}
            figures[name]["mean"] = metric(server.url, "spec_mean_acceptance_length")
    return results, figures


def test_drafts_are_accepted_and_save_target_steps(runs):
    _, figures = runs
    spec = figures["dflash"]
    assert spec["spec_accepted_tokens"] > 0.1 * spec["spec_drafted_tokens"] > 0
    assert spec["mean"] == pytest.approx(1 + spec["spec_accepted_tokens"] / spec["spec_verify_blocks"])
    assert spec["mean"] > 1.3
    assert spec["engine_steps"] < 0.85 * figures["plain"]["engine_steps"]


#: Seeded answers of this briefly trained target put much of their mass on thousands of
#: ids sharing one lm_head row (near-equal tiny probabilities), where a draw is decided
#: within float rounding of the wider verify forward (see same_draws): they are compared
#: as distributions, not seed for seed.
SEEDED = ("batch8_seeded", "draws")


def test_every_response_equals_the_plain_servers(runs):
    results, _ = runs
    plain, spec = results["plain"], results["dflash"]
    assert plain.keys() == spec.keys()
    for key in plain:
        if key not in SEEDED:
            assert json.dumps(spec[key], sort_keys=True) == json.dumps(plain[key], sort_keys=True), key


def test_max_tokens_and_stops_inside_blocks(runs):
    results, _ = runs
    spec = results["dflash"]
    lengths = [spec[f"max{i}_{n}"]["usage"]["completion_tokens"] for i in range(4) for n in (2, 5, 9, 13)]
    assert lengths.count(2) == 4 and max(lengths) == 13
    assert any(spec[f"stop{i}_{j}"]["finish"] == "stop" for i in range(4) for j in range(3))


def test_seeded_sampling_has_the_targets_distribution(runs):
    results, _ = runs
    plain, spec = collections.Counter(results["plain"]["draws"]), collections.Counter(results["dflash"]["draws"])
    tv = 0.5 * sum(abs(plain[k] - spec[k]) for k in plain.keys() | spec.keys()) / DRAWS
    assert tv <= 0.4, f"total variation {tv:.3f}"
    assert same_draws(results["dflash"]["draws"], results["plain"]["draws"]) >= 0.6
    answers = [(a["message"], b["message"]) for a, b in zip(results["plain"]["batch8_seeded"],
                                                          results["dflash"]["batch8_seeded"])]
    # Whole 40-token answers: one flipped draw (see same_draws) changes the rest of an answer. On
    # an AVX-512 machine 4+ of 8 agree; on an AVX2 one (torch's CPU products round differently
    # by row count there) 3 of 8 did. Unrelated seeds at temperature 1.3 agree on none.
    assert sum(a == b for a, b in answers) >= 2
    assert len(plain) > 3  # temperature 1.3 spreads the answers: the check can fail
