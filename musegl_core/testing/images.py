"""Test images: PNG bytes with content that resizing and patching really change."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def png(width: int, height: int, seed: int) -> bytes:
    """A ``width`` x ``height`` RGB PNG: a gradient in each channel plus noise drawn from ``seed``
    (smooth enough that resizing does something real, varied enough that patches differ)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    values = np.clip(base + rng.integers(-40, 41, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(values).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    """``data`` as the inline data URL a chat message's ``image_url`` carries."""
    return f"data:{media_type};base64," + base64.b64encode(data).decode()
