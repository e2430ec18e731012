"""The benchmark-only replay (``MUSEGL_DFLASH_BENCHMARK_ACCEPT``): a recorded target continuation
replaces a random draft's proposals, so every verify block commits exactly K tokens, while the
responses stay the plain server's. The served test runs the device-draft path (the torch
executors announce ``device_drafts`` and the DFlash speculator proposes on the device, so the
replay is :class:`ReplayOnDevice`, overwriting the drafts' rows in place)."""

from __future__ import annotations

import json

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


@pytest.fixture(scope="module")
def graphed_speculator(tmp_path_factory):
    """A real DFlash speculator whose draft forward runs through :class:`DraftGraphs` (on the CPU
    their body runs eagerly over the same static buffers a CUDA graph writes: the drafts of a
    step are a view of ``DraftGraphs.outs[n]``), with some context in its store."""
    import torch

    from musegl_dflash.loader import load_draft
    from musegl_dflash.speculator import DFlashSpeculator, TargetHead

    vocab, hidden = 512, 64
    model = build_reference_draft(seed=3, mask_token_id=500)
    draft = load_draft(str(save_draft(model, tmp_path_factory.mktemp("draft"))), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(4)
    head = TargetHead.of_tensors(torch.randn(vocab, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen))
    spec = DFlashSpeculator(draft, head, 15, 4, graphs=True)
    spec.allocate_kv(64)
    positions = torch.arange(40)
    features = torch.randn(40, len(draft.config.target_layer_ids) * hidden, generator=gen)
    for blocks in TABLES:
        slots = torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(40)])
        draft.write_context(features, positions, slots, spec.kv)
    return spec


TABLES = [list(range(0, 16)), list(range(16, 32)), list(range(32, 48))]


def recording(seq: int) -> tuple[int, ...]:
    """A prompt of 34 ids and 20 generated ones, its own for each sequence."""
    return tuple(range(10 * seq, 10 * seq + 34)) + tuple(300 + 7 * seq + i for i in range(20))


@pytest.mark.parametrize("room", [1, 2, 3, 15])
def test_replayed_ids_on_the_device_under_a_verify_budget(graphed_speculator, tmp_path, room):
    """Requests capped by the engine's verify-rows budget (``max_draft`` 1 at batch 32 of a 64-row
    budget): each row of the device drafts starts with the recorded continuation, at most
    ``max_draft`` of it (``K - 1`` then a miss where the room allows), and a verify step reading its
    first ``counts[seq]`` ids commits what the replay promises."""
    import torch

    from musegl_core.engine.speculator import DraftRequest, accept
    from musegl_dflash.replay import AcceptanceSource, ReplayOnDevice

    control = tmp_path / "accept"
    control.write_text("4")
    replay = ReplayOnDevice(graphed_speculator, AcceptanceSource(str(control)))
    for seq in range(3):
        replay.book.add(recording(seq))
    at = [35, 40, 50]  # tokens each sequence holds: the prompt and 1, 6, 16 generated
    requests = [DraftRequest(seq, recording(seq)[:n], TABLES[seq], room) for seq, n in enumerate(at)]
    requests.append(DraftRequest(9, tuple(range(200, 236)), TABLES[0], room))  # recorded nowhere
    found = replay.propose_on_device(requests)
    ids = torch.as_tensor(found.ids)
    assert found.counts == {r.seq: room for r in requests}
    for seq, n in enumerate(at):
        drafts = ids[found.rows[seq], :found.counts[seq]].tolist()
        continuation = list(recording(seq)[n:])
        assert drafts[:min(room, 3)] == continuation[:min(room, 3)], (seq, room)
        # the target samples the recording: the block commits min(room + 1, 4) tokens
        sampled = (continuation + [-1] * room)[:room + 1]
        assert len(accept(drafts, sampled)) == min(room + 1, 4), (seq, room)
    assert not (tmp_path / "accept.stats").exists()  # written when a sequence is released
    replay.release_sequence(0)
    counts = json.loads((tmp_path / "accept.stats").read_text())
    assert [counts[key] for key in ("followed", "unmatched", "replayed_blocks", "drafted_blocks")] == [3, 1, 3, 1]


def test_the_counts_say_where_the_target_left_its_recording(graphed_speculator, tmp_path):
    """A sequence whose first token is not the recorded one counts as ``first_token_differs``; one
    that follows its recording and then samples another token counts as ``left`` after the tokens it
    had generated since its first proposal."""
    from musegl_core.engine.speculator import DraftRequest
    from musegl_dflash.replay import AcceptanceSource, ReplayOnDevice

    control = tmp_path / "accept"
    control.write_text("2")
    replay = ReplayOnDevice(graphed_speculator, AcceptanceSource(str(control)))
    replay.book.add(recording(0))
    replay.book.add(recording(1))
    ask = lambda seq, tokens: replay.propose_on_device([DraftRequest(seq, tokens, TABLES[seq], 1)])  # noqa: E731
    ask(0, recording(0)[:35])
    ask(0, recording(0)[:37])  # two blocks of 2 later: still on it
    ask(0, recording(0)[:38] + (1,))  # the target sampled 1 where the recording has 304
    ask(1, recording(1)[:34] + (2,))  # the first token already differs
    replay.release_sequence(0)
    counts = json.loads((tmp_path / "accept.stats").read_text())
    assert (counts["followed"], counts["unmatched"], counts["first_token_differs"]) == (1, 1, 1)
    assert (counts["left"], counts["left_after"]) == (1, [4])
