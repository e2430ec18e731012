"""The MLX executor against transformers' Muse Glimmer (float32), through both checkpoint formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_mlx.executor import MLXExecutor
from musegl_mlx.loader import checkpoint_weights

PROMPT_LEN, NEW_TOKENS, BLOCK = 64, 32, 16
LOGIT_TOL = 1e-4


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


_GREEDY: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (remembered: the HF and GGUF runs share it). The
    attention mask is explicit: without it generate() would take id 0 (the tiny model's
    pad id) in a random prompt for padding."""
    key = (id(model), tuple(ids), n)
    if key not in _GREEDY:
        _GREEDY[key] = _generate(model, ids, n)
    return _GREEDY[key]


def _generate(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def blocks_for(seq_index: int, length: int) -> list[int]:
    """A non-contiguous block table: sequence ``k`` takes blocks k, k+4, k+8, ..."""
    return [seq_index + 4 * j for j in range(-(-length // BLOCK))]


def executor_for(path, dtype: str = "float32") -> MLXExecutor:
    checkpoint = load_checkpoint(path)
    ex = MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype=dtype,
                     block_size=BLOCK)
    checkpoint.close()
    ex.allocate_kv(32)
    return ex


def maxdiff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.fixture(scope="module", params=["hf", "gguf"])
def ex(request, tiny_hf, tiny_gguf) -> MLXExecutor:
    return executor_for(tiny_hf.path if request.param == "hf" else tiny_gguf)


def test_logits_and_greedy_match_transformers(tiny_hf, ex):
    ids = prompt(1)
    blocks = blocks_for(1, PROMPT_LEN + NEW_TOKENS)
    out = ex.step(Step([SeqChunk(seq=7, tokens=ids, positions=list(range(PROMPT_LEN)), blocks=blocks,
                                 sample=True, logit_rows=True)]))
    ref = reference_logits(tiny_hf.model, ids)
    assert out.logits[7].shape == ref.shape == (PROMPT_LEN, 512)
    assert maxdiff(out.logits[7], ref) <= LOGIT_TOL
    generated = [out.tokens[7][-1]]
    while len(generated) < NEW_TOKENS:
        pos = PROMPT_LEN + len(generated) - 1
        out = ex.step(Step([SeqChunk(seq=7, tokens=[generated[-1]], positions=[pos], blocks=blocks, sample=True)]))
        generated.append(out.tokens[7][-1])
    assert generated == reference_greedy(tiny_hf.model, ids, NEW_TOKENS)


def test_chunked_and_packed_prefill_match(tiny_hf, ex):
    ids_a, ids_b = prompt(2), prompt(3, 40)
    ref_a, ref_b = reference_logits(tiny_hf.model, ids_a), reference_logits(tiny_hf.model, ids_b)
    blocks_a, blocks_b = blocks_for(0, PROMPT_LEN), blocks_for(2, 48)
    cuts = [0, 5, 23, 50, PROMPT_LEN]
    rows = []
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        chunks = [SeqChunk(seq=1, tokens=ids_a[lo:hi], positions=list(range(lo, hi)), blocks=blocks_a,
                           logit_rows=True)]
        if i == 1:  # sequence 2's whole prompt rides along in the same packed step
            chunks.append(SeqChunk(seq=2, tokens=ids_b, positions=list(range(len(ids_b))), blocks=blocks_b,
                                   want_logits=True))
        if i == 0:  # and a third sequence is packed with the first chunk only
            chunks.insert(0, SeqChunk(seq=3, tokens=ids_b[:9], positions=list(range(9)),
                                      blocks=blocks_for(3, 9), want_logits=True))
        out = ex.step(Step(chunks))
        rows.append(out.logits[1])
        if i == 1:
            assert maxdiff(out.logits[2], ref_b[-1]) <= LOGIT_TOL
        if i == 0:
            assert maxdiff(out.logits[3], ref_b[8]) <= LOGIT_TOL
    assert maxdiff(np.concatenate(rows), ref_a) <= LOGIT_TOL


def test_batched_decode_matches_each_sequence_alone(tiny_hf, ex):
    """Three sequences of different lengths prefill together, then decode 32 tokens
    each in shared steps (one row per sequence): every continuation is transformers' greedy."""
    prompts = {10: prompt(5, 30), 11: prompt(6, 7), 12: prompt(7, 51)}
    tables = {seq: blocks_for(i, len(p) + NEW_TOKENS) for i, (seq, p) in enumerate(prompts.items())}
    out = ex.step(Step([SeqChunk(seq=s, tokens=p, positions=list(range(len(p))), blocks=tables[s], sample=True)
                        for s, p in prompts.items()]))
    generated = {s: [out.tokens[s][0]] for s in prompts}
    while len(generated[10]) < NEW_TOKENS:
        chunks = [SeqChunk(seq=s, tokens=[g[-1]], positions=[len(prompts[s]) + len(g) - 1], blocks=tables[s],
                           sample=True) for s, g in generated.items()]
        out = ex.step(Step(chunks))
        for s in generated:
            generated[s].append(out.tokens[s][0])
    for s, p in prompts.items():
        assert generated[s] == reference_greedy(tiny_hf.model, p, NEW_TOKENS), s


def test_decoupled_layer_kinds_match_transformers(tmp_path):
    """RoPE and the window disagree: a full-attention layer with RoPE and a sliding layer
    without it (transformers follows layer_rope_theta for RoPE)."""
    from musegl_core.testing.reference_models import build_tiny_model

    model = build_tiny_model(
        seed=5, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        layer_rope_theta=[10000.0, 10000.0, 0, 0],
    )
    model.save_pretrained(tmp_path)
    ex = executor_for(tmp_path)
    assert [layer.use_rope for layer in ex.model.layers] == [True, True, False, False]
    ids = prompt(4, 40)
    out = ex.step(Step([SeqChunk(seq=0, tokens=ids, positions=list(range(40)), blocks=blocks_for(0, 40),
                                 logit_rows=True)]))
    assert maxdiff(out.logits[0], reference_logits(model, ids)) <= LOGIT_TOL


def test_bfloat16_stays_close_to_float32(tiny_hf):
    """bfloat16 (the default on Apple's GPU) runs the same model: logits within bf16 rounding of float32."""
    ex = executor_for(tiny_hf.path, dtype="bfloat16")
    assert ex.info.dtype == "bfloat16"
    assert ex.kv_bytes_per_block() == 6 * 2 * BLOCK * 2 * 16 * 2
    ids = prompt(8, 24)
    out = ex.step(Step([SeqChunk(seq=0, tokens=ids, positions=list(range(24)), blocks=blocks_for(0, 24),
                                 logit_rows=True)]))
    ref = reference_logits(tiny_hf.model, ids)
    assert out.logits[0].dtype == np.float32
    assert 0 < maxdiff(out.logits[0], ref) < 0.15


def test_musegl_generate_with_executor_mlx_matches_transformers(tiny_hf, tiny_gguf):
    """`musegl generate --executor mlx --dtype float32` (the whole engine, GGUF path)
    continues a prompt exactly as transformers' greedy generate does."""
    import json
    import subprocess
    import sys

    ids = prompt(11, 40)
    expected = reference_greedy(tiny_hf.model, ids, 32)
    out = subprocess.run(
        [sys.executable, "-m", "musegl_core.cli.main", "generate", "--model", str(tiny_gguf), "--executor", "mlx",
         "--dtype", "float32", "--token-ids", ",".join(map(str, ids)), "--max-tokens", "32", "--ignore-eos",
         "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout)
    assert result["backend"] == "mlx"
    assert result["token_ids"] == expected


@pytest.fixture(scope="module", params=["q8_0", "q4_0", "bf16"])
def quantized_gguf(request, tiny_hf, tmp_path_factory):
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.testing.reference_models import tiny_tokenizer_data

    checkpoint = load_checkpoint(tiny_hf.path)
    path = tmp_path_factory.mktemp("quantized") / f"model-{request.param}.gguf"
    write_text_gguf(path, checkpoint.config, dict(checkpoint.iter_weights()), tiny_tokenizer_data(),
                    file_type=request.param)
    return path


def test_stored_forms_match_the_torch_executor_on_the_same_file(quantized_gguf):
    """Q8_0/Q4_0 matrices (the embedding and the head too) run as MLX quantized
    matrices; bf16 ones are read as bf16 bits. The logits equal (to float rounding)
    those of the torch executor over the same file read as float32."""
    from musegl_cuda.executor import TorchExecutor

    ex = executor_for(quantized_gguf)
    layer = ex.model.layers[0]
    if "bf16" in quantized_gguf.name:
        assert not layer.qkvg.quantized
    else:
        bits = 8 if "q8_0" in quantized_gguf.name else 4
        linears = (layer.qkvg, layer.gate_up, layer.down_proj, layer.o_proj, ex.model.lm_head, ex.model.embed_tokens.table)
        assert all(linear.quantized and (linear.bits, linear.group_size) == (bits, 32) for linear in linears)
    torch_ex = TorchExecutor(load_checkpoint(quantized_gguf), device="cpu", dtype="float32", block_size=BLOCK)
    torch_ex.allocate_kv(32)
    ids = prompt(9, 40)
    chunk = dict(seq=0, tokens=ids, positions=list(range(40)), blocks=blocks_for(0, 40), logit_rows=True,
                 sample=True)
    ours, theirs = ex.step(Step([SeqChunk(**chunk)])), torch_ex.step(Step([SeqChunk(**chunk)]))
    assert maxdiff(ours.logits[0], theirs.logits[0].numpy()) <= LOGIT_TOL
    assert ours.tokens[0] == theirs.tokens[0]
