"""The torch executor against transformers' Muse Glimmer, through both checkpoint formats."""

from __future__ import annotations

import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_cuda.executor import TorchExecutor

PROMPT_LEN, NEW_TOKENS, BLOCK = 64, 32, 16
LOGIT_TOL = 1e-4


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def blocks_for(seq_index: int, length: int) -> list[int]:
    """A non-contiguous block table: sequence ``k`` takes blocks k, k+4, k+8, ..."""
    return [seq_index + 4 * j for j in range(-(-length // BLOCK))]


def executor_for(path) -> TorchExecutor:
    ex = TorchExecutor(load_checkpoint(path), device="cpu", dtype="float32", block_size=BLOCK)
    ex.allocate_kv(32)
    return ex


def greedy(ex: TorchExecutor, seq: int, ids: list[int], n: int, blocks: list[int]) -> tuple[list[int], torch.Tensor]:
    """Prefill ``ids`` in one chunk (all-row logits), then decode ``n`` tokens greedily."""
    out = ex.step(Step([SeqChunk(seq=seq, tokens=ids, positions=list(range(len(ids))), blocks=blocks,
                                 sample=True, logit_rows=True)]))
    logits, generated = out.logits[seq], [out.tokens[seq][-1]]
    while len(generated) < n:
        pos = len(ids) + len(generated) - 1
        out = ex.step(Step([SeqChunk(seq=seq, tokens=[generated[-1]], positions=[pos], blocks=blocks,
                                     sample=True)]))
        generated.append(out.tokens[seq][-1])
    return generated, logits


@pytest.fixture(scope="module", params=["hf", "gguf"])
def checkpoint_path(request, tiny_hf, tiny_gguf):
    return tiny_hf.path if request.param == "hf" else tiny_gguf


def test_logits_and_greedy_match_transformers(tiny_hf, checkpoint_path):
    ids = prompt(1)
    ex = executor_for(checkpoint_path)
    blocks = blocks_for(1, PROMPT_LEN + NEW_TOKENS)
    generated, logits = greedy(ex, 7, ids, NEW_TOKENS, blocks)
    ref = reference_logits(tiny_hf.model, ids)
    assert logits.shape == ref.shape == (PROMPT_LEN, 512)
    assert float((logits - ref).abs().max()) <= LOGIT_TOL
    assert generated == reference_greedy(tiny_hf.model, ids, NEW_TOKENS)


def test_chunked_and_packed_prefill_match(tiny_hf, checkpoint_path):
    ids_a, ids_b = prompt(2), prompt(3, 40)
    ref_a, ref_b = reference_logits(tiny_hf.model, ids_a), reference_logits(tiny_hf.model, ids_b)
    blocks_a, blocks_b = blocks_for(0, PROMPT_LEN), blocks_for(2, 48)
    ex = executor_for(checkpoint_path)
    cuts = [0, 5, 23, 50, PROMPT_LEN]
    rows = []
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        chunks = [SeqChunk(seq=1, tokens=ids_a[lo:hi], positions=list(range(lo, hi)), blocks=blocks_a,
                           logit_rows=True)]
        if i == 1:  # sequence 2's whole prompt rides along in the same packed step
            chunks.append(SeqChunk(seq=2, tokens=ids_b, positions=list(range(len(ids_b))), blocks=blocks_b,
                                   want_logits=True))
        if i == 0:  # and sequence 2 is absent from the others
            chunks.insert(0, SeqChunk(seq=3, tokens=ids_b[:9], positions=list(range(9)),
                                      blocks=blocks_for(3, 9), want_logits=True))
        out = ex.step(Step(chunks))
        rows.append(out.logits[1])
        if i == 1:
            assert float((out.logits[2] - ref_b[-1]).abs().max()) <= LOGIT_TOL
        if i == 0:
            assert float((out.logits[3] - ref_b[8]).abs().max()) <= LOGIT_TOL
    assert float((torch.cat(rows) - ref_a).abs().max()) <= LOGIT_TOL


def test_decoupled_layer_kinds_match_transformers(tmp_path):
    """A config.json where RoPE and the window disagree: a full-attention layer with RoPE
    and a sliding layer without it (transformers follows layer_rope_theta for RoPE)."""
    from musegl_core.testing.reference_models import build_tiny_model

    model = build_tiny_model(
        seed=5, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        layer_rope_theta=[10000.0, 10000.0, 0, 0],
    )
    model.save_pretrained(tmp_path)
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.config.sliding == (True, False, True, False)
    assert checkpoint.config.rope == (True, True, False, False)
    ex = executor_for(tmp_path)
    ids = prompt(4, 40)
    out = ex.step(Step([SeqChunk(seq=0, tokens=ids, positions=list(range(40)), blocks=blocks_for(0, 40),
                                 logit_rows=True)]))
    assert float((out.logits[0] - reference_logits(model, ids)).abs().max()) <= LOGIT_TOL


def test_musegl_generate_matches_transformers_token_by_token(tiny_hf, tiny_gguf):
    """`musegl generate --token-ids ... --json` (the whole engine, through the GGUF
    path) continues a prompt exactly as transformers' greedy generate does."""
    import json
    import subprocess
    import sys

    ids = prompt(11, 40)
    expected = reference_greedy(tiny_hf.model, ids, 24)
    out = subprocess.run(
        [sys.executable, "-m", "musegl_core.cli.main", "generate", "--model", str(tiny_gguf),
         "--token-ids", ",".join(map(str, ids)), "--max-tokens", "24", "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout)
    assert result["prompt_ids"] == ids
    assert result["token_ids"] == expected
    assert result["finish_reason"] == "length"
