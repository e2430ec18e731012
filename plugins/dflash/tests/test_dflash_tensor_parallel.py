"""DFlash over a tensor-parallel target (``--tensor-parallel-size 2`` on the CPU): the draft
runs on every rank (``TensorParallelExecutor.speculator_on_ranks``), with the rank's share of
the target's embedding and a vocabulary-parallel argmax of its head; the engine sees
``RankSpeculator``. The served answers are the one-rank server's without a draft. The float32
demo checkpoint on the stored-weight kernels (every row's result independent of the rows
beside it, so verify blocks and decode steps agree).

A short scenario (greedy and seeded answers, a session over two turns); then, without the
server, the draft on 2 ranks against the draft beside one executor on the tiny model: the same
drafts, and verify steps (drafts read on the ranks) sampling and accepting the same ids.
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


# -- the draft on the ranks, against the draft beside one executor ----------------------------

BLOCK = 16
BLOCKS = 32
N_DRAFT = 7


def drafting_pair(executor, draft_path):
    """``executor`` and the DFlash speculator loaded next to it, both allocated."""
    from musegl_core.plugins.specs import ExecutorOptions
    from musegl_dflash.loader import load_speculator

    speculator = load_speculator(str(draft_path), executor, ExecutorOptions(model=""), N_DRAFT)
    executor.expect_taps(speculator.taps)
    executor.allocate_kv(BLOCKS)
    speculator.allocate_kv(BLOCKS)
    return speculator


def run_turns(executor, speculator, prompt, turns=3):
    """A prefill, then ``turns`` verify blocks with the drafts on the device; every step
    observed. Returns the drafts of each turn (read back through ``propose``, and the
    device drafts' verify: ids and accepted counts)."""
    from musegl_core.engine.executor import GREEDY, SeqChunk, Step
    from musegl_core.engine.speculator import DraftRequest

    taps = tuple(speculator.taps)
    blocks = list(range(4))
    tokens = list(prompt)
    step = Step([SeqChunk(seq=0, tokens=tokens, positions=list(range(len(tokens))), blocks=blocks, sample=1,
                          sampling=GREEDY, uniforms=[0.0])], taps=taps)
    out = executor.step(step)
    speculator.observe(step, out, {0: len(tokens)})
    tokens.append(out.tokens[0][0])
    seen = []
    for _ in range(turns):
        request = DraftRequest(0, tuple(tokens), tuple(blocks), N_DRAFT)
        host = speculator.propose([request])[0]
        found = speculator.propose_on_device([request])
        start = len(tokens) - 1
        rows = [tokens[-1]] + [0] * found.counts[0]
        chunk = SeqChunk(seq=0, tokens=rows, positions=list(range(start, start + len(rows))), blocks=blocks,
                         sample=len(rows), sampling=GREEDY, uniforms=[0.0] * len(rows), draft_row=found.rows[0])
        step = Step([chunk], taps=taps, drafts=found.ids)
        out = executor.step(step)
        kept = out.accepted[0] + 1
        speculator.observe(step, out, {0: kept})
        tokens.extend(out.tokens[0][:kept])
        seen.append((host, out.tokens[0], out.accepted[0]))
    return seen


def tiny_draft(tmp_path_factory):
    # the tiny model's vocabulary is 512 ids: the draft's mask token among them
    return save_draft(build_reference_draft(seed=7, mask_token_id=511),
                      tmp_path_factory.mktemp("dflash_tp_hosted") / "hf")


PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def hosted_runs(tiny_hf, tmp_path_factory):
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_cuda.executor import TorchExecutor
    from musegl_cuda.parallel.executor import TensorParallelExecutor
    from musegl_cuda.parallel.rank import RankSpec
    from musegl_cuda.parallel.speculator import RankSpeculator

    draft = tiny_draft(tmp_path_factory)
    prompt = PROMPT
    single = TorchExecutor(load_checkpoint(tiny_hf.path), device="cpu", block_size=BLOCK)
    beside = drafting_pair(single, draft)
    one = run_turns(single, beside, prompt)
    parallel = TensorParallelExecutor(RankSpec(str(tiny_hf.path), "cpu", 2))
    try:
        with pytest.raises(ValueError) as refused:  # a draft the ranks cannot read: answered, they carry on
            parallel.speculator_on_ranks("musegl_dflash.loader:rank_speculator", (str(draft / "missing"), N_DRAFT))
        hosted = drafting_pair(parallel, draft)
        assert isinstance(hosted, RankSpeculator)  # the draft lives on the ranks, not here
        two = run_turns(parallel, hosted, prompt)
        figures = (beside.kv_bytes_per_block(), hosted.kv_bytes_per_block(), parallel.limits.device_drafts,
                   str(refused.value))
    finally:
        parallel.close()
    return one, two, figures


def test_the_draft_on_the_ranks_drafts_what_one_device_drafts(hosted_runs):
    one, two, _ = hosted_runs
    assert two == one  # the host drafts, the verified ids and the accepted counts of every turn
    assert any(host for host, _, _ in one)


def test_the_draft_on_the_ranks_counts_its_store_per_rank_on_the_cpu(hosted_runs):
    _, _, (beside, hosted, device_drafts, _) = hosted_runs
    assert hosted == 2 * beside  # a replica per rank, in the host's memory
    assert device_drafts  # the verify steps read the ranks' drafts on their devices


def test_a_draft_that_fails_to_load_on_the_ranks_is_an_error_and_the_ranks_carry_on(hosted_runs):
    _, _, (_, _, _, refused) = hosted_runs
    assert refused.startswith("the speculator failed to load on rank 0: ") and "missing" in refused


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more CUDA GPUs")
def test_on_two_gpus_the_draft_on_the_ranks_drafts_what_one_gpu_drafts(tiny_hf, tmp_path_factory):
    """On CUDA in float32: the draft's graphs on each rank (the embedding's all-reduce and
    the argmax's all-gather captured inside) against the draft's graphs beside one GPU."""
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_cuda.executor import TorchExecutor
    from musegl_cuda.parallel.executor import TensorParallelExecutor
    from musegl_cuda.parallel.rank import RankSpec

    draft = tiny_draft(tmp_path_factory)
    single = TorchExecutor(load_checkpoint(tiny_hf.path), device="cuda:0", dtype="float32", block_size=BLOCK)
    beside = drafting_pair(single, draft)
    assert beside.graphs is not None
    one = run_turns(single, beside, PROMPT)
    single.close()
    parallel = TensorParallelExecutor(RankSpec(str(tiny_hf.path), "cuda", 2, dtype="float32"))
    try:
        two = run_turns(parallel, drafting_pair(parallel, draft), PROMPT)
    finally:
        parallel.close()
    assert two == one
