"""DFlash over a tensor-parallel target (``--tensor-parallel-size 2`` on the CPU): the draft
borrows the target's embedding and head from the ranks (TargetAccess of
TensorParallelExecutor) and drafts beside them; the answers are the one-rank server's
without a draft. The float32 demo checkpoint on the stored-weight kernels (every row's
result independent of the rows beside it, so verify blocks and decode steps agree).

A short scenario (greedy and seeded answers, a session over two turns): on the CPU each
draft's head product is gathered from the ranks over gloo (about 0.1 s for 16 rows of the
202,048-entry vocabulary on the shared 2-core machine), which makes drafting slow there.
"""

from __future__ import annotations

import json

import attrs
import pytest

from dflash_support import build_reference_draft, save_draft
from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server
from musegl_core.testing.speculation import PROMPTS, SEEDED, chat, draft_metric

pytestmark = pytest.mark.slow

CASES = ["greedy0", "greedy1", "seeded0", "seeded1", "session0", "session1"]


def short_scenario(url: str) -> dict:
    out = {}
    for i, messages in enumerate(PROMPTS):
        out[f"greedy{i}"] = chat(url, messages, max_tokens=10)
        out[f"seeded{i}"] = chat(url, messages, max_tokens=10, **SEEDED)
    history = list(PROMPTS[0])
    for turn in range(2):
        out[f"session{turn}"] = result = chat(url, history, session_id="multi", max_tokens=8)
        history += [{"role": "assistant", "content": result["message"].get("content") or ""},
                    {"role": "user", "content": f"and then {turn}?"}]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    draft = save_draft(build_reference_draft(seed=7), tmp_path_factory.mktemp("dflash_tp") / "hf")
    config = ServeConfig(model=str(default_model_path(file_type="f32")), executor="torch-cpu", port=0,
                         max_context=1024, max_sessions=4, max_inflight_requests=4, max_decode_sequences=4)
    results, drafted = {}, {}
    for name, extra in (("plain", {}), ("tp2-dflash", {"tensor_parallel_size": 2, "dflash": str(draft)})):
        with running_server(attrs.evolve(config, extra={"weights": "stored", **extra})) as server:
            results[name] = short_scenario(server.url)
            drafted[name] = draft_metric(server.url, "spec_drafted_tokens")
    return results, drafted


@pytest.mark.parametrize("case", CASES)
def test_the_drafted_tensor_parallel_answers_are_the_plain_ones(runs, case):
    results, _ = runs
    assert json.dumps(results["tp2-dflash"][case], sort_keys=True) == json.dumps(results["plain"][case],
                                                                               sort_keys=True)


def test_the_draft_drafted(runs):
    _, drafted = runs
    assert drafted["plain"] == 0 and drafted["tp2-dflash"] > 0
