"""Prompt identity: what sessions and prefix reuse compare.

Token rows are identified by their id. Image rows all carry the same
placeholder id, so they are identified by the image's content instead. The
content is what the model sees, not the file: :func:`image_digest` hashes the
decoded RGB pixels, their dimensions and the vision grid, so the same picture
re-encoded (another PNG compression level, alpha dropped or not) is the same
image, while one changed pixel or another patch budget is another. Row ``i``
of an image with digest ``D`` gets the negative key
``-(1 + (h(D) + i) mod 2^62)``, which no token id can equal. Two prompts
share a prefix exactly as far as their tokens and their images agree, so a
session that resubmits the same image reuses the cached rows past it, and a
different image at the same place ends the reuse there.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import attrs

from musegl_core.engine.request import PlacedImage, PreparedRequest

_SPAN = 1 << 62


def image_digest(rgb, width: int, height: int, grid: tuple[int, int]) -> str:
    """The identity of an image: SHA-256 of its size, its vision grid (patches,
    height x width) and its decoded RGB bytes (``height x width x 3`` uint8, row
    major: any buffer, e.g. a contiguous numpy array)."""
    digest = hashlib.sha256(b"musegl-image-v2")
    digest.update(struct.pack("<4q", width, height, *grid))
    digest.update(memoryview(rgb).cast("B"))
    return "rgb:" + digest.hexdigest()


def _base(digest: str) -> int:
    return int.from_bytes(hashlib.blake2b(digest.encode(), digest_size=8).digest(), "little") % _SPAN


def prompt_keys(prompt_ids: Sequence[int], images: Sequence[PlacedImage]) -> list[int]:
    """The identity keys of a prompt: its ids, with image rows replaced."""
    keys = list(prompt_ids)
    for placed in images:
        base = _base(placed.image.digest)
        for row in range(placed.image.rows):
            keys[placed.start + row] = -(1 + (base + row) % _SPAN)
    return keys


def split_keys(keys: Sequence[int], request: PreparedRequest) -> tuple[list[int], tuple[PlacedImage, ...]]:
    """The ids to feed and the image placements of ``keys`` (which may have
    moved, when generated-token replay changed the length of earlier turns).
    Images are matched to their rows in order, so the same image twice in a
    prompt keeps two placements."""
    if not request.images:
        return list(keys), ()
    placeholders: dict[int, int] = {}  # image row key -> placeholder id
    pending: dict[int, list[int]] = {}  # key of an image's first row -> its indices, in prompt order
    for index, placed in enumerate(request.images):
        base = _base(placed.image.digest)
        placeholder = request.prompt_ids[placed.start]
        for row in range(placed.image.rows):
            placeholders[-(1 + (base + row) % _SPAN)] = placeholder
        pending.setdefault(-(1 + base % _SPAN), []).append(index)
    ids: list[int] = []
    starts: dict[int, int] = {}
    for position, key in enumerate(keys):
        if key >= 0:
            ids.append(key)
            continue
        ids.append(placeholders[key])
        queue = pending.get(key)
        if queue:
            starts[queue.pop(0)] = position
    placed = tuple(attrs.evolve(p, start=starts.get(i, p.start)) for i, p in enumerate(request.images))
    return ids, placed
