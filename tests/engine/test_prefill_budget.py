"""The prefill budget: how much prefill may share a step with running decodes.

Deterministic: the engine's clock is a counter that the executor advances by a
scripted cost per step (``FIXED + ROW x rows``), so the budget's estimates and
every step's composition follow from the script, not from timings."""

from __future__ import annotations

import pytest

from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.prefill_budget import MIN_PREFILL_ROWS, PROBE_ROWS, PrefillBudget
from musegl_core.engine.request import Phase, PreparedRequest
from musegl_core.engine.scheduler import Scheduler, SchedulerLimits
from musegl_core.testing.example_executor import ExampleExecutor
from tests.support.scheduling import advance, make_seq, make_table

# Binary fractions, so the scripted times add up exactly.
ROW = 1 / 1024  # seconds per row
FIXED = 1 / 8 - ROW  # the rest of a step: a one-row decode step takes exactly 1/8 s


def budget_with(stall_factor: float, max_chunk: int, decode_seconds: float, row_seconds: float) -> PrefillBudget:
    """A budget that has seen one decode-only step and one step with 64 prompt rows."""
    budget = PrefillBudget(stall_factor, max_chunk)
    budget.observe(decode_rows=1, prefill_rows=0, seconds=decode_seconds)
    budget.observe(decode_rows=1, prefill_rows=64, seconds=decode_seconds + 64 * row_seconds)
    return budget


# -- the budget on its own ------------------------------------------------------------------
def test_without_estimates_or_decoders_the_budget_is_the_whole_chunk():
    budget = PrefillBudget(stall_factor=3.0, max_chunk=512)
    assert budget.rows(decoding=4, prefilling=1) == 512  # nothing observed yet
    budget.observe(decode_rows=0, prefill_rows=100, seconds=0.4)
    assert budget.row_seconds is None  # a prefill-only step before any decode step: fixed part unknown
    budget.observe(decode_rows=4, prefill_rows=0, seconds=0.2)
    assert budget.rows(decoding=4, prefilling=1) == PROBE_ROWS  # a row's cost not known yet: a probe
    budget.observe(decode_rows=4, prefill_rows=64, seconds=0.3)
    assert budget.rows(decoding=0, prefilling=3) == 512  # nobody decodes: nothing to protect
    assert budget.rows(decoding=4, prefilling=1) < 512


def test_rows_follow_the_stall_factor_and_the_observed_costs():
    budget = PrefillBudget(stall_factor=3.0, max_chunk=512)
    budget.observe(decode_rows=8, prefill_rows=0, seconds=0.25)
    budget.observe(decode_rows=8, prefill_rows=64, seconds=0.25 + 64 / 512)  # 1/512 s per prompt row
    assert budget.decode_seconds == 0.25 and budget.row_seconds == 1 / 512
    # (3 - 1) x 0.25 s of prefill per step = 256 rows; one decode step stretched to at most three
    assert budget.rows(decoding=8, prefilling=1) == 256
    assert budget.rows(decoding=8, prefilling=8) == 256  # as many waiting as decoding: no extra share
    assert budget.rows(decoding=2, prefilling=3) == 384  # shared per request: x 3/2
    assert budget.rows(decoding=1, prefilling=7) == 512  # capped by --max-prefill-chunk
    assert budget_with(2.0, 512, 0.25, 1 / 512).rows(decoding=8, prefilling=1) == 128


def test_an_expensive_prompt_still_progresses_and_zero_turns_the_bound_off():
    budget = PrefillBudget(stall_factor=1.0, max_chunk=512)
    budget.observe(decode_rows=1, prefill_rows=0, seconds=0.1)
    budget.observe(decode_rows=1, prefill_rows=10, seconds=10.0)
    assert budget.rows(decoding=1, prefilling=1) == MIN_PREFILL_ROWS
    off = PrefillBudget(stall_factor=0.0, max_chunk=512)
    off.observe(decode_rows=1, prefill_rows=0, seconds=0.1)
    off.observe(decode_rows=1, prefill_rows=10, seconds=10.0)
    assert off.rows(decoding=1, prefilling=1) == 512


def test_the_decode_estimate_is_a_moving_average_and_prefill_only_steps_count_their_fixed_part():
    budget = PrefillBudget(stall_factor=3.0, max_chunk=512)
    budget.observe(decode_rows=2, prefill_rows=0, seconds=0.5)
    budget.observe(decode_rows=2, prefill_rows=0, seconds=1.5)
    assert budget.decode_seconds == 0.5 + 0.25 * 1.0
    budget.observe(decode_rows=0, prefill_rows=100, seconds=0.75 + 100 * 0.001)  # fixed part ~ a decode step
    assert budget.row_seconds == pytest.approx(0.001)


# -- the scheduler ----------------------------------------------------------------------------
def test_a_fixed_cost_of_prefilling_steps_is_fitted_apart_from_the_rows():
    budget = PrefillBudget(3.0, 512)
    budget.observe(decode_rows=3, prefill_rows=0, seconds=0.0625)
    budget.observe(decode_rows=3, prefill_rows=64, seconds=0.0625 + 0.03125 + 64 / 1024)
    assert budget.fixed_seconds == 0.0 and budget.row_seconds == pytest.approx((0.03125 + 64 / 1024) / 64)
    budget.observe(decode_rows=3, prefill_rows=256, seconds=0.0625 + 0.03125 + 256 / 1024)
    assert budget.fixed_seconds == pytest.approx(0.03125) and budget.row_seconds == pytest.approx(1 / 1024)
    # allowance 2 x 0.0625 = 0.125 s; minus the fixed part: 0.09375 s = 96 rows
    assert budget.rows(decoding=3, prefilling=1) == 96


def test_a_fixed_cost_larger_than_half_the_allowance_leaves_half_of_it_to_rows():
    """CPU-like steps: any prefill adds a fixed 60 ms (wide products) besides 1 ms per row,
    and a step of four decodes takes 44 ms, so the allowance (2 x 44 = 88 ms) minus the
    fixed part leaves 28 ms, 28 rows a step. The fixed part takes at most half the
    allowance: the chunks settle at 44 rows (a time-per-row ratio alone settles at 28)."""
    decode, fixed, row = 0.044, 0.060, 0.001
    budget = PrefillBudget(3.0, 512)
    budget.observe(decode_rows=1, prefill_rows=0, seconds=0.034)  # a one-sequence phase first
    budget.observe(decode_rows=0, prefill_rows=512, seconds=0.034 + fixed + 512 * row)
    chunks = []
    for _ in range(40):
        budget.observe(decode_rows=4, prefill_rows=0, seconds=decode)
        rows = budget.rows(decoding=3, prefilling=1)
        chunks.append(rows)
        budget.observe(decode_rows=3, prefill_rows=rows, seconds=decode + fixed + rows * row)
    assert 43 <= min(chunks[-5:]) and max(chunks[-5:]) <= 45, chunks
    assert budget.fixed_seconds == pytest.approx(fixed, rel=0.05) and budget.row_seconds == pytest.approx(row, rel=0.05)


def test_the_scheduler_caps_prefill_rows_while_decoding_and_keeps_every_decoder():
    pool = KVPool(1024, 16)
    table = make_table(pool, sessions=8, context=2048)
    budget = budget_with(3.0, 512, 0.25, 1 / 256)  # 128 rows per step
    sched = Scheduler(pool, SchedulerLimits(max_decode_sequences=4, max_prefill_chunk=512, max_step_tokens=516),
                      budget=budget)
    decoders = [make_seq(table, i, 4, max_new=500) for i in range(2)]
    for seq in decoders:
        sched.add(seq)
    step, plan, _ = sched.schedule()  # nobody decodes yet: both prompts in one prefill-only step
    assert [len(c.tokens) for c in step.chunks] == [4, 4]
    advance(plan, step)
    first, second = make_seq(table, 10, 300), make_seq(table, 11, 100)
    sched.add(first)
    sched.add(second)
    compositions = []
    while second.phase is Phase.PREFILL:
        step, plan, _ = sched.schedule()
        rows = {c.seq: len(c.tokens) for c in step.chunks}
        assert rows[0] == rows[1] == 1, "every decoder rides every step"
        compositions.append(tuple(rows.get(s.handle, 0) if s.phase is Phase.PREFILL else 0 for s in (first, second)))
        advance(plan, step)
    # two decoders, two waiting prompts: 128 rows a step, first come first served
    assert compositions == [(128, 0), (128, 0), (44, 84), (0, 16)]


def test_the_waiting_prompts_share_counts_against_the_decoders():
    pool = KVPool(1024, 16)
    table = make_table(pool, sessions=8, context=2048)
    budget = budget_with(3.0, 512, 0.25, 1 / 256)
    sched = Scheduler(pool, SchedulerLimits(4, 512, 516), budget=budget)
    decoder = make_seq(table, 0, 4, max_new=500)
    sched.add(decoder)
    step, plan, _ = sched.schedule()
    advance(plan, step)
    for handle in range(1, 5):
        sched.add(make_seq(table, handle, 200))
    step, _, _ = sched.schedule()
    # one decoder, four prompts waiting: 4 x 128 rows
    assert sum(len(c.tokens) for c in step.chunks if c.seq != 0) == 512


# -- the engine, with a scripted cost per step ------------------------------------------------
class TimedExecutor(ExampleExecutor):
    """The example executor on a scripted clock: each step takes ``FIXED + ROW x rows`` seconds."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def step(self, step):
        self.now += FIXED + ROW * step.num_tokens
        return super().step(step)


def run_arrival(tokenizer, stall_factor: float):
    """One sequence decoding, then a 3000-token prompt arriving; returns the steps after the arrival."""
    executor = TimedExecutor(tokenizer.vocab_size)
    config = EngineConfig(max_context=4096, max_sessions=4, max_inflight_requests=4, max_decode_sequences=4,
                          max_prefill_chunk=512, prefill_stall_factor=stall_factor)
    engine = Engine(executor, tokenizer, config, lambda event: None, clock=executor.clock)
    engine.submit(PreparedRequest(id="decoder", prompt_ids=(100, 200, 300), max_tokens=200, ignore_eos=True,
                                  sampling=GREEDY))
    for _ in range(5):
        engine._drain(block=False)
        engine.step()
    arrival = len(executor.steps)
    engine.submit(PreparedRequest(id="long", prompt_ids=tuple(range(1000, 4000)), max_tokens=4, ignore_eos=True,
                                  sampling=GREEDY))
    engine.run_until_idle()
    return engine, executor.steps[arrival:]


def prefill_rows(step, decoder_handle=0):
    return sum(len(c.tokens) for c in step.chunks if c.seq != decoder_handle and c.sample != len(c.tokens))


def test_running_decodes_keep_a_bounded_step_while_a_long_prompt_arrives(tokenizer):
    engine, steps = run_arrival(tokenizer, stall_factor=3.0)
    mixed = [s for s in steps if prefill_rows(s)]
    decode_step = FIXED + ROW  # one decoder alone
    for step in mixed:
        assert any(c.seq == 0 for c in step.chunks), "the decoder rides every step with prefill"
        assert FIXED + ROW * step.num_tokens <= 3.0 * decode_step, "a step is at most 3 decode steps"
    rows = [prefill_rows(s) for s in mixed]
    # a probe, then (3 - 1) x 1/8 s of prefill per step at 1/1024 s per row
    assert rows == [PROBE_ROWS] + [256] * 11 + [120]
    assert engine.prefill_budget.row_seconds == ROW
    book = engine.step_book
    assert sum(book.steps.values()) == engine.steps
    assert book.steps["mixed"] == len(mixed) and book.prefill_rows["mixed"] == 3000
    assert book.seconds["decode"] == book.steps["decode"] * FIXED + book.decode_rows["decode"] * ROW


def test_with_the_bound_off_a_prompt_takes_whole_chunks_beside_the_decoders(tokenizer):
    _, steps = run_arrival(tokenizer, stall_factor=0.0)
    rows = [prefill_rows(s) for s in steps if prefill_rows(s)]
    assert rows == [512] * 5 + [440]
