"""An executor conformance suite: the contract of docs/executor.md, checked from outside.

A backend author subclasses :class:`ExecutorConformance` in a test module and
provides one fixture, ``executor``: an executor for a small model, already
created (not yet given its KV storage; the suite calls ``allocate_kv``). The
suite then drives it with hand-built steps, the way the engine does, and
checks what the contract promises:

* the object has every member (``check_executor``);
* a prompt prefilled in one chunk or in several gives the same logits: the
  executor reads the cache earlier chunks wrote instead of recomputing them;
* a sequence whose block table shares another's blocks (a session's reused
  prefix) continues exactly as the owner would; ``copy_blocks`` copies every layer;
* a row's logits and id do not depend on the rows that share its step;
* the sampler follows section 5 (``musegl_core.testing.reference_sampler``) on the
  executor's own logits, for every sampling parameter: or refuses the parameter
  with ``ValueError`` (an executor never ignores one silently);
* masks are honoured, log-probabilities follow the rule, verify chunks sample
  after each of their rows, and a step with a block or token id out of range raises.

Run in our suite against the example executor, the torch executor and the MLX
executor (and the ExecuTorch program in the slow tier). Needs pytest.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from musegl_core.engine.executor import SamplingParams, SeqChunk, Step, check_executor
from musegl_core.engine.speculator import accept
from musegl_core.testing.reference_sampler import RowContext, processed_logits, row_logprobs, sample_row

#: Sampling settings every conforming executor honours or refuses.
SAMPLING_CASES = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=1.0, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.6),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2),
    "logit_bias": SamplingParams(temperature=0.0, logit_bias=((7, 40.0),)),
    "penalties": SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5,
                                presence_penalty=0.4),
    "everything": SamplingParams(temperature=1.3, top_k=40, top_p=0.9, min_p=0.01, logit_bias=((3, 2.0),),
                                 repetition_penalty=1.1, frequency_penalty=0.2),
}
UNIFORMS = (0.03, 0.31, 0.5, 0.77, 0.98)


def as_array(value: Any) -> np.ndarray:
    """A backend-native float array (torch, mlx, numpy) as float64 numpy."""
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def near_a_boundary(logits: np.ndarray, params: SamplingParams, row: RowContext, tolerance: float = 1e-4) -> bool:
    """True when the row's uniform number lies within ``tolerance`` of a boundary between
    two ids of the inverse CDF: float rounding in the executor may then pick the neighbour."""
    for u in (row.uniform - tolerance, row.uniform + tolerance):
        moved = RowContext(min(max(u, 0.0), 1.0 - 1e-12), row.mask, row.history, row.prompt_len)
        if sample_row(logits, params, moved) != sample_row(logits, params, row):
            return True
    return False


class ExecutorConformance:
    """Subclass it and provide the ``executor`` fixture, class-scoped::

        class TestMyExecutor(ExecutorConformance):
            @pytest.fixture(scope="class")
            @classmethod
            def executor(cls):
                return MyExecutor(...)

    Class attributes a subclass may set: ``logits_atol`` (how far a row's logits may
    move between two ways of computing them: 0 for an exact backend, about 1e-4 for
    float32 products that round by batch shape), ``prompt_length`` and ``num_blocks``.
    """

    logits_atol: float = 1e-4
    prompt_length: int = 37
    num_blocks: int = 256

    # -- plumbing -------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def allocated(cls, executor):
        check_executor(executor, type(executor).__name__)
        executor.allocate_kv(cls.num_blocks)
        # Blocks are handed out round the pool: a test's sequences are released when it ends,
        # and no test holds more than a few dozen blocks at once.
        blocks = (b % cls.num_blocks for b in itertools.count(0))
        yield executor, {"blocks": blocks, "seqs": itertools.count(1_000)}

    def blocks(self, state, positions: int) -> list[int]:
        size = self._block_size
        return [next(state["blocks"]) for _ in range(-(-positions // size))]

    def prompt(self, executor, length: int | None = None, salt: int = 0) -> list[int]:
        vocab = executor.info.vocab_size
        rng = np.random.default_rng(1234 + salt)
        return [int(t) for t in rng.integers(1, min(vocab, 50_000), size=length or self.prompt_length)]

    def run(self, executor, *chunks: SeqChunk):
        return executor.step(Step(list(chunks)))

    @pytest.fixture(autouse=True)
    def _remember_block_size(self, executor):
        self._block_size = executor.block_size

    # -- the contract ---------------------------------------------------------------------
    def test_members(self, allocated):
        executor, _ = allocated
        assert executor.kv_bytes_per_block() > 0
        assert executor.block_size > 0 and executor.limits.max_step_tokens > 0

    def test_chunked_prefill_reads_what_earlier_chunks_wrote(self, allocated):
        executor, state = allocated
        ids = self.prompt(executor)
        whole_seq, split_seq = next(state["seqs"]), next(state["seqs"])
        whole_blocks, split_blocks = self.blocks(state, len(ids)), self.blocks(state, len(ids))
        whole = self.run(executor, SeqChunk(whole_seq, ids, list(range(len(ids))), whole_blocks, logit_rows=True))
        cut = len(ids) // 2 + 1  # inside a block
        self.run(executor, SeqChunk(split_seq, ids[:cut], list(range(cut)), split_blocks))
        rest = self.run(executor, SeqChunk(split_seq, ids[cut:], list(range(cut, len(ids))), split_blocks,
                                           logit_rows=True))
        np.testing.assert_allclose(as_array(rest.logits[split_seq]), as_array(whole.logits[whole_seq])[cut:],
                                   atol=self.logits_atol, rtol=0)
        for seq in (whole_seq, split_seq):
            executor.release_sequence(seq)

    def test_shared_and_copied_blocks_continue_like_their_owner(self, allocated):
        executor, state = allocated
        size = executor.block_size
        ids = self.prompt(executor, salt=1)
        full = (len(ids) - 1) // size  # whole blocks before the last, partly filled one
        owner, sharer = next(state["seqs"]), next(state["seqs"])
        owner_blocks = self.blocks(state, len(ids) + 1)
        self.run(executor, SeqChunk(owner, ids, list(range(len(ids))), owner_blocks))
        tail = [next(state["blocks"]) for _ in range(len(owner_blocks) - full)]
        executor.copy_blocks([(owner_blocks[full], tail[0])])  # copy-on-write of the partial block
        sharer_blocks = owner_blocks[:full] + tail
        nxt = [ids[-1] % 97 + 1]
        a = self.run(executor, SeqChunk(owner, nxt, [len(ids)], owner_blocks, sample=1, want_logits=True,
                                        uniforms=[0.5]))
        b = self.run(executor, SeqChunk(sharer, nxt, [len(ids)], sharer_blocks, sample=1, want_logits=True,
                                        uniforms=[0.5]))
        np.testing.assert_allclose(as_array(b.logits[sharer]), as_array(a.logits[owner]), atol=self.logits_atol,
                                   rtol=0)
        assert a.tokens[owner] == b.tokens[sharer]
        for seq in (owner, sharer):
            executor.release_sequence(seq)

    def test_a_row_does_not_depend_on_its_batch(self, allocated):
        executor, state = allocated
        first, second = self.prompt(executor, salt=2), self.prompt(executor, 21, salt=3)
        alone_seq, seq_a, seq_b = next(state["seqs"]), next(state["seqs"]), next(state["seqs"])
        alone_blocks, blocks_a, blocks_b = (self.blocks(state, len(first)), self.blocks(state, len(first)),
                                            self.blocks(state, len(second)))
        alone = self.run(executor, SeqChunk(alone_seq, first, list(range(len(first))), alone_blocks, sample=1,
                                            want_logits=True, uniforms=[0.5]))
        both = self.run(executor,
                        SeqChunk(seq_b, second, list(range(len(second))), blocks_b, sample=1, uniforms=[0.5]),
                        SeqChunk(seq_a, first, list(range(len(first))), blocks_a, sample=1, want_logits=True,
                                 uniforms=[0.5]))
        np.testing.assert_allclose(as_array(both.logits[seq_a]), as_array(alone.logits[alone_seq]),
                                   atol=self.logits_atol, rtol=0)
        assert both.tokens[seq_a] == alone.tokens[alone_seq]
        for seq in (alone_seq, seq_a, seq_b):
            executor.release_sequence(seq)

    @pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
    def test_sampling_follows_the_rule_on_its_own_logits(self, allocated, case):
        executor, state = allocated
        params = SAMPLING_CASES[case]
        ids = self.prompt(executor, salt=4)
        prompt_len = len(ids) - 6  # the last six ids count as generated for the penalties
        for u in UNIFORMS:
            seq = next(state["seqs"])
            chunk = SeqChunk(seq, ids, list(range(len(ids))), self.blocks(state, len(ids)), sample=1,
                             sampling=attrs_seeded(params), uniforms=[u], want_logits=True,
                             history=(), prompt_len=prompt_len)
            try:
                out = self.run(executor, chunk)
            except ValueError:
                executor.release_sequence(seq)
                return  # refused, not ignored: allowed
            logits = as_array(out.logits[seq])
            row = RowContext(u, None, ids, prompt_len)
            expected = sample_row(logits, params, row)
            got = out.tokens[seq][0]
            assert got == expected or near_a_boundary(logits, params, row), (case, u, got, expected)
            executor.release_sequence(seq)

    def test_masks_are_honoured(self, allocated):
        executor, state = allocated
        vocab = executor.info.vocab_size
        ids = self.prompt(executor, salt=5)
        allowed = [5, 9, 17, vocab - 1]
        mask = np.zeros(-(-vocab // 32), dtype=np.uint32)
        for token in allowed:
            mask[token // 32] |= np.uint32(1 << (token % 32))
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
            for u in UNIFORMS[:3]:
                seq = next(state["seqs"])
                chunk = SeqChunk(seq, ids, list(range(len(ids))), self.blocks(state, len(ids)), sample=1,
                                 sampling=attrs_seeded(params), uniforms=[u], masks=[mask], want_logits=True)
                out = self.run(executor, chunk)
                got = out.tokens[seq][0]
                assert got in allowed
                logits = as_array(out.logits[seq])
                row = RowContext(u, mask, (), 0)
                assert got == sample_row(logits, params, row) or near_a_boundary(logits, params, row)
                executor.release_sequence(seq)

    def test_logprobs_follow_the_rule(self, allocated):
        executor, state = allocated
        ids = self.prompt(executor, salt=6)
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)):
            seq = next(state["seqs"])
            chunk = SeqChunk(seq, ids, list(range(len(ids))), self.blocks(state, len(ids)), sample=1,
                             sampling=attrs_seeded(params), uniforms=[0.4], logprobs=3, want_logits=True)
            try:
                out = self.run(executor, chunk)
            except ValueError:
                executor.release_sequence(seq)
                return  # log-probabilities refused, not ignored
            assert seq in out.logprobs, "logprobs were asked and neither reported nor refused"
            got = out.logprobs[seq][0]
            expected = row_logprobs(as_array(out.logits[seq]), params, out.tokens[seq][0], 3)
            assert abs(got.logprob - expected.logprob) <= 1e-3
            np.testing.assert_allclose(got.top_logprobs, expected.top_logprobs, atol=1e-3)
            assert len(got.top_ids) == 3
            executor.release_sequence(seq)

    def test_a_verify_chunk_samples_after_each_of_its_rows(self, allocated):
        executor, state = allocated
        ids = self.prompt(executor, salt=7)
        seq, reference = next(state["seqs"]), next(state["seqs"])
        blocks, reference_blocks = self.blocks(state, len(ids)), self.blocks(state, len(ids))
        out = self.run(executor, SeqChunk(seq, ids, list(range(len(ids))), blocks, sample=4,
                                          uniforms=[0.5] * 4, logit_rows=True))
        assert len(out.tokens[seq]) == 4
        logits = as_array(out.logits[seq])
        for j, token in enumerate(out.tokens[seq]):
            row = logits[len(ids) - 4 + j]
            z = processed_logits(row, SamplingParams(temperature=0.0))
            assert token == int(np.argmax(z)) or np.sort(z)[-1] - np.sort(z)[-2] <= self.logits_atol
        # The verify chunk's first sampled row is the end of the prompt without its last three ids.
        alone = self.run(executor, SeqChunk(reference, ids[:-3], list(range(len(ids) - 3)), reference_blocks,
                                            sample=1, uniforms=[0.5], want_logits=True))
        np.testing.assert_allclose(as_array(alone.logits[reference]), logits[len(ids) - 4], atol=self.logits_atol,
                                   rtol=0)
        for seq_ in (seq, reference):
            executor.release_sequence(seq_)

    def test_drafts_on_the_device_are_read_and_judged(self, allocated):
        """With ``limits.device_drafts``: a verify block whose drafts are a row of
        ``Step.drafts`` (given here as numpy) samples what the block with the drafts
        inline samples, and ``accepted`` counts the leading drafts that agree."""
        executor, state = allocated
        if not executor.limits.device_drafts:
            pytest.skip("the executor does not read drafts on the device")
        ids = self.prompt(executor, salt=8)
        n = len(ids)
        greedy = SamplingParams(temperature=0.0)
        inline_seq, device_seq = next(state["seqs"]), next(state["seqs"])
        found = {}
        for seq in (inline_seq, device_seq):
            blocks = self.blocks(state, n + 5)
            out = self.run(executor, SeqChunk(seq, ids, list(range(n)), blocks, sample=1, uniforms=[0.5]))
            continuation = list(out.tokens[seq])
            for k in range(3):  # the greedy continuation, one row at a time
                out = self.run(executor, SeqChunk(seq, [continuation[-1]], [n + k], blocks, sample=1,
                                                  uniforms=[0.5], sampling=greedy))
                continuation += out.tokens[seq]
            found[seq] = (blocks, continuation)
        blocks, continuation = found[inline_seq]
        drafts = [continuation[1], continuation[2], (continuation[3] + 1) % executor.info.vocab_size]
        positions = list(range(n, n + 4))
        inline = self.run(executor, SeqChunk(inline_seq, [continuation[0]] + drafts, positions, blocks, sample=4,
                                             uniforms=[0.5] * 4, sampling=greedy))
        table = np.array([[7, 7, 7, 7], drafts + [0]], dtype=np.int64)
        on_device = executor.step(Step([SeqChunk(device_seq, [continuation[0], 0, 0, 0], positions,
                                                 found[device_seq][0], sample=4, uniforms=[0.5] * 4,
                                                 sampling=greedy, draft_row=1)], drafts=table))
        assert on_device.tokens[device_seq] == inline.tokens[inline_seq]
        agreed = len(accept(drafts, inline.tokens[inline_seq])) - 1
        assert on_device.accepted == {device_seq: agreed}  # 2 where the block samples the continuation
        for seq in (inline_seq, device_seq):
            executor.release_sequence(seq)

    def test_a_step_it_cannot_run_raises(self, allocated):
        executor, state = allocated
        seq = next(state["seqs"])
        with pytest.raises(Exception):
            self.run(executor, SeqChunk(seq, [1, 2], [0, 1], [self.num_blocks + 5], sample=1, uniforms=[0.5]))
        with pytest.raises(Exception):
            self.run(executor, SeqChunk(seq, [executor.info.vocab_size + 3], [0], self.blocks(state, 1), sample=1,
                                        uniforms=[0.5]))
        executor.release_sequence(seq)


def attrs_seeded(params: SamplingParams) -> SamplingParams:
    """The engine gives every request a seed; so does the suite."""
    import attrs

    return attrs.evolve(params, seed=7) if params.seed is None else params
