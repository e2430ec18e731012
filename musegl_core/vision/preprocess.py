"""Image preprocessing and placement in the prompt.

Runs on a preparation thread of the worker (the heavy lane,
:mod:`musegl_core.worker.preparation`), once per request, with numpy and
pillow only. Before anything is decoded, each image's header is read and the
request's decode budget checked (:meth:`ImagePreprocessor.admit`: at most
:data:`MAX_PIXELS` per image, :data:`MAX_REQUEST_PIXELS` and
:data:`MAX_DECODE_WORK` per request). Then:

1. decode the inline PNG/JPEG bytes with pillow, restricted to the declared
   format; apply the EXIF orientation, drop alpha (``convert("RGB")``); the
   image's identity is the hash of these RGB pixels, their size and the grid
   (:func:`~musegl_core.engine.identity.image_digest`), not of the file;
2. pick the target grid with :func:`smart_resize` under the merged-cell cap
   (``--max-vision-patches / 4``: complete four-patch groups; an image sent
   with ``detail: "low"`` gets at most :data:`LOW_DETAIL_PATCHES`, see
   :func:`detail_patches`);
3. resize with pillow's LANCZOS (skipped when the size already fits);
4. rescale and normalize: ``(float32(x) - 127.5) / 127.5``;
5. patchify into one row per 14x14 patch in raster order, 588 columns
   ``ch·196 + py·14 + px``: the single frame of transformers' 1176-wide row
   (whose second temporal slot is a copy of the first, see
   :func:`pixel_values`).

:func:`place_images` then expands each ``<|patch|>`` placeholder id of the
tokenized prompt into ``<|image_start|>`` + N x ``<|patch|>`` +
``<|image_end|>`` and returns the :class:`PlacedImage` list the engine
needs. Every failure is an :class:`~musegl_core.errors.ApiError` (400
``invalid_image``, or 413 ``image_too_large``), never a crash.

Known difference to transformers: transformers resizes with torch's uint8
lanczos ``interpolate``; pillow's LANCZOS differs from it by at most a few
levels on a small share of pixels of a *resized* image. Images whose size
is already a multiple of 28 (within the cap) are not resized and are
bit-identical.
"""

from __future__ import annotations

import base64
import binascii
import io
import itertools
import math
import warnings
from typing import Sequence

import attrs
import numpy as np

from musegl_core.engine.executor import PromptImage
from musegl_core.engine.identity import image_digest
from musegl_core.engine.request import ImageInput, PlacedImage
from musegl_core.errors import ApiError

PATCH = 14
MERGE = 2
UNIT = PATCH * MERGE  # 28 px: one merged cell
FRAME_COLUMNS = 3 * PATCH * PATCH  # 588: one frame of a patch row
TEMPORAL = 2
#: Images with more pixels than this are refused before they are decoded
#: (decompression bombs): 8192 x 8192.
MAX_PIXELS = 8192 * 8192
#: The pixels one request may decode, all its images together (read from the
#: headers before any image is decoded): one image of the largest size.
MAX_REQUEST_PIXELS = MAX_PIXELS
#: The decode work one request may cost, in pixel-scans: an image's pixels
#: times its scans (a progressive JPEG is decoded scan by scan, each scan over
#: the whole image; PNG and baseline JPEG count one). Twelve scans of the
#: largest image: progressive encoders write about ten.
MAX_DECODE_WORK = 12 * MAX_PIXELS
#: The pillow format each accepted media type must actually be.
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG"}
#: The patch budget of an image sent with ``detail: "low"`` (64 image rows, about
#: a 224 x 224-pixel view; OpenAI's low detail is a fixed small budget too).
LOW_DETAIL_PATCHES = 256


def detail_patches(detail: str | None, max_vision_patches: int) -> int:
    """The patch budget of one image: ``low`` at most :data:`LOW_DETAIL_PATCHES`;
    ``high``, ``auto`` and no detail the server's whole ``--max-vision-patches``
    (its most detailed view: a higher one is not offered)."""
    if detail == "low":
        return min(LOW_DETAIL_PATCHES, max_vision_patches)
    return max_vision_patches


def invalid_image(message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", "invalid_image")


def smart_resize(height: int, width: int, max_cells: int, unit: int = UNIT) -> tuple[int, int]:
    """The merged grid ``(gh, gw)`` for an image of ``height x width`` pixels:
    the floor/ceil pair of ``(height/unit, width/unit)`` (scaled down first to
    keep the product within ``max_cells``) whose ratio is closest to the
    image's. The candidates are built as a Python set exactly as transformers
    does, so ties resolve the same way. The product never exceeds
    ``max_cells``: an image so thin that one side is under one cell (a
    200,000 x 1 PNG) gets one cell on that side and at most ``max_cells`` on
    the other."""
    a, b = height / unit, width / unit
    ratio = b / a if a > 0 else 1.0
    if a * b > max_cells:
        a = (max_cells / ratio) ** 0.5
        b = a * ratio
    candidates = list(set(itertools.product([math.floor(a), math.ceil(a)], [math.floor(b), math.ceil(b)])))
    candidates = [(h, w) for h, w in candidates if h >= 1 and w >= 1 and h * w <= max_cells]
    if not candidates:  # a side under one cell (an extreme aspect ratio): one cell there, the other side capped
        rows = max(1, min(round(a), max_cells))
        candidates = [(rows, max(1, min(round(b), max_cells // rows)))]
    return min(candidates, key=lambda grid: abs(grid[0] / grid[1] - height / width))


def decode_image(data: bytes, media_type: str):
    """The RGB pillow image of ``data``, which must be a complete image of
    ``media_type`` (PNG or JPEG). EXIF orientation applied, alpha dropped."""
    from PIL import Image, ImageOps

    fmt = FORMATS.get(media_type)
    if fmt is None:
        raise invalid_image(f"Unsupported image media type {media_type!r}; send image/png or image/jpeg.")
    kind = media_type.split("/")[1].upper()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[fmt])
            width, height = image.size
            if width < 1 or height < 1:
                raise invalid_image(f"The {kind} image has no pixels ({width}x{height}).")
            if width * height > MAX_PIXELS:
                raise invalid_image(f"The {kind} image is {width}x{height} pixels; at most {MAX_PIXELS} "
                                    "pixels are decoded.")
            image.load()
            image = ImageOps.exif_transpose(image)
            return image.convert("RGB")
    except ApiError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise invalid_image(f"The {kind} image is too large to decode (decompression bomb).") from None
    except Image.UnidentifiedImageError:
        raise not_the_declared_format(data, media_type) from None
    except Exception as exc:  # truncated or corrupt data, decoder limits: never a crash
        raise invalid_image(f"The {kind} image could not be decoded: {exc}") from None


def not_the_declared_format(data: bytes, media_type: str) -> ApiError:
    """The 400 for data that is not an image of ``media_type``: it names the format
    pillow recognises in the header (a GIF or WebP labelled PNG), without decoding."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as probe:
            actual = probe.format
    except Exception:
        actual = None
    if actual is not None and actual != FORMATS.get(media_type):
        return invalid_image(f"The image data is a {actual} image, but the data URL says {media_type}; "
                             "send PNG or JPEG, labelled as what it is.")
    kind = media_type.split("/")[1].upper()
    return invalid_image(f"The image data is not a valid {kind} image (data URL says {media_type}).")


def jpeg_scans(data: bytes) -> int:
    """The number of scans (SOS segments) of JPEG ``data``, from its marker
    structure alone: segments are skipped by their lengths, entropy-coded data
    up to the next marker (stuffed ``FF 00`` bytes and restart markers are part
    of it). Malformed data ends the count; the decoder then reports it."""
    end = len(data)
    if data[:2] != b"\xff\xd8":
        return 0
    pos, scans = 2, 0
    while pos + 1 < end:
        if data[pos] != 0xFF:
            return scans
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0xD9:  # end of image
            return scans
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # markers without a segment
            pos += 2
            continue
        if pos + 4 > end:
            return scans
        pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker != 0xDA:
            continue
        scans += 1
        while True:  # the scan's entropy-coded data runs to the next marker
            pos = data.find(b"\xff", pos)
            if pos < 0 or pos + 1 >= end:
                return scans
            following = data[pos + 1]
            if following == 0x00 or 0xD0 <= following <= 0xD7:
                pos += 2
            elif following == 0xFF:
                pos += 1
            else:
                break
    return scans


@attrs.frozen
class DecodeCost:
    """What decoding one image costs, read from its header without decoding it."""

    width: int
    height: int
    scans: int = 1

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def work(self) -> int:
        """Pixel-scans (see :data:`MAX_DECODE_WORK`)."""
        return self.pixels * max(1, self.scans)


def decode_cost(data: bytes, media_type: str) -> DecodeCost:
    """The dimensions (and JPEG scans) of ``data`` from its header; 400
    ``invalid_image`` when the header cannot be read or names too many pixels."""
    from PIL import Image

    fmt = FORMATS.get(media_type)
    if fmt is None:
        raise invalid_image(f"Unsupported image media type {media_type!r}; send image/png or image/jpeg.")
    kind = media_type.split("/")[1].upper()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=[fmt]) as image:
                width, height = image.size
    except Image.UnidentifiedImageError:
        raise not_the_declared_format(data, media_type) from None
    except Image.DecompressionBombError:
        raise invalid_image(f"The {kind} image is too large to decode (decompression bomb).") from None
    except Exception as exc:  # a truncated or corrupt header
        raise invalid_image(f"The {kind} image header could not be read: {exc}") from None
    if width < 1 or height < 1:
        raise invalid_image(f"The {kind} image has no pixels ({width}x{height}).")
    if width * height > MAX_PIXELS:
        raise invalid_image(f"The {kind} image is {width}x{height} pixels; at most {MAX_PIXELS} pixels are decoded.")
    return DecodeCost(width, height, jpeg_scans(data) if fmt == "JPEG" else 1)


def check_decode_budget(costs: Sequence[DecodeCost]) -> None:
    """Refuse (400 ``invalid_image``) a request whose images together exceed
    :data:`MAX_REQUEST_PIXELS` or :data:`MAX_DECODE_WORK`, before any is decoded."""
    pixels = sum(cost.pixels for cost in costs)
    if pixels > MAX_REQUEST_PIXELS:
        raise invalid_image(f"The request's images have {pixels} pixels together; at most {MAX_REQUEST_PIXELS} "
                            "pixels are decoded per request.")
    work = sum(cost.work for cost in costs)
    if work > MAX_DECODE_WORK:
        scans = max(cost.scans for cost in costs)
        raise invalid_image(f"Decoding the request's images would take {work} pixel-scans (a JPEG of up to "
                            f"{scans} progressive scans); at most {MAX_DECODE_WORK} are decoded per request "
                            "(pixels x scans). Re-encode the image as baseline JPEG or PNG.")


def patchify(pixels: np.ndarray) -> np.ndarray:
    """``(H, W, 3)`` float32 → ``(gh·gw, 588)`` patch rows in raster order,
    column ``ch·196 + py·14 + px``."""
    height, width, _ = pixels.shape
    gh, gw = height // PATCH, width // PATCH
    patches = pixels.reshape(gh, PATCH, gw, PATCH, 3).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(patches.reshape(gh * gw, FRAME_COLUMNS))


def pixel_values(image: PromptImage) -> np.ndarray:
    """transformers' ``pixel_values`` of an image: the frame duplicated into both
    temporal slots (``col = t·588 + ...``), shape ``(patches, 1176)``."""
    return np.concatenate([image.pixels] * TEMPORAL, axis=1)


@attrs.frozen
class ImagePreprocessor:
    """The worker's image preprocessing under the serving limits.

    ``max_vision_patches`` caps the ViT patches of one image (rounded down to
    complete four-patch groups: ``max_vision_patches // 4`` merged rows);
    ``max_image_bytes`` caps the compressed bytes (413 ``image_too_large``).
    """

    max_vision_patches: int = 4096
    max_image_bytes: int = 20 << 20

    @property
    def max_cells(self) -> int:
        return self.cells(None)

    def cells(self, detail: str | None) -> int:
        """The merged-cell cap of an image with ``detail`` (:func:`detail_patches`)."""
        return max(1, detail_patches(detail, self.max_vision_patches) // (MERGE * MERGE))

    def decode_data(self, image: ImageInput) -> bytes:
        try:
            data = base64.b64decode(image.data, validate=True)
        except (binascii.Error, ValueError):
            raise invalid_image("The image data is not valid base64.") from None
        if not data:
            raise invalid_image("The image data is empty.")
        if len(data) > self.max_image_bytes:
            raise image_too_large(len(data), self.max_image_bytes)
        return data

    def admit(self, images: Sequence[ImageInput]) -> list[bytes]:
        """The compressed bytes of ``images``, after the cheap checks: base64,
        the byte limit, the header of each (format, at most :data:`MAX_PIXELS`)
        and the request's decode budget (:func:`check_decode_budget`); nothing
        is decoded yet."""
        data = [self.decode_data(image) for image in images]
        check_decode_budget([decode_cost(d, image.media_type) for d, image in zip(data, images)])
        return data

    def preprocess(self, image: ImageInput) -> PromptImage:
        """Decode, resize, normalize and patchify one image."""
        data = self.decode_data(image)
        return self.preprocess_bytes(data, image.media_type, image.detail)

    def preprocess_bytes(self, data: bytes, media_type: str, detail: str | None = None) -> PromptImage:
        from PIL import Image

        rgb = decode_image(data, media_type)
        gh, gw = smart_resize(rgb.height, rgb.width, self.cells(detail))
        grid = (gh * MERGE, gw * MERGE)
        decoded = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))
        digest = image_digest(decoded, rgb.width, rgb.height, grid)
        size = (gw * UNIT, gh * UNIT)
        if rgb.size != size:
            decoded = np.asarray(rgb.resize(size, Image.Resampling.LANCZOS), dtype=np.uint8)
        values = (decoded.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)
        return PromptImage(digest=digest, rows=gh * gw, pixels=patchify(values), grid=grid)


def image_too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"The image is {size} bytes; this server accepts at most {limit} bytes per image "
                         "(--max-image-bytes).", "invalid_request_error", "image_too_large")


def place_images(ids: Sequence[int], images: Sequence[ImageInput], tokenizer,
                 preprocessor: ImagePreprocessor | None,
                 admitted: Sequence[bytes] | None = None) -> tuple[list[int], tuple[PlacedImage, ...]]:
    """Expand the ``<|patch|>`` placeholder of each image (the i-th placeholder
    for the i-th image) into ``<|image_start|>`` + N x ``<|patch|>`` +
    ``<|image_end|>``; returns the new ids and where each image's rows sit.

    ``preprocessor`` None means the model cannot see images: any image is a
    400 ``invalid_image``. ``admitted`` is what :meth:`ImagePreprocessor.admit`
    returned for ``images`` when the caller ran the cheap checks already.
    """
    if not images:
        return list(ids), ()
    if preprocessor is None:
        raise invalid_image("This model was loaded without a vision projector, so it cannot read images; "
                            "send text only (or start the server with a vision checkpoint / --mmproj).")
    patch = tokenizer.patch_id
    at = [i for i, token in enumerate(ids) if token == patch]
    if len(at) != len(images):
        raise ApiError(400, f"the prompt has {len(at)} <|patch|> placeholder(s) for {len(images)} image(s)",
                       "invalid_request_error", "invalid_image")
    if admitted is None:
        admitted = preprocessor.admit(images)
    prepared = [preprocessor.preprocess_bytes(data, image.media_type, image.detail)
                for data, image in zip(admitted, images)]
    start_id, end_id = tokenizer.image_start_id, tokenizer.image_end_id
    out: list[int] = []
    placed: list[PlacedImage] = []
    last = 0
    for position, image in zip(at, prepared):
        out.extend(ids[last:position])
        out.append(start_id)
        placed.append(PlacedImage(len(out), image))
        out.extend([patch] * image.rows)
        out.append(end_id)
        last = position + 1
    out.extend(ids[last:])
    return out, tuple(placed)


def vision_patches(requested: int, info) -> int:
    """``--max-vision-patches`` clipped to what the executor's vision encoder takes
    (``ModelInfo.vision_patches``: an exported program's capacity; None: no limit)."""
    return requested if info.vision_patches is None else min(requested, info.vision_patches)
