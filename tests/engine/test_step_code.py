"""The backend-neutral step code every executor calls (musegl_core/engine): the step
checks and their one set of messages, the sampler's host side, embedding-row
indexing, memory probing, the dtype table and the optional TargetAccess interface."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from musegl_core.engine.dtypes import COMPUTE_DTYPES, ITEMSIZE, backend_dtypes, dtype_name
from musegl_core.engine.embedding_rows import check_image_rows, embedding_rows
from musegl_core.engine.executor import (EmbeddingSpan, PromptImage, SamplingParams, SeqChunk, Step,
                                         contract_problems, target_access)
from musegl_core.engine.kv_sizing import kv_block_bytes
from musegl_core.engine.memory import available_ram
from musegl_core.engine.sample_rows import SampleRows, bias_entries, penalty_counts, unpack_mask, unpack_masks
from musegl_core.engine.step_checks import check_copy_pairs, check_step, check_taps, check_tokens, kv_allocated, table_of
from musegl_core.testing.example_executor import ExampleExecutor
from musegl_core.testing.reference_sampler import RowContext, processed_logits

VOCAB = 100
BS = 4


def chunk(tokens, first=0, blocks=(0, 1, 2), **kw) -> SeqChunk:
    return SeqChunk(7, list(tokens), list(range(first, first + len(tokens))), list(blocks), **kw)


# -- step checks ---------------------------------------------------------------------------
BAD_STEPS = {
    "positions": (Step([SeqChunk(7, [1, 2], [3, 5], [0, 1])]),
                  "sequence 7: chunk positions must be consecutive and >= 0"),
    "negative position": (Step([SeqChunk(7, [1], [-1], [0])]),
                          "sequence 7: chunk positions must be consecutive and >= 0"),
    "coverage": (Step([chunk([1, 2, 3], first=6, blocks=(0,))]),
                 "sequence 7: position 8 needs block 2 but its block table has 1 blocks"),
    "block ids": (Step([chunk([1, 2], blocks=(9,))]), "sequence 7: block ids must lie in 0..7"),
    "vocabulary": (Step([chunk([1, VOCAB])]), f"token id outside the vocabulary 0..{VOCAB - 1}"),
    "taps": (Step([chunk([1])], taps=(0, 3)), "tap 3 outside 0..2"),
}


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_each_check_has_one_message(case):
    step, message = BAD_STEPS[case]
    with pytest.raises(ValueError) as info:
        check_step(step, BS, 8, VOCAB, num_layers=2)
    assert str(info.value) == message


@pytest.mark.parametrize("case", sorted(set(BAD_STEPS) - {"taps"}))
def test_the_example_executor_raises_the_core_messages(case):
    executor = ExampleExecutor(VOCAB)
    executor.allocate_kv(8)
    step, message = BAD_STEPS[case]
    with pytest.raises(ValueError) as info:
        executor.step(step)
    assert str(info.value) == message


def test_checks_take_lists_and_numpy_and_answer_the_tables():
    good = Step([chunk([1, 2, 3], first=2), SeqChunk(8, [4, 5], [0, 1], np.array([5]))])
    tables = check_step(good, BS, 8, VOCAB)
    assert [list(t) for t in tables] == [[0, 1], [5]]
    check_tokens(np.array([0, VOCAB - 1]), VOCAB)
    with pytest.raises(ValueError, match="token id outside the vocabulary"):
        check_tokens(np.array([-1]), VOCAB)
    assert list(table_of(chunk([1], first=5, blocks=(3, 4, 9)), BS, 8)) == [3, 4]  # unused ids unchecked
    follows = SeqChunk(9, [-1], [4], [0, 1], sample=1, follows=True)  # a placeholder token is not checked
    assert check_step(Step([follows]), BS, 8, VOCAB) == [[0, 1]]
    with pytest.raises(ValueError, match="block ids must lie in 0..7"):
        check_copy_pairs([(1, 2), (3, 8)], 8)
    check_taps((0, 2), 2)
    with pytest.raises(RuntimeError, match="allocate_kv\\(\\) must be called before drafting"):
        kv_allocated(None, "drafting")


# -- the sampler's host side ---------------------------------------------------------------
def test_sample_rows_and_penalty_counts_follow_the_rule():
    params = SamplingParams(temperature=0.5, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                            logit_bias=((3, 2.0), (VOCAB + 5, 9.0), (3, 1.0)))
    c = SeqChunk(1, [5, 6, 5, 9], [10, 11, 12, 13], [0, 1, 2, 3], sample=2, sampling=params, uniforms=[0.1, 0.9],
                 history=list(range(10)), prompt_len=8, logprobs=2)
    plain = SeqChunk(2, [4], [0], [4], sample=1, uniforms=[0.3])
    rows = SampleRows.of(Step([c, plain]))
    assert len(rows) == 3 and rows.uniforms == [0.1, 0.9, 0.3] and rows.logprobs == [2, 2, -1]
    assert rows.penalized == [0, 1] and rows.wanted == [0, 1] and rows.processed
    seen, generated = penalty_counts(rows, rows.penalized, VOCAB)
    logits = np.linspace(-3, 3, VOCAB, dtype=np.float32)
    for k, row in enumerate(c.sampled_rows):  # what a device chain computes from them == the reference
        z = logits.astype(np.float64).copy()
        r, cols, values = bias_entries(SampleRows(params=[params]), VOCAB)
        np.add.at(z, cols, values)
        rep = params.repetition_penalty
        z = np.where(seen[k], np.where(z > 0, z / rep, z * rep), z)
        z = z - generated[k] * params.frequency_penalty - (generated[k] > 0) * params.presence_penalty
        history = list(c.history) + list(c.tokens[:row + 1])
        in_vocab = attrs.evolve(params, logit_bias=((3, 2.0), (3, 1.0)))  # the reference indexes every id
        expected = processed_logits(logits, in_vocab, RowContext(history=history, prompt_len=c.prompt_len))
        np.testing.assert_allclose(z, expected, rtol=1e-6)
    # row 2 counts history + [5, 6, 5], row 3 also its own 9; the prompt (ids 0..7) only as seen
    assert generated[0][[5, 6, 8, 9]].tolist() == [2, 1, 1, 1] and generated[1][9] == 2 and generated[0][0] == 0
    assert seen[0][0] and seen[1][9] and not seen[0][50]
    r, cols, values = bias_entries(rows, VOCAB)
    assert r.tolist() == [0, 0, 1, 1] and cols.tolist() == [3, 3, 3, 3] and values.dtype == np.float32
    assert bias_entries(SampleRows.of(Step([plain])), VOCAB) is None


def test_masks_unpack_to_allow_vectors():
    mask = np.zeros(-(-VOCAB // 32), dtype=np.uint32)
    for token in (0, 31, 32, VOCAB - 1):
        mask[token // 32] |= np.uint32(1 << (token % 32))
    assert np.flatnonzero(unpack_mask(mask, VOCAB)).tolist() == [0, 31, 32, VOCAB - 1]
    assert unpack_masks([None, None], VOCAB) is None
    both = unpack_masks([mask, None], VOCAB)
    assert both.shape == (2, VOCAB) and both.dtype == bool
    assert (both[0] == unpack_mask(mask, VOCAB)).all() and both[1].all()


# -- embedding rows, memory, dtypes, KV sizes -----------------------------------------------
def test_embedding_rows_index_the_packed_rows_and_check_their_width():
    image = np.arange(40, dtype=np.float32).reshape(10, 4)
    first = SeqChunk(1, [0] * 5, list(range(5)), [0, 1], embeds=[EmbeddingSpan(1, 3, image, first=6)])
    second = SeqChunk(2, [0] * 2, [0, 1], [2], embeds=[EmbeddingSpan(0, 2, image)])
    step = Step([first, second])
    take = lambda e, f, n: np.asarray(e)[f:f + n]  # noqa: E731
    index, pieces = embedding_rows(step, [0, 5], 4, take)
    assert index == [1, 2, 3, 5, 6]
    np.testing.assert_array_equal(np.concatenate(pieces), np.concatenate([image[6:9], image[0:2]]))
    assert embedding_rows(Step([SeqChunk(3, [1], [0], [0])]), [0], 4, take) is None
    with pytest.raises(ValueError, match=r"sequence 1: embedding rows must be \(3, 8\), got \(3, 4\)"):
        embedding_rows(step, [0, 5], 8, take)
    with pytest.raises(ValueError, match="the image became 10 rows, its prompt holds 4"):
        check_image_rows(image, PromptImage("d", 4))


def test_available_ram_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    1234 kB\n", encoding="ascii")
    assert available_ram(str(meminfo)) == 1234 * 1024
    assert available_ram(str(tmp_path / "missing")) is None


def test_the_dtype_table():
    assert [dtype_name(s) for s in ("fp32", "float16", "bf16")] == ["float32", "float16", "bfloat16"]
    with pytest.raises(ValueError, match="dtype 'int8' is not one of float32, float16, bfloat16"):
        dtype_name("int8")
    table = backend_dtypes(str.upper)
    assert table["bf16"] == table["bfloat16"] == "BFLOAT16" and set(table.values()) == {n.upper() for n in COMPUTE_DTYPES}
    assert ITEMSIZE["bfloat16"] == 2


def test_kv_block_bytes():
    class Config:
        num_layers, num_kv_heads, head_dim = 6, 2, 16

    assert kv_block_bytes(Config, 4, 4) == 6 * 2 * 4 * 2 * 16 * 4


# -- TargetAccess -------------------------------------------------------------------------------
def test_target_access_is_both_methods_or_neither():
    plain = ExampleExecutor(VOCAB)
    assert target_access(plain) is None and contract_problems(plain) == []

    class Lends(ExampleExecutor):
        def embedding_rows(self, ids):
            return np.zeros(np.shape(ids) + (self.info.hidden_size,), np.float32)

        def head_logits(self, hidden):
            return np.zeros((len(hidden), self.info.vocab_size), np.float32)

    lends = Lends(VOCAB)
    assert target_access(lends) is lends and contract_problems(lends) == []

    class Half(ExampleExecutor):
        def embedding_rows(self, ids):
            return None

    problems = contract_problems(Half(VOCAB))
    assert problems == ["TargetAccess needs embedding_rows and head_logits as methods, it has embedding_rows "
                        '(docs/executor.md section 8, "Speculators (drafts)")']


def test_the_step_code_imports_no_backend():
    """The core's step code is numpy and pure Python: no torch, no mlx, no plugin."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import musegl_core.engine.step_checks, musegl_core.engine.sample_rows, musegl_core.engine.embedding_rows\n"
            "import musegl_core.engine.memory, musegl_core.engine.dtypes, musegl_core.engine.kv_sizing\n"
            "backends = ('torch', 'mlx', 'musegl_cuda', 'musegl_mlx', 'musegl_executorch', 'musegl_dflash')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in backends))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
