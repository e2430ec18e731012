"""Tensor parallelism on the CPU (gloo): 2 and 4 ranks against one, on the tiny float32 model
(4 query heads, 2 KV heads: at 4 ranks each KV head is replicated on two ranks).

Every check compares :class:`TensorParallelExecutor` with a :class:`TorchExecutor` over the
same checkpoint: logits within 1e-4, greedy and seeded ids identical, taps, block copies,
the lent embedding and head, an image; a bad step is an error and the ranks carry on; a
rank killed mid-step fails the step (and every later call) at once, never a hang.
Spawning the ranks takes seconds per executor: the slow tier.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image
from step_support import chunk, decode_run

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.checkpoint.vision import load_vision
from musegl_core.engine.executor import EmbeddingSpan, SamplingParams, Step
from musegl_core.engine.request import ImageInput
from musegl_core.vision.preprocess import ImagePreprocessor
from musegl_cuda.executor import TorchExecutor
from musegl_cuda.parallel.executor import RankFailure, TensorParallelExecutor
from musegl_cuda.parallel.rank import RankSpec

pytestmark = pytest.mark.slow

BLOCK = 16
BLOCKS = 48
TOL = 1e-4


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def single(tiny_hf) -> TorchExecutor:
    checkpoint = load_checkpoint(tiny_hf.path)
    ex = TorchExecutor(checkpoint, device="cpu", block_size=BLOCK,
                       vision=load_vision(tiny_hf.path, None, checkpoint.config.hidden_size))
    ex.allocate_kv(BLOCKS)
    return ex


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def parallel(request, tiny_hf):
    ex = TensorParallelExecutor(RankSpec(str(tiny_hf.path), "cpu", request.param))
    ex.allocate_kv(BLOCKS)
    yield ex
    ex.close()


def both(single, parallel, step_of):
    """The same step (built twice: steps are consumed) on both executors."""
    return single.step(step_of()), parallel.step(step_of())


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= TOL


def test_the_ranks_report_the_models_info_and_split_the_cache(single, parallel):
    assert parallel.info == single.info and parallel.block_size == BLOCK
    size = parallel.spec.size
    # 2 ranks hold one KV head each; 4 ranks hold one each too (two ranks per KV head)
    assert parallel.loaded.kv_bytes_per_block == [single.kv_bytes_per_block() // 2] * size
    assert parallel.kv_bytes_per_block() == single.kv_bytes_per_block() * size // 2
    assert sum(parallel.weight_bytes.values()) < size * sum(single.weight_bytes.values())


def test_prefill_and_decode_logits_and_greedy_ids_match(single, parallel):
    prompt = ids(1, 37)
    scattered = [40, 3, 17]
    a, b = both(single, parallel, lambda: Step([chunk(1, prompt[:30], 0, scattered, logit_rows=True, sample=1)]))
    assert close(a.logits[1], b.logits[1]) and a.tokens == b.tokens
    for p in range(30, 37):
        a, b = both(single, parallel, lambda: Step([chunk(1, [prompt[p]], p, scattered, want_logits=True, sample=1)]))
        assert close(a.logits[1], b.logits[1]), p
        assert a.tokens == b.tokens


def test_a_packed_step_answers_what_each_chunk_asked(single, parallel):
    def step():
        return Step([chunk(10, ids(4, 5), 0, [0]), chunk(11, ids(5, 3), 0, [1], sample=True),
                     chunk(12, ids(6, 6), 0, [2], want_logits=True),
                     chunk(13, ids(7, 7), 0, [4], logit_rows=True, sample=True, logprobs=3)])
    a, b = both(single, parallel, step)
    assert a.tokens == b.tokens and set(a.logits) == set(b.logits) == {12, 13}
    assert all(close(a.logits[s], b.logits[s]) for s in a.logits)
    assert [x.top_ids for x in a.logprobs[13]] == [x.top_ids for x in b.logprobs[13]]


def sample_run(ex, seq, seed, n=8) -> list[int]:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed)
    blocks = [20 + seq % 4]
    step_tokens, pos, out = ids(8, 6), 0, []
    for _ in range(n):
        result = ex.step(Step([chunk(seq, step_tokens, pos, blocks, sample=True, sampling=params),
                               chunk(seq + 100, ids(pos, 1), pos, [30], sample=True,
                                     sampling=SamplingParams(temperature=1.5, seed=7))]))
        pos += len(step_tokens)
        out.append(result.tokens[seq][0])
        step_tokens = [out[-1]]
    return out


def test_seeded_sampling_draws_the_same_ids(single, parallel):
    assert sample_run(single, 1, 1234) == sample_run(parallel, 1, 1234)
    assert sample_run(single, 2, 99) == sample_run(parallel, 2, 99)


def test_block_copies_and_taps(single, parallel):
    prompt = ids(2, 20)
    for ex in (single, parallel):
        ex.step(Step([chunk(2, prompt, 0, [30, 31])]))
        ex.copy_blocks([(30, 40), (31, 41)])
    a, b = both(single, parallel, lambda: Step([chunk(4, ids(3, 2), 20, [40, 41], want_logits=True, sample=1)],
                                               taps=(1, 6)))
    assert close(a.logits[4], b.logits[4]) and a.tokens == b.tokens
    assert close(a.hidden[4], b.hidden[4])


def test_the_lent_embedding_and_head_are_the_whole_models(single, parallel):
    probe = np.array([[0, 5, 511], [300, 2, 7]], dtype=np.int64)
    assert close(single.embedding_rows(probe), parallel.embedding_rows(probe))
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    assert close(single.head_logits(hidden), parallel.head_logits(hidden))


def test_an_image_runs_on_the_replicated_tower(single, parallel):
    rng = np.random.default_rng(3)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(buffer, format="PNG")
    image = ImagePreprocessor(64).preprocess(ImageInput("image/png", base64.b64encode(buffer.getvalue()).decode()))
    rows_a, rows_b = single.embed_image(image), parallel.embed_image(image)
    assert close(rows_a, rows_b)
    n = rows_a.shape[0]
    tokens = ids(9, 4) + [0] * n + ids(10, 3)
    a = single.step(Step([chunk(5, tokens, 0, [44, 45], want_logits=True, sample=1,
                                embeds=(EmbeddingSpan(4, n, rows_a),))]))
    b = parallel.step(Step([chunk(5, tokens, 0, [44, 45], want_logits=True, sample=1,
                                  embeds=(EmbeddingSpan(4, n, rows_b),))]))
    assert close(a.logits[5], b.logits[5]) and a.tokens == b.tokens


def test_a_bad_step_is_an_error_and_the_ranks_carry_on(single, parallel):
    with pytest.raises(ValueError):
        parallel.step(Step([chunk(6, [5, 512], 0, [46])]))  # 512 is outside the vocabulary
    a, b = both(single, parallel, lambda: Step([chunk(6, [5, 6], 0, [46], want_logits=True)]))
    assert close(a.logits[6], b.logits[6])


def test_stored_weights_shard_onto_the_cpu_kernels(tiny_gguf):
    """--weights stored: each rank's rows and columns of the f32 GGUF run on the C kernels."""
    checkpoint = load_checkpoint(tiny_gguf)
    single = TorchExecutor(checkpoint, device="cpu", block_size=BLOCK, weights="stored")
    single.allocate_kv(8)
    parallel = TensorParallelExecutor(RankSpec(str(tiny_gguf), "cpu", 2, weights="stored"))
    try:
        assert set(parallel.weight_bytes) == {"f32"}  # stored matrices (upcast ones say "float32")
        parallel.allocate_kv(8)
        prompt = ids(11, 40)
        a, b = both(single, parallel, lambda: Step([chunk(1, prompt, 0, [0, 1, 2], want_logits=True, sample=1)]))
        assert close(a.logits[1], b.logits[1]) and a.tokens == b.tokens
        a, b = both(single, parallel, lambda: Step([chunk(1, [a.tokens[1][0]], 40, [0, 1, 2], want_logits=True,
                                                          sample=1)]))
        assert close(a.logits[1], b.logits[1]) and a.tokens == b.tokens
    finally:
        parallel.close()


def test_a_rank_killed_mid_step_fails_the_step_and_every_later_call(tiny_hf):
    failures: list[str] = []
    ex = TensorParallelExecutor(RankSpec(str(tiny_hf.path), "cpu", 2), on_failure=failures.append)
    try:
        ex.allocate_kv(BLOCKS)
        ex.step(Step([chunk(1, ids(1, 8), 0, [0], sample=1)]))
        prompt = ids(2, 700)  # a prefill long enough to be running when the rank dies
        pending = ex.launch(Step([chunk(2, prompt, 0, list(range(1, 45)), sample=1)]))
        os.kill(ex.loaded.pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1"):
            pending.result()
        assert time.monotonic() - started < 10
        with pytest.raises(RankFailure):
            ex.step(Step([chunk(3, [1], 0, [46], sample=1)]))
        deadline = time.monotonic() + 10  # the watcher stops the other rank, then reports
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(failures) == 1 and "rank 1" in failures[0] and "status -9" in failures[0]
        assert not any(p.is_alive() for p in ex.ranks)  # the other rank was stopped too
    finally:
        ex.close()


def test_a_rank_that_fails_to_load_fails_the_load_and_nothing_more(tiny_hf):
    failures: list[str] = []
    started = time.monotonic()
    with pytest.raises(RankFailure, match="exited with status 1"):
        TensorParallelExecutor(RankSpec(str(tiny_hf.path), "cpu", 2, weights="bogus"), on_failure=failures.append)
    assert failures == [] and time.monotonic() - started < 120


def pipelined_ids(ex, pipelined: bool, steps: int = 6) -> dict[int, list[int]]:
    """Two sequences (one greedy, one seeded) decoding ``steps`` steps; ``pipelined``: each step
    launched before the previous one is read, its chunks following that step's ids."""
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    return decode_run(ex, {s: ids(20 + s, 9 + s) for s in (0, 1)}, {0: [0], 1: [1]},
                      {0: {}, 1: {"sampling": seeded}}, steps, pipelined)


def test_ranks_of_an_asynchronous_executor_answer_launched_steps_in_order(tiny_hf, single):
    """--sync-steps off on the ranks (what CUDA does): a rank answers a launched step after it
    launched the next one; the ids are those of one process stepping synchronously."""
    ex = TensorParallelExecutor(RankSpec(str(tiny_hf.path), "cpu", 2, async_steps=True))
    try:
        assert ex.limits.async_steps
        ex.allocate_kv(BLOCKS)
        assert pipelined_ids(ex, pipelined=True) == pipelined_ids(single, pipelined=False)
    finally:
        ex.close()
