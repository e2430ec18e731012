"""DFlash through the HTTP API: the draft changes the number of target steps, never the output.

The demo checkpoint is served three times: plain, with a random DFlash draft
loaded from a Hugging Face directory (15 drafts per step), and with the same
draft as a DFlash GGUF at ``--dflash-n-draft 4``. The scenario of
``tests/engine/test_speculation_http.py`` runs on each (greedy and seeded sampling,
stops and ``max_tokens``, a batch of 8 with one seed each, a session over
three turns, a cancelled stream and its session's next turn, a rewind), and
every response must be identical to the plain server's.

A seeded-sampling distribution check draws many completions of one token at
one position (different seeds) with and without the draft and compares the
two empirical distributions (total variation).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json

import pytest

from dflash_support import build_reference_draft, same_draws, save_draft
from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server
from musegl_core.testing.speculation import chat, draft_metric as metric, scenario

DRAWS = 160
CASES = ["greedy0", "greedy1", "seeded0", "seeded1", "short0", "short1", "stop0", "stop1", "batch8", "session0",
         "session1", "session2", "after_cancel", "rewound"]


def draws(url: str) -> list[str]:
    """One sampled token after a fixed prompt, under DRAWS seeds (temperature 1.5 flattens it)."""
    def one(seed: int) -> str:
        result = chat(url, [{"role": "user", "content": "Pick a word."}], max_tokens=3, temperature=1.5, seed=seed)
        message = result["message"]
        return json.dumps([message.get("content"), message.get("reasoning_content")])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(DRAWS)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    tmp = tmp_path_factory.mktemp("dflash")
    model = build_reference_draft(seed=7)
    hf, gguf = save_draft(model, tmp / "hf"), save_draft(model, tmp / "gguf", gguf=True)
    config = ServeConfig(model=str(default_model_path()), executor="torch-cpu", port=0, max_context=1024,
                         max_sessions=12, max_inflight_requests=8, max_decode_sequences=8)
    stops: dict = {}
    results, figures = {}, {}
    for name, extra in (("plain", {}), ("hf", {"dflash": str(hf)}),
                        ("gguf", {"dflash": str(gguf), "dflash_n_draft": 4})):
        with running_server(attrs_evolve(config, extra=extra)) as server:
            results[name] = scenario(server.url, stops)
            results[name]["draws"] = draws(server.url)
            figures[name] = (metric(server.url, "spec_drafted_tokens"), metric(server.url, "engine_steps"))
    return results, figures


def attrs_evolve(config, **changes):
    import attrs

    return attrs.evolve(config, **changes)


@pytest.mark.parametrize("draft", ["hf", "gguf"])
@pytest.mark.parametrize("case", CASES)
def test_output_is_identical_with_and_without_the_draft(runs, draft, case):
    results, _ = runs
    assert json.dumps(results[draft][case], sort_keys=True) == json.dumps(results["plain"][case], sort_keys=True)


def test_the_draft_was_asked_and_verified_in_the_target_steps(runs):
    _, figures = runs
    assert figures["plain"][0] == 0
    assert figures["hf"][0] > figures["gguf"][0] > 0  # 15 vs 4 drafts per step


def test_sampled_distribution_is_the_targets(runs):
    """Many seeded draws of the same completion: the empirical distributions with and without
    the draft agree within total variation 0.1, nearly seed for seed, and the plain
    distribution is really spread (so the check can fail)."""
    results, _ = runs
    plain = collections.Counter(results["plain"]["draws"])
    for draft in ("hf", "gguf"):
        spec = collections.Counter(results[draft]["draws"])
        tv = 0.5 * sum(abs(plain[k] - spec[k]) for k in plain.keys() | spec.keys()) / DRAWS
        assert tv <= 0.1, f"total variation {tv:.3f}"
        assert same_draws(results[draft]["draws"], results["plain"]["draws"]) >= 0.95
    assert len(plain) > 10  # the sampled token varies with the seed
