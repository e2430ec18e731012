"""The worker's preparation pool: lanes, order within a session, cancellation,
failures for one request alone; prepare() turns tokenizer failures into 400s
and refuses prompts that cannot fit before tokenizing them; the image decode
budget is checked from headers before anything is decoded."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import pytest

from musegl_core.engine.errors import EngineError
from musegl_core.engine.request import GenerateRequest, ImageInput, PromptSegment
from musegl_core.errors import ApiError
from musegl_core.tiny import build_tiny_tokenizer
from musegl_core.vision import preprocess as vp
from musegl_core.worker.messages import InputRefused, PreparationFailed
from musegl_core.worker.prepare import prepare
from musegl_core.worker.preparation import LIGHT_CHARS, PreparationPool, lane_of


def request(rid: str, text: str = "hi", session: str | None = None, **extra) -> GenerateRequest:
    return GenerateRequest(id=rid, prompt=(PromptSegment(text=text, special=False),), session_id=session, **extra)


class Recorder:
    """prepare() that blocks each request until the test releases it."""

    def __init__(self):
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self.submitted: list[str] = []
        self.failed: list[tuple[str, EngineError]] = []
        self.done = threading.Condition()

    def gate(self, rid: str) -> threading.Event:
        self.started.setdefault(rid, threading.Event())
        return self.gates.setdefault(rid, threading.Event())

    def prepare(self, req: GenerateRequest):
        self.started.setdefault(req.id, threading.Event()).set()
        self.gate(req.id).wait(30)
        if req.id.startswith("bad"):
            raise ApiError(400, "bad input")
        if req.id.startswith("bug"):
            raise type("PanicException", (BaseException,), {})("a library panicked")
        return req.id

    def submit(self, prepared) -> None:
        with self.done:
            self.submitted.append(prepared)
            self.done.notify_all()

    def fail(self, rid: str, error: EngineError) -> None:
        with self.done:
            self.failed.append((rid, error))
            self.done.notify_all()

    def wait(self, count: int) -> None:
        with self.done:
            assert self.done.wait_for(lambda: len(self.submitted) + len(self.failed) >= count, 30)


@pytest.fixture
def recorder():
    rec = Recorder()
    pool = PreparationPool(rec.prepare, rec.submit, rec.fail)
    rec.pool = pool
    yield rec
    for gate in rec.gates.values():
        gate.set()
    pool.close()


def test_lanes():
    assert lane_of(request("a", "x" * LIGHT_CHARS)) == "light"
    assert lane_of(request("a", "x" * (LIGHT_CHARS + 1))) == "heavy"
    assert lane_of(request("a", images=(ImageInput("image/png", "AAAA"),))) == "heavy"
    assert lane_of(request("a", grammar="x" * (LIGHT_CHARS + 1))) == "heavy"


def test_a_heavy_request_does_not_hold_up_a_light_one(recorder):
    pool = recorder.pool
    for i in range(3):  # more heavy requests than heavy threads
        recorder.gate(f"heavy{i}")
        pool.submit(request(f"heavy{i}", "x" * (LIGHT_CHARS + 1)))
    recorder.gate("small").set()
    pool.submit(request("small"))
    recorder.wait(1)
    assert recorder.submitted == ["small"]
    assert pool.stats()["preparing"] == 3 and pool.stats()["preparing_heavy"] == 3


def test_a_session_s_requests_keep_their_order(recorder):
    pool = recorder.pool
    recorder.gate("first")
    pool.submit(request("first", "x" * (LIGHT_CHARS + 1), session="s"))  # slow, heavy lane
    recorder.gate("second").set()
    pool.submit(request("second", session="s"))
    recorder.gate("other").set()
    pool.submit(request("other", session="t"))
    recorder.wait(1)
    assert recorder.submitted == ["other"] and pool.session_busy("s")  # "second" waits for "first"
    recorder.gates["first"].set()
    recorder.wait(3)
    assert recorder.submitted == ["other", "first", "second"] and not pool.session_busy("s")


def test_cancelled_while_preparing_never_reaches_the_engine(recorder):
    pool = recorder.pool
    recorder.gate("gone")
    pool.submit(request("gone"))
    assert recorder.started["gone"].wait(30)
    assert pool.cancel("gone")
    recorder.gates["gone"].set()
    recorder.gate("next").set()
    pool.submit(request("next"))
    recorder.wait(1)
    # "gone" may still be finishing on the other light thread: give it time to leave
    deadline = time.monotonic() + 30
    while pool.stats()["preparing"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert recorder.submitted == ["next"] and not recorder.failed and pool.stats()["preparing"] == 0
    assert not pool.cancel("next")  # handed on: the engine cancels it


def test_failures_fail_that_request_alone(recorder):
    pool = recorder.pool
    for rid in ("bad1", "bug1", "good1"):
        recorder.gate(rid).set()
        pool.submit(request(rid))
    recorder.wait(3)
    failed = dict(recorder.failed)
    assert failed["bad1"] == InputRefused(400, "bad input")  # the ApiError as it was raised
    assert failed["bug1"] == PreparationFailed("a library panicked")
    assert recorder.submitted == ["good1"]
    recorder.gate("good2").set()
    pool.submit(request("good2"))  # the threads still serve
    recorder.wait(4)
    assert recorder.submitted == ["good1", "good2"]


# -- prepare() -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_a_tokenizer_panic_is_a_400(tokenizer, monkeypatch):
    class Panicking:
        def encode(self, *args, **kwargs):
            raise type("PanicException", (BaseException,), {})("Onig: Regex search error: retry-limit-in-match over")

        encode_batch = encode

    monkeypatch.setattr(tokenizer, "_plain_tokenizer", Panicking())
    with pytest.raises(ApiError) as error:
        prepare(request("r", "some text"), tokenizer)
    assert error.value.status == 400 and "retry-limit-in-match" in error.value.message


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tokenizer, monkeypatch):
    calls = []
    real = tokenizer.encode_segments
    monkeypatch.setattr(tokenizer, "encode_segments", lambda *a, **k: calls.append(1) or real(*a, **k))
    longest = tokenizer.longest_token_bytes
    fits = prepare(request("r", "hello " * 100), tokenizer, max_context=1000)
    assert len(fits.prompt_ids) < 1000 and calls == [1]
    with pytest.raises(ApiError) as error:  # 1000 * longest bytes need at least 1000 tokens
        prepare(request("r", "x" * (1000 * longest), max_tokens=10), tokenizer, max_context=1000)
    assert calls == [1]  # never tokenized
    err = error.value
    assert err.status == 400 and err.code == "context_length_exceeded" and err.param == "messages"
    assert err.metadata["prompt_tokens"] == 1000 and err.metadata["prompt_tokens_exact"] is False
    assert err.metadata["completion_reservation"] == 10 and err.metadata["context_length"] == 1000
    assert "at least 1010 tokens" in err.message
    # Under the length floor, tokenizing stops once the budget is passed.
    with pytest.raises(ApiError) as error:
        prepare(request("r", "word " * 5000), tokenizer, max_context=1000)
    assert error.value.code == "context_length_exceeded" and error.value.metadata["prompt_tokens"] > 999


# -- the image decode budget ----------------------------------------------------------------------
def png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buffer, "PNG")
    return buffer.getvalue()


def jpeg(width: int, height: int, progressive: bool) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (9, 8, 7)).save(buffer, "JPEG", progressive=progressive)
    return buffer.getvalue()


def as_input(data: bytes, media_type: str = "image/png") -> ImageInput:
    return ImageInput(media_type, base64.b64encode(data).decode())


def test_jpeg_scans_are_counted_from_the_markers():
    assert vp.jpeg_scans(jpeg(64, 48, progressive=False)) == 1
    progressive = vp.jpeg_scans(jpeg(64, 48, progressive=True))
    assert 2 <= progressive <= 12
    assert vp.jpeg_scans(b"not a jpeg") == 0


def test_the_decode_budget_is_checked_from_headers_before_decoding(monkeypatch):
    prep = vp.ImagePreprocessor(max_vision_patches=64)
    decoded = []
    real = vp.decode_image
    monkeypatch.setattr(vp, "decode_image", lambda *a: decoded.append(1) or real(*a))
    side = 5000  # 25 M pixels each: two fit the request's budget (67.1 M), three do not
    images = [as_input(png(side, side)) for _ in range(3)]
    with pytest.raises(ApiError) as error:
        prep.admit(images)
    assert error.value.code == "invalid_image" and "per request" in error.value.message
    with pytest.raises(ApiError):
        vp.place_images([1, 92, 92, 92], images, FakeTokenizer(), prep)
    assert decoded == []  # refused from the headers alone
    monkeypatch.setattr(vp, "MAX_DECODE_WORK", 4 * 64 * 48)  # a progressive JPEG's scans count against it
    progressive = as_input(jpeg(64, 48, progressive=True), "image/jpeg")
    with pytest.raises(ApiError) as error:
        prep.admit([progressive])
    assert "pixel-scans" in error.value.message and decoded == []
    assert len(prep.admit([as_input(jpeg(64, 48, progressive=False), "image/jpeg")])) == 1


class FakeTokenizer:
    patch_id, image_start_id, image_end_id = 92, 90, 91


def test_the_trace_records_each_prepared_request(tmp_path):
    """``--trace-steps``: a ``prepared`` line per request handed on (with its lane and prompt ids)."""
    from musegl_core.engine.trace import Trace

    tokenizer = build_tiny_tokenizer()
    trace = Trace.open(tmp_path / "trace.jsonl")
    rec = Recorder()
    pool = PreparationPool(lambda req: prepare(req, tokenizer), rec.submit, rec.fail, trace=trace)
    try:
        pool.submit(request("short", "hello there"))
        pool.submit(request("long", "word " * (LIGHT_CHARS // 5 + 1)))
        rec.wait(2)
    finally:
        pool.close()
        trace.close()
    lines = {line["id"]: line for line in map(json.loads, (tmp_path / "trace.jsonl").read_text().splitlines())
             if line["event"] != "gc"}  # (garbage collections are traced too)
    assert {line["event"] for line in lines.values()} == {"prepared"}
    assert lines["short"]["lane"] == "light" and lines["long"]["lane"] == "heavy"
    sizes = {p.id: len(p.prompt_ids) for p in rec.submitted}
    assert {rid: line["prompt_ids"] for rid, line in lines.items()} == sizes
