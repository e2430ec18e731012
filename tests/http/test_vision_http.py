"""Images through the HTTP API on the demo checkpoint (its tiny random projector):
identity by pixels (a re-encoded image is the same image on a session's next
turn), ``detail`` levels, and the errors for formats that are not PNG/JPEG."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server

MAX_PATCHES = 1024


@pytest.fixture(scope="module")
def server():
    from musegl_core.tiny import default_model_path, demo_mmproj_path

    model = str(default_model_path())
    config = ServeConfig(model=model, mmproj=demo_mmproj_path(model), port=0, max_context=1024, max_sessions=4,
                         max_inflight_requests=2, max_vision_patches=MAX_PATCHES)
    with running_server(config) as running:
        yield running


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def image_part(data: bytes, media_type: str = "image/png", **extra) -> dict:
    url = f"data:{media_type};base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def post(server, messages, **extra) -> httpx.Response:
    body = {"model": "m", "messages": messages, "max_tokens": 3, "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=180)


def test_a_re_encoded_image_is_reused_past_its_rows(server):
    image = picture(112, 84, seed=3)  # 4 x 3 merged cells: 12 image rows
    fast, small = encoded(image, compress_level=1), encoded(image, compress_level=9, optimize=True)
    assert fast != small
    turn = [{"role": "user", "content": [image_part(fast), {"type": "text", "text": "What is this?"}]}]
    first = post(server, turn, session_id="pixels")
    assert first.status_code == 200, first.text
    prompt = first.json()["usage"]["prompt_tokens"]
    reply = first.json()["choices"][0]["message"]
    # The next turn resends the history with the same pixels in other bytes.
    again = [{"role": "user", "content": [image_part(small), {"type": "text", "text": "What is this?"}]},
             {"role": "assistant", "content": reply.get("content") or ""},
             {"role": "user", "content": "And the colours?"}]
    second = post(server, again, session_id="pixels")
    assert second.status_code == 200, second.text
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= prompt - 1  # everything of the first turn, the image's 12 rows included
    # Other pixels in the same place end the reuse at the image.
    other = [{"role": "user", "content": [image_part(encoded(picture(112, 84, seed=4))),
                                          {"type": "text", "text": "What is this?"}]}] + again[1:]
    third = post(server, other, session_id="pixels")
    assert third.status_code == 200, third.text
    assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < prompt - 12


def test_detail_levels(server):
    data = encoded(picture(448, 448, seed=5))  # 16 x 16 cells: the whole 1024-patch budget
    text = {"type": "text", "text": "Describe it."}

    def prompt_tokens(**detail) -> int:
        response = post(server, [{"role": "user", "content": [image_part(data, **detail), text]}], max_tokens=1)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    full = prompt_tokens()
    assert prompt_tokens(detail="auto") == prompt_tokens(detail="high") == full
    assert full - prompt_tokens(detail="low") == 16 * 16 - 8 * 8  # low: at most 256 patches (64 rows)
    refused = post(server, [{"role": "user", "content": [image_part(data, detail="ultra"), text]}])
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages[0].content[0].image_url.detail"


@pytest.mark.parametrize(("fmt", "media_type"), [("GIF", "image/gif"), ("WEBP", "image/webp")])
def test_gif_and_webp_are_named_and_refused(server, fmt, media_type):
    data = encoded(picture(30, 30, seed=1), fmt)
    for label, needle in ((media_type, f"Image format {media_type} is not supported"),
                          ("image/png", f"is a {fmt} image, but the data URL says image/png")):
        response = post(server, [{"role": "user", "content": [image_part(data, label)]}])
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_image" and needle in error["message"], error
        assert "not fetched" not in error["message"]
