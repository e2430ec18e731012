"""DFlash on CUDA through graphs (marked ``gpu``: run with ``-m gpu``).

The draft forward replayed from its CUDA graphs gives the eager forward's
drafts; the demo checkpoint served on CUDA (float32, so batch widths do not
round answers differently) with a random DFlash draft answers the speculation
scenario exactly as the plain server does, with drafts proposed, verified in
graph steps and kept on the device.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_draft_graphs_give_the_eager_drafts(tmp_path):
    from dflash_support import build_reference_draft, save_draft
    from musegl_core.engine.speculator import DraftRequest
    from musegl_dflash.loader import load_draft
    from musegl_dflash.speculator import DFlashSpeculator, TargetHead

    vocab, hidden, block = 512, 64, 16
    model = build_reference_draft(seed=5, mask_token_id=500, sliding_window=100)
    draft = load_draft(str(save_draft(model, tmp_path / "hf")), torch.device("cuda"), torch.float32)
    gen = torch.Generator().manual_seed(6)
    head = TargetHead.of_tensors(torch.randn(vocab, hidden, generator=gen).cuda(),
                                 torch.randn(vocab, hidden, generator=gen).cuda())
    spec = DFlashSpeculator(draft, head, 7, block)
    assert spec.use_graphs
    spec.allocate_kv(64)
    c = draft.config
    tables = [list(range(0, 20)), list(range(20, 40)), list(range(40, 64))]
    for table in tables:
        positions = torch.arange(300, device="cuda")
        slots = torch.tensor([table[p // block] * block + p % block for p in range(300)], device="cuda")
        features = torch.randn(300, len(c.target_layer_ids) * hidden, generator=gen).cuda()
        draft.write_context(features, positions, slots, spec.kv)
    for lengths in ([120, 7, 299], [40], [299, 250], [3, 5, 9]):
        requests = [DraftRequest(i, [11 + i] * (n + 1), tables[i], 7) for i, n in enumerate(lengths)]
        replayed = spec.propose_on_device(requests).ids.clone()
        graphs, spec.graphs = spec.graphs, None
        eager = spec.propose_on_device(requests).ids
        spec.graphs = graphs
        assert torch.equal(replayed, eager), lengths
    assert len(spec.graphs.graphs) >= 3  # shapes captured on first use and replayed after


def test_served_dflash_through_graphs_is_greedy_identical_with_and_without_the_draft(tmp_path):
    import attrs

    from dflash_support import build_reference_draft, save_draft
    from musegl_core.config import ServeConfig
    from musegl_core.testing.server import running_server
    from musegl_core.testing.speculation import draft_metric as metric, scenario
    from musegl_core.tiny import default_model_path

    draft = save_draft(build_reference_draft(seed=7), tmp_path / "hf")
    config = ServeConfig(model=str(default_model_path()), executor="cuda", dtype="float32", port=0,
                         max_context=1024, max_sessions=12, max_inflight_requests=8, max_decode_sequences=8)
    stops: dict = {}
    results, drafted = {}, {}
    for name, extra in (("plain", {}), ("dflash", {"dflash": str(draft), "dflash_n_draft": 7})):
        with running_server(attrs.evolve(config, extra=extra)) as server:
            results[name] = scenario(server.url, stops)
            drafted[name] = metric(server.url, "spec_drafted_tokens")
    assert drafted["plain"] == 0 and drafted["dflash"] > 0
    for key, value in results["plain"].items():
        if key == "batch8":  # how concurrent requests share steps depends on arrival times
            assert all(r["finish"] in ("stop", "length") for r in results["dflash"][key])
            continue
        assert json.dumps(results["dflash"][key], sort_keys=True) == json.dumps(value, sort_keys=True), key
