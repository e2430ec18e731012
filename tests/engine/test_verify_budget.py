"""The verify-rows budget of speculation (``--spec-verify-rows``, ``ExecutorLimits.verify_rows``):
a step decoding ``b`` sequences under a budget of ``B`` rows gives each at most ``B // b - 1``
drafts and none below two rows a sequence, and the output stays the plain engine's."""

from __future__ import annotations

import attrs
import pytest

from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig, verify_rows
from musegl_core.engine.executor import GREEDY, ExecutorLimits, SamplingParams
from musegl_core.engine.request import PreparedRequest
from musegl_core.engine.speculator import NoSpeculator
from musegl_core.testing.example_executor import ExampleExecutor

K = 4  # the speculator's drafts per sequence
BUDGET = 12  # rows: 1-2 decoders get K drafts, 3 get 3, 4 get 2, 5-6 get 1, 7-8 get none
SEQUENCES = 8
VOCAB = 4096  # the example model samples from the tokenizer's first ids only: fast rows


@pytest.fixture(scope="module")
def tokenizer():
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    return MuseTokenizer.load(str(default_model_path()))


class RecordedDrafts(NoSpeculator):
    """Drafts the continuation of a recorded sequence (a plain run's prompt and output) with
    one draft changed at index ``len(tokens) % (K + 1)`` (none when that is K), so 0..K of
    them are accepted across steps. Keeps every request it was asked."""

    max_draft = K

    def __init__(self, recorded: list[list[int]], vocab: int):
        self.recorded = recorded
        self.vocab = vocab
        self.asked: list[int] = []  # max_draft of every request

    def propose(self, requests):
        out = {}
        for r in requests:
            self.asked.append(r.max_draft)
            n = len(r.tokens)
            match = next((s for s in self.recorded if len(s) > n and s[:n] == list(r.tokens)), None)
            if match is None:
                continue
            drafts = match[n:n + r.max_draft]
            bad = n % (K + 1)
            if bad < len(drafts):
                drafts[bad] = (drafts[bad] + 1) % self.vocab
            out[r.seq] = drafts
        return out


def requests(sampling: str) -> list[PreparedRequest]:
    """Eight requests ending at different lengths, so the batch shrinks from 8 to 1 (the last
    one runs alone for a while)."""
    out = []
    for i in range(SEQUENCES):
        params = GREEDY if sampling == "greedy" else SamplingParams(temperature=0.8, top_k=20, seed=100 + i)
        length = 8 + 3 * i + (16 if i == SEQUENCES - 1 else 0)
        out.append(PreparedRequest(id=f"r{i}", prompt_ids=(100 + i, 200 + i, 300 + i), max_tokens=length,
                                   ignore_eos=True, sampling=params))
    return out


def run(tokenizer, sampling: str, speculator=None, limits: dict | None = None, **config):
    executor = ExampleExecutor(VOCAB)
    executor.limits = attrs.evolve(executor.limits, **(limits or {}))
    events: list = []
    settings = dict(max_context=256, max_sessions=SEQUENCES, max_inflight_requests=SEQUENCES,
                    max_decode_sequences=SEQUENCES, prefix_caching=False)
    engine = Engine(executor, tokenizer, EngineConfig(**{**settings, **config}), events.append, speculator)
    for request in requests(sampling):
        engine.submit(request)
    engine.run_until_idle()
    outputs = {e.id: list(e.generated_ids) for e in events if isinstance(e, ev.Done)}
    assert len(outputs) == SEQUENCES
    return outputs, executor, engine


def decode_chunks(step):
    """The step's decode chunks (one row, or a verify block): every row sampled. The prompts
    are three tokens, prefilled in one chunk that samples its last row only."""
    return [c for c in step.chunks if c.sample == len(c.tokens)]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_each_verify_block_keeps_within_the_budget_and_the_output_is_the_plain_one(tokenizer, sampling):
    plain, _, _ = run(tokenizer, sampling)
    recorded = [[100 + i, 200 + i, 300 + i, *plain[f"r{i}"]] for i in range(SEQUENCES)]

    unbudgeted = RecordedDrafts(recorded, VOCAB)
    free, free_executor, _ = run(tokenizer, sampling, unbudgeted)
    assert free == plain
    assert max(len(c.tokens) - 1 for s in free_executor.steps for c in decode_chunks(s)) == K

    for how in ({"limits": {"verify_rows": BUDGET}}, {"spec_verify_rows": BUDGET}):
        speculator = RecordedDrafts(recorded, VOCAB)
        outputs, executor, engine = run(tokenizer, sampling, speculator, **how)
        assert outputs == plain, how
        assert engine.loop.verify_rows == BUDGET
        drafts_at = {}  # decoders in a step -> the most drafts one of its blocks carried
        for step in executor.steps:
            chunks = decode_chunks(step)
            if not chunks:
                continue
            b = len(chunks)
            cap = max(0, min(K, BUDGET // b - 1))
            most = max(len(c.tokens) - 1 for c in chunks)
            assert most <= cap, (b, [len(c.tokens) for c in chunks])
            assert sum(len(c.tokens) for c in chunks) <= max(BUDGET, b)
            drafts_at[b] = max(drafts_at.get(b, 0), most)
        assert drafts_at[SEQUENCES] == 0  # 8 decoders, 12 rows: below two rows each, a plain step
        assert drafts_at[3] == 3 and drafts_at[1] == K  # cut to 12 // 3 - 1; one decoder: the full block
        assert max(speculator.asked) == K and min(speculator.asked) >= 1
        stats = engine.stats()
        assert stats["budget_skipped_steps"] > 0 and stats["budget_cut_steps"] > 0
        assert stats["accepted_tokens"] > 0  # the drafts still saved steps


def test_zero_turns_the_executors_budget_off_and_a_budget_of_one_row_a_sequence_drafts_nothing(tokenizer):
    limits = ExecutorLimits(verify_rows=128)
    assert verify_rows(None, limits) == 128
    assert verify_rows(0, limits) is None
    assert verify_rows(64, limits) == 64
    assert verify_rows(None, ExecutorLimits()) is None

    plain, _, _ = run(tokenizer, "greedy")
    recorded = [[100 + i, 200 + i, 300 + i, *plain[f"r{i}"]] for i in range(SEQUENCES)]
    off = RecordedDrafts(recorded, VOCAB)
    outputs, executor, engine = run(tokenizer, "greedy", off, limits={"verify_rows": 2}, spec_verify_rows=0)
    assert outputs == plain and engine.loop.verify_rows is None
    assert engine.stats()["budget_cut_steps"] == engine.stats()["budget_skipped_steps"] == 0

    tight = RecordedDrafts(recorded, VOCAB)
    outputs, executor, engine = run(tokenizer, "greedy", tight, spec_verify_rows=1)  # below 2 rows for one
    assert outputs == plain
    assert tight.asked == [] and engine.stats()["drafted_tokens"] == 0
    assert all(len(c.tokens) == 1 for s in executor.steps for c in decode_chunks(s))
    assert engine.stats()["budget_skipped_steps"] > 0


def test_the_budget_counters_are_served_on_metrics(tokenizer):
    from prometheus_client import CollectorRegistry, generate_latest

    from musegl_core.http.metrics import _Snapshot

    plain, _, _ = run(tokenizer, "greedy")
    recorded = [[100 + i, 200 + i, 300 + i, *plain[f"r{i}"]] for i in range(SEQUENCES)]
    _, _, engine = run(tokenizer, "greedy", RecordedDrafts(recorded, VOCAB), spec_verify_rows=BUDGET)
    stats = engine.stats()
    registry = CollectorRegistry()
    registry.register(_Snapshot(stats, True, 0))
    text = generate_latest(registry).decode()
    assert f"musegl_spec_budget_cut_steps_total {float(stats['budget_cut_steps'])}" in text
    assert f"musegl_spec_budget_skipped_steps_total {float(stats['budget_skipped_steps'])}" in text
