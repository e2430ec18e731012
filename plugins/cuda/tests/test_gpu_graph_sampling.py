"""Sampler graphs and long contexts on a CUDA GPU (marked ``gpu``; run with ``-m gpu``).

* Rows that are not plain greedy (grammar masks, read from the mask workers'
  pending results; ``logit_bias``; penalties; temperature, top-k, top-p,
  min-p; logprobs) in decode graph steps are sampled by the sampler graphs
  (:mod:`musegl_cuda.cuda.sampling_graphs`) and give exactly the ids and
  log-probabilities of the eager sampler on the same logits, and of an
  executor without graphs.
* 32k-token contexts: graph decode steps (long block tables kept on the
  device, split attention) give exactly the dynamic path's greedy ids, and
  the float32 graph path agrees with the per-sequence torch path.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 4096


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory):
    from musegl_core.checkpoint.config import TextConfig
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.hf_reader import expected_shape, text_weight_names
    from musegl_core.testing.reference_models import tiny_tokenizer_data

    layout = TextConfig.default_layout(8)
    config = TextConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_layers=8, num_heads=8,
                        num_kv_heads=2, head_dim=64, sliding_window=128, sliding=layout, rope=layout,
                        bos_token_id=1, eos_token_ids=(2,), max_position_embeddings=40960)
    rng = np.random.default_rng(0)
    weights = {}
    for name in text_weight_names(config):
        shape = expected_shape(config, name)
        scale = 0.1 if name.endswith("layernorm.weight") else 0.05
        weights[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
        if name == "norm.weight":
            weights[name] += 1
    path = tmp_path_factory.mktemp("gpu_sampling") / "model.gguf"
    write_text_gguf(path, config, weights, tiny_tokenizer_data(VOCAB), file_type="f32")
    return path


def packed(allowed) -> np.ndarray:
    bits = np.zeros(VOCAB, dtype=bool)
    bits[np.asarray(allowed)] = True
    return np.packbits(bits, bitorder="little").view(np.uint32)


def test_constrained_penalized_and_logprobs_rows_in_graph_steps_match_the_eager_sampler(checkpoint_path):
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import GREEDY, SamplingParams, SeqChunk, Step
    from musegl_core.engine.masks import MaskClock, MaskWorkers
    from musegl_core.engine.randomness import uniform
    from musegl_core.engine.sample_rows import SampleRows
    from musegl_cuda.executor import TorchExecutor
    from musegl_cuda.sampling import choose
    from musegl_cuda.cuda.sampling_graphs import GraphSampled

    params = [
        GREEDY,                                                      # with a grammar mask
        SamplingParams(temperature=0.0, logit_bias=((5, 4.0), (9, -3.0))),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3),          # with a grammar mask
        SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.3,
                       seed=4),
        SamplingParams(temperature=0.7, min_p=0.05, seed=5),         # logprobs 5
        SamplingParams(temperature=1.1, top_k=20, seed=6),           # logprobs 20
        GREEDY,                                                      # plain
        SamplingParams(temperature=0.0, repetition_penalty=1.5),     # greedy with a penalty, logprobs 0
    ]
    logprobs = [-1, 0, 3, -1, 5, 20, -1, 0]
    rng = np.random.default_rng(8)
    # as many sequences as the width: the graph and the graph-less executor multiply the same row counts
    prompts = [rng.integers(4, VOCAB, size=n).tolist() for n in (17, 33, 40, 51, 64, 70, 90, 23)]
    forced = rng.integers(4, VOCAB, size=(len(prompts), 30)).tolist()
    workers = MaskWorkers(2, MaskClock())
    graph = TorchExecutor(load_checkpoint(checkpoint_path), device="cuda", dtype="bfloat16")
    plain = TorchExecutor(load_checkpoint(checkpoint_path), device="cuda", dtype="bfloat16", forward_sizes=())
    for ex in (graph, plain):
        ex.allocate_kv(16 * len(prompts))
        assert (ex.samplers is not None) == (ex is graph)
    assert graph.samplers.graphs  # captured
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
    for ex in (graph, plain):
        ex.step(Step([SeqChunk(i, p, list(range(len(p))), tables[i]) for i, p in enumerate(prompts)]))

    allowed: dict[int, set[int]] = {}

    def chunk(i, s, pending_masks):
        pos = len(prompts[i]) + s
        p = params[i]
        history = (prompts[i] + forced[i][:s]) if p.penalized else ()
        masks = ()
        if i in (0, 2):
            ids = rng.choice(VOCAB, 200, replace=False)
            allowed[i] = set(ids.tolist())
            masks = pending_masks(packed(ids)) if s % 2 else [packed(ids)]  # odd steps: from a mask worker
        return SeqChunk(i, [forced[i][s]], [pos], tables[i], sample=1, sampling=p, uniforms=[uniform(p.seed or 0,
                        pos + 1)], masks=masks, history=history, prompt_len=len(prompts[i]), logprobs=logprobs[i])

    for s in range(30):
        chunks = [chunk(i, s, lambda m: workers.submit(lambda: [m], 1)) for i in range(len(prompts))]
        step = Step(chunks, width=8)
        pending = graph.launch(step)
        assert isinstance(pending, GraphSampled)
        got = pending.result()
        eager_ids, eager_lps = choose(graph.graphs.logits[8][:len(chunks)].clone(), SampleRows.of(step)).lists()
        want = plain.step(step)
        assert got.tokens == want.tokens
        assert [got.tokens[i][0] for i in range(len(chunks))] == eager_ids
        assert got.logprobs == want.logprobs
        for i, ch in enumerate(chunks):
            if ch.logprobs >= 0:
                assert got.logprobs[i][0] == eager_lps[i]
        assert all(got.tokens[i][0] in allowed[i] for i in (0, 2))
    workers.close()
    for ex in (graph, plain):
        ex.close()


def test_verify_shaped_steps_with_constrained_rows_sample_in_graphs(checkpoint_path):
    """Decode-only steps of multi-row chunks (drafts being verified: staged by plan)
    sample their masked, warm and logprobs rows in the sampler graph, exactly as the
    eager sampler does on the same logits."""
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SamplingParams, SeqChunk, Step
    from musegl_core.engine.randomness import uniform
    from musegl_core.engine.sample_rows import SampleRows
    from musegl_cuda.executor import TorchExecutor
    from musegl_cuda.sampling import choose
    from musegl_cuda.cuda.sampling_graphs import GraphSampled

    rng = np.random.default_rng(9)
    prompts = [rng.integers(4, VOCAB, size=n).tolist() for n in (20, 45)]
    ex = TorchExecutor(load_checkpoint(checkpoint_path), device="cuda", dtype="bfloat16")
    ex.allocate_kv(32)
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(2)]
    ex.step(Step([SeqChunk(i, p, list(range(len(p))), tables[i]) for i, p in enumerate(prompts)]))
    warm = SamplingParams(temperature=0.9, top_p=0.8, seed=12)
    biased = SamplingParams(temperature=0.0, logit_bias=((11, 2.0),), presence_penalty=0.5)
    for s in range(8):
        chunks = []
        for i, p in enumerate((warm, biased)):
            start = len(prompts[i]) + 4 * s
            masks = [packed(rng.choice(VOCAB, 300, replace=False)) for _ in range(4)] if i == 0 else ()
            chunks.append(SeqChunk(i, rng.integers(4, VOCAB, size=4).tolist(), list(range(start, start + 4)),
                                   tables[i], sample=4, sampling=p,
                                   uniforms=[uniform(p.seed or 0, start + j + 1) for j in range(4)], masks=masks,
                                   history=prompts[i] if p.penalized else (), prompt_len=len(prompts[i]),
                                   logprobs=2))
        step = Step(chunks, width=8)
        pending = ex.launch(step)
        assert isinstance(pending, GraphSampled)
        got = pending.result()
        ids, lps = choose(ex.graphs.logits[8][:8].clone(), SampleRows.of(step)).lists()
        assert got.tokens == {0: ids[:4], 1: ids[4:]}
        assert got.logprobs == {0: lps[:4], 1: lps[4:]}
    ex.close()


def prefill_chunked(ex, seq, prompt, table, chunk=4096):
    from musegl_core.engine.executor import SeqChunk, Step

    for lo in range(0, len(prompt), chunk):
        part = prompt[lo:lo + chunk]
        last = lo + len(part) == len(prompt)
        ex.step(Step([SeqChunk(seq, part, list(range(lo, lo + len(part))), table, sample=int(last))]))


def long_decode(checkpoint_path, dtype, sizes, paged=True, steps=16):
    """Two sequences (32,800 and 1,000 positions) prefilled in chunks, then ``steps``
    teacher-forced decode steps together: each step's argmax ids and logits."""
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.executor import TorchExecutor

    rng = np.random.default_rng(21)
    prompts = [rng.integers(4, VOCAB, size=n).tolist() for n in (32800, 1000)]
    forced = rng.integers(4, VOCAB, size=(2, steps)).tolist()
    per_seq = -(-(32800 + steps + 1) // 16)
    ex = TorchExecutor(load_checkpoint(checkpoint_path), device="cuda", dtype=dtype, forward_sizes=sizes)
    if not paged:
        ex.paged = False  # the per-sequence torch path on the GPU
    ex.allocate_kv(2 * per_seq)
    # the blocks of each table in a scattered order, as a pool that served other sequences gives them
    order = rng.permutation(2 * per_seq).tolist()
    tables = [order[:per_seq], order[per_seq:]]
    for i, p in enumerate(prompts):
        prefill_chunked(ex, i, p, tables[i])
    ids, logits = [], []
    for s in range(steps):
        step = Step([SeqChunk(i, [forced[i][s]], [len(p) + s], tables[i], sample=1, want_logits=True)
                     for i, p in enumerate(prompts)], width=2)
        out = ex.step(step)
        ids.append([out.tokens[i][0] for i in range(2)])
        logits.append([out.logits[i].float().cpu() for i in range(2)])
    graphed = ex.graphs is not None
    ex.close()
    return ids, logits, graphed


def test_32k_contexts_decode_in_graphs_like_the_dynamic_and_per_sequence_paths(checkpoint_path):
    ids_graph, _, graphed = long_decode(checkpoint_path, "bfloat16", None)
    ids_dynamic, _, dynamic_graphed = long_decode(checkpoint_path, "bfloat16", ())
    assert graphed and not dynamic_graphed
    assert ids_graph == ids_dynamic
    ids32, logits32, _ = long_decode(checkpoint_path, "float32", None)
    ids_ref, logits_ref, _ = long_decode(checkpoint_path, "float32", (), paged=False)
    diff = max((a - b).abs().max().item() for sa, sb in zip(logits32, logits_ref) for a, b in zip(sa, sb))
    print(f"\n32k context, float32 graph decode vs the per-sequence torch path: max |logit diff| {diff:.2e}")
    assert diff <= 2e-3
    for got, want, ref_logits in zip(ids32, ids_ref, logits_ref):
        for g, w, row in zip(got, want, ref_logits):
            top2 = torch.topk(row, 2).values
            if (top2[0] - top2[1]).item() > 1e-2:  # a clear argmax: both paths must pick it
                assert g == w


def test_long_context_split_attention_matches_the_reference_on_the_gpu():
    """The compiled attention kernel at the 30B shape's heads over 32k keys, at the
    split counts of a global layer of batch 1 (``kernels.layer_splits``) and others."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_checks import check_long_decode_attention
    from musegl_cuda.cuda import kernels

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    splits = sorted({1, 16, *kernels.layer_splits(1, 2, sm), *kernels.layer_splits(4, 2, sm)})
    for dtype in (torch.float32, torch.bfloat16):
        check_long_decode_attention("cuda", dtype, heads=32, kv_heads=2, head_dim=128, keys=32768,
                                    splits=tuple(splits))
