"""Verify blocks whose drafts stay on the device (``SeqChunk.draft_row``), on the CPU.

The layout of :class:`~musegl_cuda.drafts.DraftRows` (which packed rows get
which draft), its acceptance on the device against ``accept`` on the host,
the executor's verify step with device drafts against the same step with the
drafts inline, and the engine: a speculator that proposes on the device gives
every request exactly what the same speculator gives on the host, and what
no speculator gives.
"""

from __future__ import annotations

import pytest
import torch
from engine_run_support import Recording

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY, SamplingParams, SeqChunk, Step, StepOutput
from musegl_core.engine.request import PreparedRequest
from musegl_core.engine.speculator import DeviceDrafts, DraftRequest, accept
from musegl_cuda.drafts import DraftRows, HostJudged
from musegl_cuda.executor import TorchExecutor

BLOCK = 4


def verify_chunk(seq, first, drafts, row, position, blocks):
    """A verify block: the pending token, then placeholders for ``len(drafts)`` device drafts."""
    tokens = [first] + [0] * len(drafts)
    return SeqChunk(seq, tokens, list(range(position, position + len(tokens))), blocks, sample=len(tokens),
                    draft_row=row)


def test_drafts_go_into_their_rows_and_are_judged_like_accept():
    drafts = torch.tensor([[71, 72, 73, 74], [81, 82, 83, 84], [91, 92, 93, 94]])
    step = Step([SeqChunk(1, [5, 6, 7], [0, 1, 2], [0], sample=1),          # a prefill chunk's end
                 verify_chunk(2, 10, [81, 82, 83], 1, 8, [1, 2, 3]),          # 3 drafts of row 1
                 SeqChunk(3, [11], [4], [4, 5], sample=1),                    # a plain decode row
                 verify_chunk(4, 12, [71, 72], 0, 6, [6, 7])], drafts=drafts)  # 2 of row 0's 4
    starts = [0, 3, 7, 8]
    drafted = DraftRows.of(step, starts)
    assert drafted.rows == [4, 5, 6, 9, 10] and drafted.counts == [3, 2]
    assert drafted.sample_base == [1, 6]
    tokens = torch.tensor([t for ch in step.chunks for t in ch.tokens] + [0, 0])  # padded to 13 rows
    drafted.place(tokens)
    assert tokens.tolist() == [5, 6, 7, 10, 81, 82, 83, 11, 12, 71, 72, 0, 0]
    # the target's ids after each row; block 2 agrees twice then differs, block 4 agrees fully
    cases = {2: [81, 82, 99, 5], 4: [71, 72, 8]}
    by_row = torch.zeros(13, dtype=torch.long)
    by_row[3:7], by_row[8:11] = torch.tensor(cases[2]), torch.tensor(cases[4])
    by_row[2], by_row[7] = 40, 41
    sampled_order = torch.cat([by_row[2:3], by_row[3:7], by_row[7:8], by_row[8:11]])
    want = {seq: len(accept(drafts_of, cases[seq])) - 1
            for seq, drafts_of in ((2, [81, 82, 83]), (4, [71, 72]))}
    assert want == {2: 2, 4: 2}
    output = StepOutput()  # the device judge reads only its own counts
    assert DraftRows.of(step, starts).judge(by_row, by_row=True).values(output) == want
    assert DraftRows.of(step, starts).judge(sampled_order, by_row=False).values(output) == want
    host = DraftRows.of(step, starts).judge(None, by_row=True)
    assert isinstance(host, HostJudged)
    assert host.values(StepOutput(tokens=cases)) == want
    # nothing is judged where no chunk reads device drafts
    assert DraftRows.of(Step([SeqChunk(1, [5], [0], [0], sample=1)]), [0]) is None
    with pytest.raises(ValueError, match="outside the step's drafts"):
        DraftRows.of(Step([verify_chunk(2, 10, [1, 2], 5, 8, [1, 2, 3])], drafts=drafts), [0])


def test_a_draft_row_needs_a_verify_block():
    with pytest.raises(ValueError, match="verify block"):
        SeqChunk(1, [5], [0], [0], sample=1, draft_row=0)
    with pytest.raises(ValueError, match="verify block"):
        SeqChunk(1, [5, 6], [0, 1], [0], sample=1, draft_row=0)


@pytest.fixture(scope="module")
def checkpoint(tiny_hf):
    return load_checkpoint(tiny_hf.path)


def test_a_verify_step_reads_its_drafts_on_the_device_and_counts_the_accepted(checkpoint):
    """Drafts that are the target's own greedy continuation, one of them wrong: the
    step with device drafts samples what the step with the drafts inline samples, and
    its accepted counts are ``accept``'s."""
    prompts = {0: [5, 9, 13, 21, 30, 2], 1: [44, 3, 17, 8, 90, 61, 7, 12, 6]}
    tables = {0: [3, 1, 0], 1: [2, 5, 4, 6]}
    answers = {}
    for device_drafts in (False, True):
        ex = TorchExecutor(checkpoint, device="cpu", block_size=BLOCK)
        assert ex.limits.device_drafts
        ex.allocate_kv(8)
        first = ex.step(Step([SeqChunk(s, p, list(range(len(p))), tables[s], sample=1) for s, p in prompts.items()]))
        # the greedy continuation of each, one token at a time
        cont = {s: first.tokens[s] for s in prompts}
        for k in range(4):
            out = ex.step(Step([SeqChunk(s, [cont[s][-1]], [len(prompts[s]) + k], tables[s], sample=1)
                                for s in prompts]))
            for s in prompts:
                cont[s] += out.tokens[s]
        proposed = {0: cont[0][1:4] + [0], 1: [cont[1][1], 7, cont[1][3], cont[1][4]]}  # 3 right; 1 right
        drafts = torch.tensor([proposed[1], proposed[0]])
        rows = {1: 0, 0: 1}
        chunks = []
        for s in prompts:
            k = 4 if s == 1 else 3
            if device_drafts:
                chunks.append(verify_chunk(s, cont[s][0], proposed[s][:k], rows[s], len(prompts[s]), tables[s]))
            else:
                tokens = [cont[s][0]] + proposed[s][:k]
                chunks.append(SeqChunk(s, tokens, list(range(len(prompts[s]), len(prompts[s]) + k + 1)), tables[s],
                                       sample=k + 1))
        out = ex.step(Step(chunks, drafts=drafts if device_drafts else None))
        answers[device_drafts] = out
        ex.close()
    host, device = answers[False], answers[True]
    assert device.tokens == host.tokens
    assert host.accepted == {}
    assert device.accepted == {0: len(accept(proposed[0][:3], host.tokens[0])) - 1,
                               1: len(accept(proposed[1], host.tokens[1])) - 1} == {0: 3, 1: 1}


class Recorded:
    """A speculator that proposes the continuations of a plain run (known answers), with
    every third draft changed so that blocks are also partly rejected; on the device
    (torch tensors) through ``propose_on_device``."""

    taps: tuple[int, ...] = ()
    max_draft = 4

    def __init__(self, answers: list[list[int]]) -> None:
        self.answers = answers
        self.asked_on_device = 0

    def _drafts(self, request: DraftRequest) -> list[int]:
        tokens = list(request.tokens)
        for full in self.answers:
            if full[:len(tokens)] == tokens:
                nxt = full[len(tokens):len(tokens) + request.max_draft]
                return [t if (len(tokens) + i) % 3 else t + 1 for i, t in enumerate(nxt)]
        return [7] * request.max_draft

    def propose(self, requests):
        return {r.seq: self._drafts(r) for r in requests}

    def propose_on_device(self, requests):
        self.asked_on_device += 1
        rows = [self._drafts(r) + [0] * (self.max_draft - len(self._drafts(r))) for r in requests]
        return DeviceDrafts(torch.tensor(rows, dtype=torch.long).reshape(len(requests), self.max_draft),
                            {r.seq: i for i, r in enumerate(requests)},
                            {r.seq: len(self._drafts(r)) for r in requests})

    def kv_bytes_per_block(self):
        return 0

    def allocate_kv(self, num_blocks):
        pass

    def observe(self, step, output, committed):
        pass

    def copy_blocks(self, pairs):
        pass

    def release_sequence(self, seq):
        pass

    def close(self):
        pass


class RecordedOnHost(Recorded):
    """The same drafts, through ``propose`` only (the class defines no ``propose_on_device``)."""

    propose_on_device = None


def run(checkpoint, tokenizer, requests, speculator=None, **settings):
    executor = Recording(checkpoint, device="cpu", block_size=BLOCK)
    events: list = []
    config = EngineConfig(max_context=128, max_sessions=8, max_inflight_requests=8, max_decode_sequences=8,
                          max_prefill_chunk=64, **settings)
    engine = Engine(executor, tokenizer, config, events.append, speculator=speculator)
    for r in requests:
        engine.submit(r)
    engine.run_until_idle()
    out = {}
    for r in requests:
        ids = [t for e in events if isinstance(e, ev.Tokens) and e.id == r.id for t in e.ids]
        done = [(e.finish_reason, e.completion_tokens) for e in events if isinstance(e, ev.Done) and e.id == r.id]
        out[r.id] = (ids, done)
    return out, executor, engine.stats()


def requests():
    """Greedy and seeded requests, and one with a penalty that ends early (while it decodes, the
    step's drafts come to the host: the penalty counts them there)."""
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    made = [PreparedRequest(id=f"r{i}", prompt_ids=tuple((i * 37 + 11 * j) % 500 + 3 for j in range(7 + i)),
                            max_tokens=13 + i, ignore_eos=True, sampling=seeded if i == 1 else GREEDY)
            for i in range(3)]
    made.append(PreparedRequest(id="pen", prompt_ids=(9, 8, 7, 6), max_tokens=4, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0, repetition_penalty=1.3)))
    return made


def test_device_drafts_give_what_host_drafts_and_no_drafts_give(checkpoint, tokenizer):
    plain, _, _ = run(checkpoint, tokenizer, requests())
    answers = [list(r.prompt_ids) + plain[r.id][0] for r in requests()]  # prompt, then answer
    on_host, host_ex, host_stats = run(checkpoint, tokenizer, requests(), RecordedOnHost(answers))
    speculator = Recorded(answers)
    on_device, device_ex, device_stats = run(checkpoint, tokenizer, requests(), speculator)
    assert on_host == plain and on_device == plain
    assert device_stats["accepted_tokens"] == host_stats["accepted_tokens"] > 0
    assert device_stats["drafted_tokens"] == host_stats["drafted_tokens"] > device_stats["accepted_tokens"]
    assert not any(ch.draft_row >= 0 for s in host_ex.launched for ch in s.chunks)
    read = sum(ch.draft_row >= 0 for s in device_ex.launched for ch in s.chunks)
    verified = sum(len(ch.tokens) > 1 and ch.sample == len(ch.tokens) for s in device_ex.launched for ch in s.chunks)
    assert 0 < read < verified  # device drafts once the penalized request has ended
    assert speculator.asked_on_device > 0


def test_a_verify_rows_budget_gives_device_drafts_fewer_rows_and_the_same_output(checkpoint, tokenizer):
    """``--spec-verify-rows 9``: 4 decoders draft one each, 3 two, 2 three, 1 four (the
    speculator's most); the device path reads each block's own count of its row."""
    plain, _, _ = run(checkpoint, tokenizer, requests())
    answers = [list(r.prompt_ids) + plain[r.id][0] for r in requests()]
    budgeted, executor, stats = run(checkpoint, tokenizer, requests(), Recorded(answers), spec_verify_rows=9)
    assert budgeted == plain
    counts = set()
    for step in executor.launched:
        decoding = [ch for ch in step.chunks if ch.sample == len(ch.tokens)]
        if decoding:
            assert max(len(ch.tokens) - 1 for ch in decoding) <= max(0, min(4, 9 // len(decoding) - 1))
        counts |= {len(ch.tokens) - 1 for ch in decoding if ch.draft_row >= 0}
    assert 2 in counts and len(counts) > 1, counts  # device blocks of different lengths
    assert stats["budget_cut_steps"] > 0 and stats["accepted_tokens"] > 0
