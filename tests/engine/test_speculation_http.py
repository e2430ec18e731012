"""Multi-token commits through the HTTP API: a speculator's drafts change the speed, never the output.

Three servers run the same scenario on the demo checkpoint (torch executor):
without a speculator (the session's shared plain run, ``plain_speculation_run``
in conftest.py), with a do-nothing speculator (which records the
sequences it sees), and with a speculator that replays those recordings as
drafts of up to 4 tokens, one of them corrupted at a varying index, so the
target accepts 0..4 drafts per step. Every response must be identical to the
plain server's: greedy and seeded sampling, stops and ``max_tokens`` inside
an accepted block, batches of 8, multi-turn sessions, a cancelled stream
followed by its session's next turn, and a session rewind.
"""

from __future__ import annotations

import json

import pytest

from musegl_core.testing.speculation import PROMPTS, draft_metric as metric, scenario, scenario_config
from musegl_core.testing.server import running_server
from tests.support.server import support_plugin_env

K = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, plain_speculation_run):
    from musegl_core.tiny import default_model_path

    tmp = tmp_path_factory.mktemp("drafts")
    config = scenario_config(str(default_model_path()))
    plain = plain_speculation_run  # the plain server's run (conftest.py)
    stops = dict(plain["stops"])  # the stops it picked, and its batch's requests alone
    results, figures = {"plain": plain["results"]}, {}
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
