"""The sampler graphs' staging and chain (musegl_cuda.cuda.sampling_graphs) on the CPU.

The chain a sampler graph captures (:func:`sample_static`) runs eagerly here
over the same staged buffers, and must give exactly what the eager sampler
(:func:`musegl_cuda.sampling.choose`) gives on the same logits: the ids (the
same position-keyed draws) and the log-probabilities. ``-m gpu`` tests in
test_gpu.py check the captured graphs against the eager path on the device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from musegl_core.engine.executor import GREEDY, SamplingParams, SeqChunk, Step
from musegl_core.engine.randomness import uniform
from musegl_core.engine.sample_rows import SampleRows
from musegl_core.testing.reference_sampler import RowContext, row_logprobs, sample_row
from musegl_cuda.cuda.graphs import DecodeGraphs
from musegl_cuda.sampling import choose, top_logprobs
from musegl_cuda.cuda.sampling_graphs import (TOP_LOGPROBS, SamplerGraphs, SamplerInputs, SamplerVariant,
                                         penalty_entries)

VOCAB = 300
BS = 4


def packed_mask(allowed) -> np.ndarray:
    bits = np.zeros(-(-VOCAB // 32) * 32, dtype=bool)
    bits[np.asarray(allowed)] = True
    return np.packbits(bits, bitorder="little").view(np.uint32)


PARAMS = [
    GREEDY,
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=5, seed=2),
    SamplingParams(top_p=0.7, seed=3),
    SamplingParams(min_p=0.1, temperature=1.3, seed=4),
    SamplingParams(temperature=0.0, logit_bias=((3, 5.0), (7, -2.0))),
    SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, seed=5),
    SamplingParams(temperature=0.0, repetition_penalty=0.7),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, seed=6, logit_bias=((11, 3.0),)),
]


def random_chunks(rng, n: int, special: bool = True) -> list[SeqChunk]:
    chunks = []
    for i in range(n):
        p = PARAMS[rng.integers(len(PARAMS))] if special else SamplingParams(temperature=0.9, seed=i)
        pos = int(rng.integers(5, 60))
        masked = special and rng.random() < 0.4
        history = list(rng.integers(0, VOCAB, pos)) if p.penalized else ()
        chunks.append(SeqChunk(i, [int(rng.integers(VOCAB))], [pos], [0] * 16, sample=1, sampling=p,
                               uniforms=[uniform(p.seed or 0, pos + 1)],
                               masks=[packed_mask(rng.choice(VOCAB, 25, replace=False))] if masked else (),
                               history=history, prompt_len=pos // 2,
                               logprobs=int(rng.choice([-1, 0, 3, TOP_LOGPROBS])) if special else -1))
    return chunks


def sampler(widths=(4, 8)) -> SamplerGraphs:
    decode = DecodeGraphs(None, torch.zeros(1), widths, BS, 8, 16, 1)  # a CPU-built instance: staging only
    return SamplerGraphs(decode, VOCAB)


def eager(logits: torch.Tensor, step: Step):
    return choose(logits[:step.num_tokens].clone(), SampleRows.of(step)).lists()


def test_sampler_chain_gives_the_eager_sampler_s_ids_and_logprobs_step_after_step():
    rng = np.random.default_rng(7)
    graphs = sampler()
    for k in range(12):
        width = (4, 8)[k % 2]
        n = int(rng.integers(1, width + 1))
        # every third step has only plain temperature rows: the staged masks, bias and penalties
        # of the step before must be gone from the device buffers
        step = Step(random_chunks(rng, n, special=k % 3 != 2), width=width)
        logits = torch.randn(width, VOCAB) * 4
        graphs.decode.logits[width] = logits
        launched = graphs.launch(step, list(range(n)), width, {i: i for i in range(n)})
        assert launched is not None
        out = launched.result()
        ids, logprobs = eager(logits, step)
        assert [out.tokens[ch.seq][0] for ch in step.chunks] == ids
        assert graphs.out.ids[:n].tolist() == ids  # what a following row reads
        for ch, want in zip(step.chunks, logprobs):
            if ch.logprobs < 0:
                assert ch.seq not in out.logprobs
            else:
                assert out.logprobs[ch.seq][0] == want


def test_sampler_chain_draws_what_the_reference_sampler_draws():
    rng = np.random.default_rng(11)
    graphs = sampler((8,))
    for _ in range(4):
        step = Step(random_chunks(rng, 8), width=8)
        logits = torch.randn(8, VOCAB) * 3
        graphs.decode.logits[8] = logits
        out = graphs.launch(step, list(range(8)), 8, None).result()
        for ch, row in zip(step.chunks, logits.numpy()):
            ctx = RowContext(ch.uniforms[0], ch.masks[0] if ch.masks else None,
                             list(ch.history) + list(ch.tokens), ch.prompt_len)
            chosen = sample_row(row, ch.sampling, ctx)
            assert out.tokens[ch.seq] == [chosen]
            if ch.logprobs >= 0:
                ref = row_logprobs(row, ch.sampling, chosen, ch.logprobs, ctx)
                got = out.logprobs[ch.seq][0]
                assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
                assert got.top_ids == ref.top_ids


def test_top_logprobs_breaks_ties_by_the_lowest_id():
    lp = torch.tensor([[-1.0, -2.0, -1.0, float("-inf"), -0.5, float("-inf"), -2.0, 0.0, -0.0]])
    ids, values = top_logprobs(lp, 9)
    assert ids.tolist() == [[7, 8, 4, 0, 2, 1, 6, 3, 5]]
    assert values.tolist()[0][:4] == [0.0, 0.0, -0.5, -1.0]
    rows = torch.randn(5, 1000)
    ids, values = top_logprobs(rows, 20)
    assert torch.equal(values, torch.topk(rows, 20).values)


def test_staging_sends_only_the_regions_in_use_and_clears_them_after():
    rng = np.random.default_rng(3)
    inputs = SamplerInputs(8, VOCAB, torch.device("cpu"))
    plain = Step([SeqChunk(0, [1], [4], [0, 0], sample=1, sampling=SamplingParams(temperature=0.5, seed=1),
                           uniforms=[0.25])])
    assert inputs.stage(SampleRows.of(plain), 4)
    assert inputs.copies == ["params"]
    masked = Step([SeqChunk(0, [1], [4], [0, 0], sample=1, masks=[packed_mask([3, 4])],
                            sampling=SamplingParams(temperature=0.0, logit_bias=((5, 1.0),)))])
    assert inputs.stage(SampleRows.of(masked), 4)
    assert inputs.copies == ["params", "bias", "masks"]
    assert inputs.masks[0, 0].item() == 0b11000 and inputs.bias[0].tolist()[:2] == [0, 5]
    assert inputs.stage(SampleRows.of(plain), 4)  # the device still held a mask and a bias: cleared
    assert inputs.copies == ["params", "bias", "masks"]
    assert (inputs.masks == -1).all() and (inputs.bias[:, 0] == -1).all()
    assert inputs.stage(SampleRows.of(plain), 4)
    assert inputs.copies == ["params"]
    penalized = Step(random_chunks(rng, 3, special=False))
    penalized.chunks[1] = SeqChunk(1, [9], [6], [0, 0], sample=1, history=[1, 2, 2, 9, VOCAB + 1, 1],
                                   prompt_len=2, sampling=SamplingParams(frequency_penalty=1.0, seed=2))
    rows = SampleRows.of(penalized)
    r, c, v = penalty_entries(rows, VOCAB)
    # ids 1, 2, 9 seen (the chunk's own token 9 counted); generated after the prompt: 2, 9, 1, 9
    assert r.tolist() == [1, 1, 1] and c.tolist() == [1, 2, 9] and v.tolist() == [1.0, 1.0, 2.0]
    assert inputs.stage(rows, 4)
    assert inputs.copies == ["params", "penalties"]
    assert inputs.penalties[:4, 0].tolist() == [1, 1, 1, -1]


def test_staging_refuses_what_the_graphs_cannot_hold():
    inputs = SamplerInputs(4, VOCAB, torch.device("cpu"), bias_entries_cap=2, penalty_entries_cap=3)

    def rows(**kw) -> SampleRows:
        extra = {k: kw.pop(k) for k in ("logprobs", "history") if k in kw}
        return SampleRows.of(Step([SeqChunk(0, [1], [4], [0, 0], sample=1, sampling=SamplingParams(**kw),
                                            **extra)]))

    assert not inputs.stage(rows(logprobs=TOP_LOGPROBS + 1), 4)
    assert inputs.stage(rows(logprobs=TOP_LOGPROBS), 4)
    assert not inputs.stage(rows(logit_bias=((1, 1.0), (2, 1.0), (3, 1.0))), 4)
    assert inputs.stage(rows(logit_bias=((1, 1.0), (2, 1.0))), 4)
    assert not inputs.stage(rows(presence_penalty=1.0, history=[5, 6, 7]), 4)  # 5, 6, 7 and the token 1
    assert inputs.stage(rows(presence_penalty=1.0, history=[5, 5, 1]), 4)
    five = SampleRows.of(Step(random_chunks(np.random.default_rng(0), 5, special=False)))
    assert not inputs.stage(five, 4)


def test_the_variant_names_the_parts_a_step_needs():
    def variant(*params: SamplingParams, logprobs: int = -1) -> SamplerVariant:
        step = Step([SeqChunk(i, [1], [4], [0, 0], sample=1, sampling=p, logprobs=logprobs)
                     for i, p in enumerate(params)])
        return SamplerVariant.of(SampleRows.of(step), VOCAB)

    assert variant(GREEDY, SamplingParams(temperature=0.0, top_p=0.5)) == SamplerVariant()
    assert variant(SamplingParams(temperature=0.7)) == SamplerVariant(draw=True)
    assert variant(SamplingParams(temperature=0.7, top_k=VOCAB)) == SamplerVariant(draw=True)
    assert variant(GREEDY, SamplingParams(top_k=3)) == SamplerVariant(draw=True, sort=True)
    assert variant(SamplingParams(top_p=0.9), logprobs=0) == SamplerVariant(True, True, True)
    assert len(set(SamplerVariant.every())) == 6


def test_multi_row_chunks_of_a_verify_step_sample_like_the_eager_sampler():
    """Rows of decode-only chunks of several rows (drafts being verified) keep their
    order, masks per row and the penalty ids up to each row; a step with a row that
    asks for logits is left to the eager sampler."""
    rng = np.random.default_rng(5)
    graphs = sampler((8,))
    warm = SamplingParams(temperature=0.9, top_p=0.8, seed=12)
    pen = SamplingParams(temperature=0.0, presence_penalty=2.0, logit_bias=((11, 2.0),))
    step = Step([SeqChunk(0, [4, 5, 6], [10, 11, 12], [0] * 4, sample=3, sampling=warm,
                          uniforms=[uniform(12, 11 + j) for j in range(3)],
                          masks=[packed_mask(rng.choice(VOCAB, 30, replace=False)) for _ in range(3)], logprobs=2),
                 SeqChunk(1, [7, 8], [20, 21], [0] * 6, sample=2, sampling=pen, history=[7, 7, 9], prompt_len=1,
                          logprobs=0)], width=8)
    logits = torch.randn(8, VOCAB) * 4
    graphs.decode.logits[8] = logits
    out = graphs.launch(step, [0, 3], 8, None).result()
    ids, lps = eager(logits, step)
    assert out.tokens == {0: ids[:3], 1: ids[3:]}
    assert out.logprobs == {0: lps[:3], 1: lps[3:]}
    wants = Step([SeqChunk(0, [4], [10], [0] * 4, sample=1, sampling=warm, want_logits=True)], width=8)
    assert graphs.launch(wants, [0], 8, None) is None


def test_penalty_entries_count_short_and_long_histories_alike():
    """The distinct counted ids and their generated counts, by sorting (a history short
    against the vocabulary) or by counting over the vocabulary (a long one)."""
    rng = np.random.default_rng(4)
    for n in (5, VOCAB // 16 - 1, VOCAB // 16, 4 * VOCAB):
        history = rng.integers(-3, VOCAB + 3, size=n).tolist()
        step = Step([SeqChunk(0, [7], [n], [0], sample=1, history=history, prompt_len=n // 3,
                              sampling=SamplingParams(presence_penalty=1.0))])
        rows = SampleRows.of(step)
        r, c, v = penalty_entries(rows, VOCAB)
        ids = np.asarray(history + [7])
        inside = ids[(ids >= 0) & (ids < VOCAB)]
        assert c.tolist() == sorted(set(inside.tolist())) and (r == 0).all()
        gen = ids[n // 3:]
        gen = gen[(gen >= 0) & (gen < VOCAB)]
        assert v.tolist() == [float((gen == i).sum()) for i in c]


def test_penalized_sequences_count_on_the_device_step_after_step():
    """Penalized one-row chunks keep their counts in a device slot and add only the ids
    counted since their last step; a rewound history, a sequence back after losing
    its slot and a released one are counted again; every step samples as the eager
    sampler does."""
    rng = np.random.default_rng(12)
    graphs = sampler((4,))
    counts = graphs.counts
    params = [SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, seed=1),
              SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4),
              SamplingParams(temperature=1.1, top_k=30, presence_penalty=1.5, seed=3),
              SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=0.2),
              SamplingParams(temperature=0.9, frequency_penalty=1.0, seed=5),
              SamplingParams(temperature=0.6, top_p=0.9)]  # not penalized
    histories = {s: rng.integers(0, VOCAB, size=int(rng.integers(3, 40))).tolist() for s in range(6)}
    prompts = {s: len(h) // 2 for s, h in histories.items()}
    token = {s: int(rng.integers(VOCAB)) for s in range(6)}

    def step_of(seqs):
        chunks = [SeqChunk(s, [token[s]], [len(histories[s])], [0] * 16, sample=1, sampling=params[s],
                           uniforms=[uniform(params[s].seed or 0, len(histories[s]) + 1)],
                           history=list(histories[s]) if params[s].penalized else (), prompt_len=prompts[s])
                  for s in seqs]
        return Step(chunks, width=4)

    def run(seqs):
        step = step_of(seqs)
        logits = torch.randn(4, VOCAB)
        logits[:, :12] += 4.0  # a few likely ids: they repeat, and the penalties move the picks
        graphs.decode.logits[4] = logits
        out = graphs.launch(step, list(range(len(seqs))), 4, None).result()
        ids, _ = eager(logits, step)
        assert [out.tokens[s][0] for s in seqs] == ids
        for s, t in zip(seqs, ids):
            histories[s].append(token[s])
            token[s] = t

    for _ in range(5):
        run([0, 1, 2, 5])
    assert counts.recounted == 3  # each penalized sequence counted its whole history once
    del histories[1][-3:]  # sequence 1 rewound: counted again
    run([0, 1, 2, 5])
    assert counts.recounted == 4
    for _ in range(3):  # sequences 3 and 4 take the slots of the least recently used
        run([3, 4, 2, 5])
    assert counts.recounted == 6
    run([0, 1, 3, 4])  # 0 lost its slot to 4; it takes 2's (the one sequence not in this step)
    assert counts.recounted == 7
    graphs.release(3)
    run([3, 0, 1, 4])  # 3 is counted again in the slot it gave back
    assert counts.recounted == 8
    run([0, 1, 2, 3])  # four penalized rows, four slots: 2 takes 4's
    assert counts.recounted == 9
