"""TorchExecutor behaviour: paged KV, block copies, selective logits, sampling, taps, plugin."""

from __future__ import annotations

import pytest
import torch
from step_support import chunk

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import GREEDY, Executor, SamplingParams, Step
from musegl_core.plugins.specs import ExecutorOptions
from musegl_cuda.executor import TorchExecutor
from musegl_cuda.sampling import SampleRows, filter_logits, sample

BLOCK = 4  # small blocks, so short prompts span several of them
TOL = 1e-5


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ex(tiny_hf) -> TorchExecutor:
    executor = TorchExecutor(load_checkpoint(tiny_hf.path), device="cpu", block_size=BLOCK)
    executor.allocate_kv(64)
    return executor


def test_protocol_info_and_kv_shapes(ex, tiny_hf):
    assert isinstance(ex, Executor)
    assert ex.info.backend == "torch-cpu" and ex.info.dtype == "float32"
    assert (ex.info.vocab_size, ex.info.hidden_size, ex.info.num_layers) == (512, 64, 6)
    assert ex.info.native_context == 4096
    assert ex.kv_bytes_per_block() == 6 * 2 * BLOCK * 2 * 16 * 4
    assert len(ex.k_cache) == 6 and ex.k_cache[0].shape == (64, BLOCK, 2, 16) == ex.v_cache[5].shape


def test_non_contiguous_blocks_and_decode_across_steps(ex, tiny_hf):
    prompt = ids(1, 21)
    with torch.no_grad():
        ref = tiny_hf.model(input_ids=torch.tensor([prompt])).logits[0]
    scattered = [40, 3, 17, 9, 61, 22]  # 6 blocks of 4 cover 24 positions
    out = ex.step(Step([chunk(1, prompt[:13], 0, scattered, want_logits=True)]))
    assert torch.allclose(out.logits[1], ref[12], atol=TOL)
    for p in range(13, 21):  # decode one token at a time, reading K/V written by earlier steps
        out = ex.step(Step([chunk(1, [prompt[p]], p, scattered, want_logits=True)]))
        assert torch.allclose(out.logits[1], ref[p], atol=TOL), p


def test_copy_blocks_copies_every_layer(ex):
    prompt = ids(2, 8)
    first = ex.step(Step([chunk(2, prompt, 0, [30, 31], want_logits=True)]))
    ex.copy_blocks([(30, 50), (31, 51)])
    for layer in range(6):
        assert torch.equal(ex.k_cache[layer][50], ex.k_cache[layer][30])
        assert torch.equal(ex.v_cache[layer][51], ex.v_cache[layer][31])
    nxt = ids(3, 1)
    a = ex.step(Step([chunk(2, nxt, 8, [30, 31, 32], want_logits=True)]))
    b = ex.step(Step([chunk(4, nxt, 8, [50, 51, 52], want_logits=True)]))  # reads the copies
    assert torch.equal(a.logits[2], b.logits[4])
    assert first.logits[2].shape == (512,)


def test_logits_and_tokens_only_where_asked(ex):
    step = Step([
        chunk(10, ids(4, 5), 0, [0, 1]),                                   # prefill, nothing wanted
        chunk(11, ids(5, 3), 0, [2], sample=True),                         # token only
        chunk(12, ids(6, 6), 0, [4, 5], want_logits=True),                 # last-row logits only
        chunk(13, ids(7, 7), 0, [6, 7], logit_rows=True, sample=True),     # every row, and a token
    ])
    out = ex.step(step)
    assert set(out.tokens) == {11, 13} and set(out.logits) == {12, 13} and out.hidden == {}
    assert out.logits[12].shape == (512,) and out.logits[12].dtype == torch.float32
    assert out.logits[13].shape == (7, 512)
    assert out.tokens[13] == [int(torch.argmax(out.logits[13][-1]))]


def _sample_run(ex, seq, seed, others: bool, n: int = 6) -> list[int]:
    """Prefill and sample ``n`` tokens for ``seq``, optionally packed with other sequences."""
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed)
    base = 8 * (seq % 7)
    blocks = [base + i for i in range(4)]
    prompt = ids(8, 6)
    tokens, pos, step_tokens = [], 0, prompt
    for i in range(n):
        chunks = [chunk(seq, step_tokens, pos, blocks, sample=True, sampling=params)]
        if others:
            other = seq + 100
            chunks.insert(0, chunk(other, ids(9 + i, 2), 2 * i, [56, 57, 58, 59], sample=True,
                                   sampling=SamplingParams(temperature=1.5, seed=i)))
        out = ex.step(Step(chunks))
        pos += len(step_tokens)
        assert len(out.tokens[seq]) == 1
        tokens.append(out.tokens[seq][0])
        step_tokens = [tokens[-1]]
    ex.release_sequence(seq)
    ex.release_sequence(seq + 100)
    return tokens


def test_seeded_sampling_is_independent_of_batch(ex):
    alone = _sample_run(ex, 20, seed=1234, others=False)
    packed = _sample_run(ex, 21, seed=1234, others=True)
    assert alone == packed
    different = _sample_run(ex, 22, seed=99, others=False)
    assert different != alone  # 6 draws over a flattened distribution collide with vanishing odds


def test_top_k_one_equals_greedy(ex):
    prompt = ids(10, 9)
    g = ex.step(Step([chunk(30, prompt, 0, [8, 9, 10], sample=True, sampling=GREEDY)]))
    k = ex.step(Step([chunk(31, prompt, 0, [11, 12, 13], sample=True,
                            sampling=SamplingParams(temperature=0.8, top_k=1, seed=3))]))
    assert g.tokens[30] == k.tokens[31] and len(g.tokens[30]) == 1


def rows_of(params, uniforms):
    rows = SampleRows()
    for p, u in zip(params, uniforms):
        rows.params.append(p)
        rows.uniforms.append(u)
        rows.masks.append(None)
        rows.counted.append(((), 0))
        rows.logprobs.append(-1)
    return rows


def test_sampler_filters_and_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5]])
    assert sample(logits, rows_of([GREEDY], [0.3]))[0] == [1]  # lowest index wins ties
    z = filter_logits(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), [SamplingParams(top_k=2)])
    assert torch.isinf(z[0, 2:]).all() and torch.isfinite(z[0, :2]).all()
    z = filter_logits(torch.tensor([[5.0, 0.0, 0.0, 0.0]]), [SamplingParams(top_p=0.5)])
    assert torch.isfinite(z[0, 0]) and torch.isinf(z[0, 1:]).all()
    z = filter_logits(torch.tensor([[2.0, 1.0, -3.0]]), [SamplingParams(min_p=0.2)])
    assert torch.isfinite(z[0, :2]).all() and torch.isinf(z[0, 2])  # e^-5 < 0.2 of the top
    # Inverse CDF over ids in order: u below the first id's mass picks it, above picks the next.
    row = torch.tensor([[0.0, 0.0, -30.0]])
    draws = [sample(row, rows_of([SamplingParams(seed=5)], [u]))[0][0] for u in (0.1, 0.49, 0.51, 0.99)]
    assert draws == [0, 0, 1, 1]


def test_processors_bias_penalties_and_masks_are_applied_batched():
    import numpy as np

    logits = torch.zeros(3, 40)
    logits[:, 7] = 1.0
    rows = rows_of([GREEDY, SamplingParams(temperature=0.0, logit_bias=((9, 5.0),)),
                    SamplingParams(temperature=0.0, frequency_penalty=2.0)], [0.5] * 3)
    rows.counted[2] = ([7, 7, 7], 1)  # id 7 generated twice (the first 7 is prompt)
    mask = np.zeros(2, dtype=np.uint32)
    mask[0] = 1 << 3  # only id 3 allowed
    rows.masks[0] = mask
    ids, _ = sample(logits, rows)
    assert ids[0] == 3 and ids[1] == 9 and ids[2] == 0  # 7 penalized to 1 - 2*2 < 0


def test_taps_shape_and_values(ex, tiny_hf):
    prompt = ids(11, 10)
    out = ex.step(Step([chunk(40, prompt, 0, [14, 15, 16]), chunk(41, prompt[:3], 0, [17])], taps=(0, 2, 5)))
    assert out.hidden[40].shape == (3, 10, 64) and out.hidden[41].shape == (3, 3, 64)
    with torch.no_grad():
        ref = tiny_hf.model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for i, layer in enumerate((0, 2, 5)):  # input residual of layer k == transformers hidden_states[k]
        assert torch.allclose(out.hidden[40][i], ref[layer][0], atol=TOL), layer


def test_bad_steps_are_rejected(ex):
    with pytest.raises(ValueError, match="block table"):
        ex.step(Step([chunk(50, ids(12, 9), 0, [1, 2])]))
    with pytest.raises(ValueError, match="vocabulary"):
        ex.step(Step([chunk(50, [600], 0, [1])]))


def test_plugin_specs_and_factory(tiny_gguf):
    from musegl_cuda import plugin

    specs = {s.name: s for s in plugin.musegl_executors()}
    assert set(specs) == {"cuda", "torch-cpu"}
    assert specs["cuda"].priority == 100 and specs["torch-cpu"].priority == 10
    assert specs["torch-cpu"].available() is True
    assert specs["cuda"].available() == torch.cuda.is_available()
    calls = []
    executor = specs["torch-cpu"].create(ExecutorOptions(model=str(tiny_gguf),
                                                          progress=lambda d, t, w: calls.append((d, t))))
    assert executor.info.backend == "torch-cpu" and executor.info.name == "Tiny Muse Glimmer"
    assert calls[-1] == (3 + 6 * 12, 3 + 6 * 12)
    executor.close()


def test_embedding_rows_replace_the_token_embedding(ex):
    from musegl_core.engine.executor import EmbeddingSpan

    prompt = ids(13, 12)
    plain = ex.step(Step([chunk(60, prompt, 0, [20, 21, 22], logit_rows=True)]))
    with torch.inference_mode():
        rows = ex.model.embed(torch.tensor(prompt[3:8]))  # what the table would give, already normed
    placeholder = [0 if 3 <= i < 8 else t for i, t in enumerate(prompt)]
    spanned = ex.step(Step([chunk(61, placeholder, 0, [23, 24, 25], logit_rows=True,
                                  embeds=[EmbeddingSpan(3, 5, rows)])]))
    assert torch.allclose(spanned.logits[61], plain.logits[60], atol=TOL)
    # A span that starts inside the embedding (a chunk boundary split the image).
    first = ex.step(Step([chunk(62, placeholder[:5], 0, [26, 27, 28], embeds=[EmbeddingSpan(3, 2, rows)])]))
    rest = ex.step(Step([chunk(62, placeholder[5:], 5, [26, 27, 28], logit_rows=True,
                               embeds=[EmbeddingSpan(0, 3, rows, first=2)])]))
    assert not first.tokens and torch.allclose(rest.logits[62], plain.logits[60][5:], atol=TOL)


def test_sampling_every_row_of_a_verify_block(ex):
    prompt = ids(14, 9)
    out = ex.step(Step([chunk(63, prompt, 0, [29, 30, 31], logit_rows=True, sample=4)]))
    assert out.tokens[63] == out.logits[63][-4:].argmax(dim=-1).tolist()
    seeded = SamplingParams(temperature=1.0, seed=11)
    again = [ex.step(Step([chunk(64 + i, prompt, 0, [32 + 3 * i, 33 + 3 * i, 34 + 3 * i], sample=4,
                                 sampling=seeded)])).tokens[64 + i] for i in range(2)]
    assert again[0] == again[1] and len(again[0]) == 4
    # The draw at a position is the same whether it is the last row or inside a block.
    single = ex.step(Step([chunk(70, prompt[:6], 0, [40, 41, 42], sample=1, sampling=seeded)])).tokens[70]
    assert single == again[0][:1]
