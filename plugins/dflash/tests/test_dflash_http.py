"""DFlash through the HTTP API: the draft changes the number of target steps, never the output.

The demo checkpoint is served three times: plain (the session's shared plain
run, ``plain_speculation_run`` in the root conftest.py), with a random DFlash draft
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
import json

import pytest

from dflash_support import build_reference_draft, same_draws, save_draft
from musegl_core.testing.server import running_server
from musegl_core.testing.speculation import DRAWS, draft_metric as metric, draws, scenario, scenario_config

CASES = ["greedy0", "greedy1", "seeded0", "seeded1", "short0", "short1", "stop0", "stop1", "batch8", "session0",
         "session1", "session2", "after_cancel", "rewound"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, plain_speculation_run):
    from musegl_core.tiny import default_model_path

    tmp = tmp_path_factory.mktemp("dflash")
    model = build_reference_draft(seed=7)
    hf, gguf = save_draft(model, tmp / "hf"), save_draft(model, tmp / "gguf", gguf=True)
    plain = plain_speculation_run  # the plain server's run (conftest.py)
    stops = dict(plain["stops"])  # the stops it picked
    results = {"plain": {**plain["results"], "draws": plain["draws"]}}
    figures = {"plain": (plain["drafted_tokens"],)}
    for name, extra in (("hf", {"dflash": str(hf)}), ("gguf", {"dflash": str(gguf), "dflash_n_draft": 4})):
        with running_server(scenario_config(str(default_model_path()), **extra)) as server:
            results[name] = scenario(server.url, stops)
            results[name]["draws"] = draws(server.url)
            figures[name] = (metric(server.url, "spec_drafted_tokens"), metric(server.url, "engine_steps"))
    return results, figures


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
