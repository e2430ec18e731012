"""The benchmark-only replay (``MUSEGL_DFLASH_BENCHMARK_ACCEPT``): a recorded target continuation
replaces a random draft's proposals, so every verify block commits exactly K tokens, while the
responses stay the plain server's. The served test runs the device-draft path (the torch
executors announce ``device_drafts`` and the DFlash speculator proposes on the device, so the
replay is :class:`ReplayOnDevice`, overwriting the drafts' rows in place)."""

from __future__ import annotations

import pytest

from dflash_support import build_reference_draft, save_draft
from musegl_core.config import ServeConfig
from musegl_core.errors import ConfigError
from musegl_core.testing.server import running_server
from musegl_core.testing.speculation import chat, draft_metric
from musegl_dflash.replay import ENV, ContinuationBook, benchmark_replay, replace_drafts

PROMPT = [{"role": "user", "content": "Write a few words about the sea, then about the hills."}]
MAX_TOKENS = 33  # the prefill's token, then 8 blocks of 4


def test_replace_drafts_accepts_k_minus_one_then_misses():
    recorded = list(range(100, 140))
    drafted = [7] * 15
    out = replace_drafts(recorded, 10, drafted, 15, 4)
    assert out[:3] == [110, 111, 112] and out[3] != 113 and out[4:] == [7] * 11
    assert replace_drafts(recorded, 10, drafted, 2, 4) == [110, 111]  # no room for the miss
    assert replace_drafts(recorded, 38, drafted, 15, 4) == [138, 139]  # the recording ends
    assert replace_drafts(recorded, 10, drafted, 15, 16)[:15] == recorded[10:25]  # every draft accepted


def test_the_book_finds_a_recording_by_any_prefix():
    book = ContinuationBook()
    long, other, short = tuple(range(50)), tuple(range(40)) + (999,) * 10, (5, 6, 7)
    for tokens in (long, other, short):
        book.add(tokens)
    assert book.find(long[:45]) == long and book.find(other[:45]) == other
    assert book.find(long[:40]) in (long, other)  # both go on past it
    assert book.find((5, 6)) == short and book.find(long) is None and book.find((1, 2, 3)) is None


@pytest.mark.parametrize("value", ["17", "-1", "/nonexistent/accept"])
def test_values_the_drafts_cannot_give_are_refused(value):
    with pytest.raises(ConfigError, match=ENV):
        benchmark_replay(object(), 15, {ENV: value})


def test_the_replay_keeps_the_inner_speculators_device_path():
    from musegl_core.engine.speculator import proposes_on_device
    from musegl_dflash.replay import ReplayOnDevice, ReplaySpeculator
    from musegl_dflash.speculator import DFlashSpeculator

    assert proposes_on_device(ReplayOnDevice.__new__(ReplayOnDevice))
    assert not proposes_on_device(ReplaySpeculator.__new__(ReplaySpeculator))  # over a host-only drafter
    inner = DFlashSpeculator.__new__(DFlashSpeculator)  # the class decides; nothing is loaded
    assert type(benchmark_replay(inner, 15, {ENV: "4"})) is ReplayOnDevice


def test_off_unless_the_variable_is_set():
    inner = object()
    assert benchmark_replay(inner, 15, {}) is inner and benchmark_replay(inner, 15, {ENV: " "}) is inner


def blocks_and_tokens(url: str) -> tuple[float, float]:
    return draft_metric(url, "spec_verify_blocks"), draft_metric(url, "spec_accepted_tokens")


@pytest.fixture(scope="module")
def model_and_draft(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    draft = save_draft(build_reference_draft(seed=7), tmp_path_factory.mktemp("replay") / "hf")
    return str(default_model_path()), str(draft)


def test_served_blocks_commit_exactly_k_tokens_and_answers_do_not_change(model_and_draft, tmp_path, monkeypatch):
    model, draft = model_and_draft
    served_replay(model, {"dflash": draft}, tmp_path, monkeypatch)


@pytest.mark.slow
def test_the_replay_over_the_draft_on_tensor_parallel_ranks(model_and_draft, tmp_path, monkeypatch):
    """The replayed ids cross to the ranks (``RankSpeculator.write_drafts``), every rank's drafts alike."""
    from musegl_core.tiny import default_model_path

    _, draft = model_and_draft
    served_replay(str(default_model_path(file_type="f32")),
                  {"dflash": draft, "tensor_parallel_size": 2, "weights": "stored"}, tmp_path, monkeypatch)


def served_replay(model, extra, tmp_path, monkeypatch):
    control = tmp_path / "accept"
    control.write_text("0")  # record only: the draft's own proposals
    monkeypatch.setenv(ENV, str(control))
    config = ServeConfig(model=model, executor="torch-cpu", port=0, max_context=1024, max_sessions=2,
                         max_inflight_requests=2, max_decode_sequences=2, extra=extra)
    with running_server(config) as server:
        first = chat(server.url, PROMPT, max_tokens=MAX_TOKENS)
        for k in (4, 2, 16):
            control.write_text(str(k))
            before = blocks_and_tokens(server.url)
            again = chat(server.url, PROMPT, max_tokens=MAX_TOKENS)
            blocks, accepted = (a - b for a, b in zip(blocks_and_tokens(server.url), before))
            assert (again["message"], again["finish"]) == (first["message"], first["finish"])
            # 32 tokens after the prefill's, k per block (the last block's drafts all fit: no miss)
            assert (blocks, accepted) == (32 // k, 32 // k * (k - 1)), k
