"""Image preprocessing and placement (musegl_core/vision/preprocess.py): numpy + pillow only."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from musegl_core.engine.request import ImageInput
from musegl_core.errors import ApiError
from musegl_core.vision.preprocess import (
    ImagePreprocessor,
    pixel_values,
    place_images,
    smart_resize,
)


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)


def as_input(data: bytes, media_type: str = "image/png") -> ImageInput:
    return ImageInput(media_type, base64.b64encode(data).decode())


# token costs of image sizes (computed with the transformers function, cap 4096 merged cells)
SPEC_TABLE = [
    ((224, 224), (8, 8)), ((300, 300), (10, 10)), ((640, 480), (17, 23)), ((480, 640), (23, 17)),
    ((896, 896), (32, 32)), ((1024, 1024), (37, 37)), ((1280, 720), (26, 46)), ((1920, 1080), (39, 69)),
    ((1792, 1792), (64, 64)), ((3000, 2000), (52, 78)), ((4032, 3024), (55, 73)), ((100, 5000), (179, 4)),
    ((10, 10), (1, 1)),
]


@pytest.mark.parametrize("size,grid", SPEC_TABLE)
def test_smart_resize_matches_the_spec_table(size, grid):
    width, height = size
    assert smart_resize(height, width, 4096) == grid


@pytest.mark.parametrize("size,cells", [((56, 28), 2), ((640, 480), 391), ((1920, 1080), 1008), ((3000, 4000), 972)])
def test_smart_resize_under_the_server_default_cap(size, cells):
    """chat-format.md 6.7: --max-vision-patches 4096 -> 1024 merged cells."""
    width, height = size
    gh, gw = smart_resize(height, width, ImagePreprocessor(4096).max_cells)
    assert gh * gw == cells


def test_patch_rows_are_raster_ordered_frames_of_588_columns():
    image = noise(56, 84, seed=3)  # 84x56 px: already a multiple of 28, not resized
    prompt_image = ImagePreprocessor().preprocess(as_input(encode(image)))
    assert prompt_image.grid == (6, 4) and prompt_image.rows == 6
    values = (np.asarray(image, dtype=np.float32) - 127.5) / 127.5
    pixels = prompt_image.pixels
    assert pixels.shape == (24, 588) and pixels.dtype == np.float32
    for r, c, ch, py, px in [(0, 0, 0, 0, 0), (2, 3, 1, 5, 13), (5, 1, 2, 13, 0), (4, 2, 0, 7, 9)]:
        assert pixels[r * 4 + c, ch * 196 + py * 14 + px] == values[r * 14 + py, c * 14 + px, ch]
    full = pixel_values(prompt_image)  # transformers' layout: t is the outermost axis
    assert full.shape == (24, 1176) and np.array_equal(full[:, :588], full[:, 588:])


def test_downscaled_image_and_the_digest():
    prep = ImagePreprocessor(max_vision_patches=64)  # 16 merged cells
    data = encode(noise(400, 300))
    image = prep.preprocess(as_input(data))
    assert image.rows == 12 and image.grid == (6, 8)  # (3, 4) cells: the 3:4 ratio exactly
    assert image.pixels.shape == (48, 588)
    assert np.abs(image.pixels).max() <= 1.0
    assert prep.preprocess(as_input(encode(noise(400, 300, seed=1)))).digest != image.digest


def test_the_digest_follows_the_pixels_not_the_file():
    """The seed: identity hashes the decoded RGB, its dimensions and the vision grid."""
    prep = ImagePreprocessor(max_vision_patches=64)
    picture = noise(120, 90, seed=5)
    fast, small = encode(picture, compress_level=1), encode(picture, compress_level=9, optimize=True)
    assert fast != small
    digest = prep.preprocess(as_input(fast)).digest
    assert prep.preprocess(as_input(small)).digest == digest  # re-encoded, same pixels: same image
    rgba = Image.fromarray(np.dstack([np.asarray(picture), np.full((90, 120), 7, np.uint8)]), "RGBA")
    assert prep.preprocess(as_input(encode(rgba))).digest == digest  # alpha is dropped: the same RGB
    changed = np.asarray(picture).copy()
    changed[45, 60, 1] ^= 1  # one level of one pixel
    assert prep.preprocess(as_input(encode(Image.fromarray(changed)))).digest != digest
    # the same bytes in another shape are another image
    transposed = Image.fromarray(np.asarray(picture).reshape(120, 90, 3))
    assert prep.preprocess(as_input(encode(transposed))).digest != digest
    # the same pixels under another patch budget give other rows: another identity
    assert ImagePreprocessor(max_vision_patches=16).preprocess(as_input(fast)).digest != digest
    # JPEG is lossy (as pillow writes it): the picture as a JPEG decodes to other pixels
    assert prep.preprocess(as_input(encode(picture, "JPEG", quality=95), "image/jpeg")).digest != digest


def test_jpeg_rgba_and_exif_orientation():
    prep = ImagePreprocessor()
    jpeg = prep.preprocess(as_input(encode(noise(60, 30), "JPEG", quality=90), "image/jpeg"))
    assert jpeg.rows == 2
    rgba = noise(56, 28, mode="RGBA")
    rgb = Image.fromarray(np.asarray(rgba)[:, :, :3])
    # alpha is dropped, not composited
    assert np.array_equal(prep.preprocess(as_input(encode(rgba))).pixels, prep.preprocess(as_input(encode(rgb))).pixels)
    # EXIF orientation 6 (rotate 90 degrees clockwise to display): a 56x28 JPEG shows as 28x56
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = prep.preprocess(as_input(encode(noise(56, 28), "JPEG", exif=exif.tobytes()), "image/jpeg"))
    assert rotated.grid == (4, 2)


class FakeTokenizer:
    patch_id, image_start_id, image_end_id = 92, 80, 81


def test_place_images_expands_the_placeholder():
    prep = ImagePreprocessor()
    ids, placed = place_images([1, 5, 92, 6, 7], [as_input(encode(noise(84, 28)))], FakeTokenizer(), prep)
    assert ids == [1, 5, 80] + [92] * 3 + [81, 6, 7]
    assert len(placed) == 1 and placed[0].start == 3 and placed[0].image.rows == 3


def test_placeholder_count_must_match():
    prep = ImagePreprocessor()
    with pytest.raises(ApiError) as info:
        place_images([1, 5, 6], [as_input(encode(noise(28, 28)))], FakeTokenizer(), prep)
    assert info.value.status == 400 and info.value.code == "invalid_image"


def test_text_only_model_refuses_images():
    with pytest.raises(ApiError) as info:
        place_images([1, 92], [as_input(encode(noise(28, 28)))], FakeTokenizer(), None)
    assert (info.value.status, info.value.code) == (400, "invalid_image")
    assert "without a vision projector" in info.value.message
    assert place_images([1, 92], [], FakeTokenizer(), None) == ([1, 92], ())  # no image: untouched


def _truncated_png() -> bytes:
    data = encode(noise(200, 200))
    return data[: len(data) // 2]


def _zero_size_png() -> bytes:
    """A PNG whose IHDR says 0 x 5 (CRC fixed so only the size is wrong)."""
    import struct
    import zlib

    data = bytearray(encode(noise(5, 5)))
    data[16:20] = struct.pack(">I", 0)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _bomb_png() -> bytes:
    return encode(Image.new("1", (9000, 9000)))  # 81 M pixels in a few kB


@pytest.mark.parametrize("make,media_type,needle", [
    (_truncated_png, "image/png", "could not be decoded"),
    (lambda: encode(noise(30, 30), "JPEG"), "image/png", "is a JPEG image, but the data URL says image/png"),
    (lambda: encode(noise(30, 30)), "image/jpeg", "is a PNG image, but the data URL says image/jpeg"),
    (lambda: encode(noise(30, 30), "GIF"), "image/png", "is a GIF image"),
    (lambda: encode(noise(30, 30), "WEBP"), "image/jpeg", "is a WEBP image"),
    (lambda: b"definitely not an image", "image/jpeg", "not a valid JPEG"),
    (_zero_size_png, "image/png", "PNG"),
    (_bomb_png, "image/png", "pixels"),
])
def test_bad_images_are_400_invalid_image(make, media_type, needle):
    with pytest.raises(ApiError) as info:
        ImagePreprocessor().preprocess(as_input(make(), media_type))
    assert (info.value.status, info.value.type, info.value.code) == (400, "invalid_request_error", "invalid_image")
    assert needle in info.value.message


def test_bad_base64_and_oversize():
    prep = ImagePreprocessor(max_image_bytes=1000)
    with pytest.raises(ApiError) as info:
        prep.preprocess(ImageInput("image/png", "not base64!"))
    assert (info.value.status, info.value.code) == (400, "invalid_image")
    with pytest.raises(ApiError) as info:
        prep.preprocess(as_input(encode(noise(100, 100))))
    assert (info.value.status, info.value.code) == (413, "image_too_large")


def test_detail_low_caps_the_patch_budget_and_high_is_the_servers():
    from musegl_core.vision.preprocess import LOW_DETAIL_PATCHES, detail_patches

    assert detail_patches("low", 4096) == LOW_DETAIL_PATCHES == 256
    assert detail_patches("low", 64) == 64  # never above the server's cap
    assert detail_patches("high", 4096) == detail_patches("auto", 4096) == detail_patches(None, 4096) == 4096
    prep = ImagePreprocessor(max_vision_patches=4096)
    data = base64.b64encode(encode(noise(640, 480))).decode()
    rows = {detail: prep.preprocess(ImageInput("image/png", data, detail)).rows for detail in (None, "auto", "high", "low")}
    assert rows[None] == rows["auto"] == rows["high"] == 17 * 23  # smart_resize(480, 640, 1024)
    assert rows["low"] == 7 * 9  # smart_resize(480, 640, 64)
