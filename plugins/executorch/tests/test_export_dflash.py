"""``musegl export MODEL --dflash DRAFT`` (slow: one export, then three servers): the
program's draft changes the number of target steps, never the output.

The pair is the small trained target + draft of ``benchmarks/dflash_pair.py`` at the
scale ``plugins/dflash/tests/test_dflash_trained.py`` uses (cached in the musegl cache
directory, keyed by the script's content), so drafts are really accepted and blocks
commit several tokens. The speculation scenario of ``musegl_core.testing.speculation``
(greedy and seeded sampling, stops and ``max_tokens`` inside a block, a batch of 8
with a seed each, a session over three turns, a cancelled stream, a rewind) runs on
the export served without the draft, with it (15 drafts per step, the trained block)
and with ``--dflash-n-draft 4`` (a shorter block chosen at serve time, no
re-export); every response must be identical to the plain server's, and the drafts
must have been proposed and accepted."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import attrs
import pytest

from musegl_core.cli.main import main
from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server
from musegl_core.testing.speculation import draft_metric, scenario

ROOT = Path(__file__).resolve().parents[3]
CASES = ["greedy0", "greedy1", "seeded0", "seeded1", "short0", "short1", "stop0", "stop1", "batch8", "session0",
         "session1", "session2", "after_cancel", "rewound"]

# An export and a trained pair: minutes on two cores, and past the suite's 600 s per test
# (fixture set-up included) when the machine is shared: a wall-clock bound that fits both.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def trained_pair() -> tuple[Path, Path]:
    """(target directory, draft directory) of ``benchmarks/dflash_pair.py``, built once and cached."""
    import platformdirs

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import dflash_pair
    finally:
        sys.path.pop(0)
    key = hashlib.sha256((ROOT / "benchmarks" / "dflash_pair.py").read_bytes()).hexdigest()[:12]
    cache = os.environ.get("MUSEGL_CACHE_DIR") or platformdirs.user_cache_dir("musegl")
    target, draft, _ = dflash_pair.build_pair(Path(cache) / f"dflash-test-pair-{key}", target_steps=80,
                                              draft_steps=80, conversations=400, draft_sequences=48, batch=16,
                                              reuse=True)
    return target, draft


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    target, draft = trained_pair()
    out = tmp_path_factory.mktemp("et_dflash") / "export"
    assert main(["export", str(target), "-o", str(out), "--forward-sizes", "8", "--max-prefill-chunk", "64",
                 "--max-cells", "32768", "--dflash", str(draft), "--max-draft-owners", "4"]) == 0
    return out


@pytest.fixture(scope="module")
def runs(exported):
    config = ServeConfig(model=str(exported), port=0, max_context=1024, max_sessions=12, max_inflight_requests=8,
                         max_decode_sequences=8)
    stops: dict = {}
    results, figures = {}, {}
    for name, extra in (("plain", {}), ("draft", {"dflash": str(exported)}),
                        ("draft4", {"dflash": str(exported), "dflash_n_draft": 4})):
        with running_server(attrs.evolve(config, extra=extra)) as server:
            results[name] = scenario(server.url, stops)
            figures[name] = (draft_metric(server.url, "spec_drafted_tokens"),
                             draft_metric(server.url, "spec_accepted_tokens"))
    return results, figures


def test_the_manifest_records_the_draft(exported):
    manifest = json.loads((exported / "musegl-export.json").read_text())
    assert manifest["methods"] == ["forward_8", "forward_others", "draft_context", "draft_block"]
    assert manifest["outputs"] == ["logits", "new_k", "new_v", "hidden"]
    assert manifest["dflash"]["max_owners"] == 4 and manifest["dflash"]["context_keys"] == 2048  # the window
    assert manifest["dflash"]["config"]["target_layer_ids"] == [0, 1, 2]


@pytest.mark.parametrize("draft", ["draft", "draft4"])
@pytest.mark.parametrize("case", CASES)
def test_output_is_identical_with_and_without_the_program_draft(runs, draft, case):
    results, _ = runs
    assert json.dumps(results[draft][case], sort_keys=True) == json.dumps(results["plain"][case], sort_keys=True)


def test_the_program_drafted_and_the_target_accepted(runs):
    _, figures = runs
    assert figures["plain"] == (0.0, 0.0)
    assert figures["draft"][0] > figures["draft4"][0] > 0  # 15 vs 4 drafts per step
    assert figures["draft"][1] > 0 and figures["draft4"][1] > 0  # a trained draft: some drafts are accepted
