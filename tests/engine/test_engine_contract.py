"""The executor contract v2 from the executor's side, with the example executor
written from docs/executor.md (tests/support/example_executor.py): padded step
widths, embedding rows and their identity in sessions, processors' masks, KV
sizing from memory."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.errors import ImageEncodingFailed
from musegl_core.engine.executor import GREEDY, Executor, ModelInfo, PromptImage, SamplingParams
from musegl_core.engine.identity import prompt_keys, split_keys
from musegl_core.engine.kv_sizing import check_fits, parse_bytes, plan_pool
from musegl_core.engine.request import PlacedImage, PreparedRequest
from musegl_core.engine.speculator import NoSpeculator, accept
from musegl_core.errors import ConfigError
from musegl_core.testing.example_executor import ExampleExecutor

PATCH = 200092


def engine_for(executor, tokenizer, **config):
    events: list = []
    settings = dict(max_context=256, max_sessions=8, max_inflight_requests=16, max_decode_sequences=8)
    engine = Engine(executor, tokenizer, EngineConfig(**{**settings, **config}), events.append)
    return engine, events


def request(rid: str, prompt, **kw) -> PreparedRequest:
    kw.setdefault("max_tokens", 6)
    kw.setdefault("ignore_eos", True)
    kw.setdefault("sampling", GREEDY)
    return PreparedRequest(id=rid, prompt_ids=tuple(prompt), **kw)


def generated(events, rid):
    done = next(e for e in events if isinstance(e, ev.Done) and e.id == rid)
    return list(done.generated_ids), done


def test_the_example_executor_satisfies_the_protocol(tokenizer):
    assert isinstance(ExampleExecutor(tokenizer.vocab_size), Executor)


def test_decode_only_steps_are_padded_to_the_listed_widths(tokenizer):
    executor = ExampleExecutor(tokenizer.vocab_size, step_sizes=(1, 2, 4, 8))
    engine, events = engine_for(executor, tokenizer)
    for i in range(5):
        engine.submit(request(f"r{i}", [100 + i, 200, 300 + i], max_tokens=4 + i))
    engine.run_until_idle()
    widths = [(s.num_tokens, s.width, s.decode_only) for s in executor.steps]
    assert any(decode for _, _, decode in widths)
    for rows, width, decode in widths:
        if decode:
            assert width == min(size for size in (1, 2, 4, 8) if size >= rows), (rows, width)
        else:
            assert width == rows  # steps with prefill rows run at their own width
    assert {w for r, w, d in widths if d} >= {8, 4}  # five decoders pad to 8; the last ones to 4, 2, 1


def test_without_step_sizes_every_step_runs_at_its_own_width(tokenizer):
    executor = ExampleExecutor(tokenizer.vocab_size)
    engine, _ = engine_for(executor, tokenizer)
    for i in range(3):
        engine.submit(request(f"r{i}", [100 + i, 200]))
    engine.run_until_idle()
    assert all(s.width == s.num_tokens for s in executor.steps)


def image(tag: int, rows: int = 6) -> PromptImage:
    return PromptImage(digest=f"sha256:{tag:064x}", rows=rows, pixels=np.full(rows, tag / 10, dtype=np.float32))


def image_prompt(img: PromptImage, suffix=()):
    prompt = [100, 101, *([PATCH] * img.rows), 102, 103, *suffix]
    return prompt, (PlacedImage(2, img),)


def test_embedding_rows_reach_the_model_and_sessions_compare_image_content(tokenizer):
    executor = ExampleExecutor(tokenizer.vocab_size)
    engine, events = engine_for(executor, tokenizer)
    a, b = image(1), image(2)

    prompt, images = image_prompt(a)
    engine.submit(request("first", prompt, images=images, session_id="s"))
    engine.run_until_idle()
    first, done = generated(events, "first")
    spans = [span for step in executor.steps for c in step.chunks for span in c.embeds]
    assert sum(span.count for span in spans) == a.rows and executor.images_encoded == 1

    # The same image again, the history extended: the cached prefix covers the image rows.
    longer = prompt + first[:-1] + [104, 105]
    engine.submit(request("same", longer, images=images, session_id="s"))
    engine.run_until_idle()
    _, same = generated(events, "same")
    assert same.cached_tokens >= 2 + a.rows + 2

    # A different image at the same place: reuse stops before its first row.
    changed = list(longer)
    engine.submit(request("changed", changed, images=(PlacedImage(2, b),), session_id="s"))
    engine.run_until_idle()
    out_b, changed_done = generated(events, "changed")
    assert changed_done.cached_tokens == 2

    # The model saw the pixels: the same prompt with another image answers differently.
    engine.submit(request("anon-a", prompt, images=images))
    engine.submit(request("anon-b", prompt, images=(PlacedImage(2, b),)))
    engine.run_until_idle()
    assert generated(events, "anon-a")[0] == first
    assert generated(events, "anon-b")[0] != first


def test_image_keys_move_with_their_rows():
    img = image(3, rows=3)
    req = PreparedRequest(id="x", prompt_ids=(5, PATCH, PATCH, PATCH, 6), images=(PlacedImage(1, img),))
    keys = prompt_keys(req.prompt_ids, req.images)
    assert keys[0] == 5 and keys[4] == 6 and all(k < 0 for k in keys[1:4]) and len(set(keys[1:4])) == 3
    ids, placed = split_keys([7, 8, *keys], req)  # two positions earlier in the prompt
    assert ids == [7, 8, 5, PATCH, PATCH, PATCH, 6] and placed[0].start == 3


class OnlyEvenIds:
    """A logits processor: the next token must be an even id below 1000."""

    def __init__(self, vocab: int):
        allowed = np.zeros(vocab, dtype=bool)
        allowed[0:1000:2] = True
        self.bits = np.packbits(allowed, bitorder="little")
        self.bits = np.pad(self.bits, (0, (-len(self.bits)) % 4)).view(np.uint32)
        self.calls = 0

    def mask(self, generated):
        self.calls += 1
        return self.bits


def test_processor_masks_constrain_every_sampled_token(tokenizer):
    executor = ExampleExecutor(tokenizer.vocab_size)
    engine, events = engine_for(executor, tokenizer)
    processor = OnlyEvenIds(tokenizer.vocab_size)
    engine.submit(request("greedy", [100, 200], max_tokens=8, processors=(processor,)))
    engine.submit(request("sampled", [100, 201], max_tokens=8, processors=(processor,),
                          sampling=SamplingParams(temperature=1.0, seed=3)))
    engine.run_until_idle()
    for rid in ("greedy", "sampled"):
        ids, _ = generated(events, rid)
        assert len(ids) == 8 and all(i % 2 == 0 and i < 1000 for i in ids)
    assert processor.calls == 16


def test_accept_keeps_the_agreeing_prefix_and_the_target_token_after_it():
    assert accept([], [9]) == [9]
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus the bonus token
    assert accept([5, 6, 7], [5, 4, 7, 8]) == [5, 4]  # second draft rejected: the target's token instead
    assert accept([5, 6, 7], [1, 6, 7, 8]) == [1]
    with pytest.raises(ValueError):
        accept([1, 2], [1, 2])


class SizedExecutor(ExampleExecutor):
    def __init__(self, vocab, free):
        super().__init__(vocab)
        self.free = free

    def kv_memory_available(self):
        return self.free


def test_the_pool_is_sized_from_memory_and_impossible_settings_say_what_fits(tokenizer):
    per_block = SizedExecutor(8, None).kv_bytes_per_block()  # 32 bytes, 4 positions
    config = EngineConfig(max_context=64, max_sessions=4)  # 4 * 16 blocks at once, + 1 to copy on write
    assert plan_pool(config, SizedExecutor(8, None), NoSpeculator()) == 65
    assert plan_pool(config, SizedExecutor(8, 10_000), NoSpeculator()) == 65  # default: what the limits ask
    big = EngineConfig(max_context=64, max_sessions=4, kv_cache_memory=200 * per_block)
    assert plan_pool(big, SizedExecutor(8, None), NoSpeculator()) == 200  # an explicit budget is filled
    # Blocks on demand: less memory than every session at --max-context at once is a smaller pool
    # (0.9 of 40 blocks), as long as one --max-context request fits (17 blocks).
    assert plan_pool(config, SizedExecutor(8, 40 * per_block), NoSpeculator()) == 36
    with pytest.raises(ConfigError) as info:
        plan_pool(config, SizedExecutor(8, 10 * per_block), NoSpeculator())
    message = str(info.value)
    assert "\n" not in message and "one --max-context 64 request" in message and "--max-context 32" in message
    with pytest.raises(ConfigError):
        check_fits(bytes_per_block=10, block_size=4, budget=10, source="x", max_sessions=1, max_context=8,
                   snapshots=0)
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("1.5g") == 3 << 29 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_serve_refuses_an_impossible_kv_setting_before_loading():
    result = subprocess.run(
        [sys.executable, "-m", "musegl_core.cli.main", "serve", "--kv-cache-memory", "1MiB", "--max-context", "8192",
         "--executor", "torch-cpu", "--port", "1"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip() and "RANDOM-WEIGHT DEMO" not in line]
    assert len(lines) == 1 and "--kv-cache-memory" in lines[0] and "what fits" in lines[0], result.stderr
    assert "loading" not in result.stderr


def test_generated_token_replay_is_planned_off_the_engine_thread(tokenizer):
    executor = ExampleExecutor(tokenizer.vocab_size)
    engine, events = engine_for(executor, tokenizer)
    prompt = tokenizer.encode("<|begin_of_text|><|start|>user<|message|>hello there<|eot|><|start|>assistant",
                              special=True)
    engine.submit(request("t1", prompt, session_id="s", max_tokens=5))
    engine.run_until_idle()
    answer, _ = generated(events, "t1")
    # The client resubmits the answer as text, which the template closes with <|eot|>.
    rendered = tokenizer.encode(tokenizer.decode(answer), special=True) + [tokenizer.eot_id]
    user = tokenizer.encode("<|start|>user<|message|>more<|eot|><|start|>assistant", special=True)
    follow = prompt + rendered + user
    planned = engine.plan_replay(request("t2", follow, session_id="s", max_tokens=3))
    assert planned.replay is not None and planned.replay.log is engine.sessions.named["s"].replay

    def no_parsing_here(*args, **kwargs):
        raise AssertionError("the engine thread parsed a replayed turn")

    engine.replayer.apply = no_parsing_here
    engine.submit(planned)
    engine.run_until_idle()
    _, done = generated(events, "t2")
    assert done.cached_tokens >= len(prompt) + len(answer) - 1  # the generated ids were reused


def test_the_same_image_twice_keeps_both_placements():
    img = image(4, rows=2)
    req = PreparedRequest(id="x", prompt_ids=(5, PATCH, PATCH, 6, PATCH, PATCH, 7),
                          images=(PlacedImage(1, img), PlacedImage(4, img)))
    keys = prompt_keys(req.prompt_ids, req.images)
    ids, placed = split_keys([9, *keys], req)  # shifted by one position
    assert ids == [9, 5, PATCH, PATCH, 6, PATCH, PATCH, 7]
    assert [p.start for p in placed] == [2, 5]


def test_an_image_the_executor_cannot_encode_fails_only_its_request(tokenizer):
    class Failing(ExampleExecutor):
        def embed_image(self, image):
            if image.digest == bad.digest:
                raise ValueError("unsupported pixels")
            return super().embed_image(image)

    good, bad = image(1), image(2)
    executor = Failing(tokenizer.vocab_size)
    engine, events = engine_for(executor, tokenizer)
    prompt, images = image_prompt(good)
    engine.submit(request("good", prompt, images=images))
    engine.submit(request("bad", prompt, images=(PlacedImage(2, bad),)))
    engine.submit(request("text", [100, 101, 102]))
    engine.run_until_idle()
    failed = [e for e in events if isinstance(e, ev.Failed)]
    assert [(e.id, e.error) for e in failed] == [("bad", ImageEncodingFailed("unsupported pixels"))]
    assert generated(events, "good")[0] and generated(events, "text")[0]
    assert engine.scheduler.idle


def test_a_speculator_needing_hidden_states_is_refused_by_an_executor_without_them():
    import attrs
    import pytest

    from musegl_core.errors import ConfigError
    from musegl_core.worker.loading import check_speculator

    class Executor:
        info = ModelInfo(name="m", vocab_size=8, hidden_size=4, num_layers=2, native_context=64, dtype="float32",
                         backend="frozen", hidden_states=False)

    class Tapping:
        taps = (1,)

    with pytest.raises(ConfigError, match="frozen executor returns no hidden states"):
        check_speculator(Executor(), Tapping())
    check_speculator(Executor(), None)  # no speculator: fine
    Executor.info = attrs.evolve(Executor.info, hidden_states=True)
    check_speculator(Executor(), Tapping())
