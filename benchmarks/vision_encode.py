"""Image preprocessing + encoding time for one 1024x768 image.

Builds the vision tower (ViT, pixel shuffle, adapter, projection, perception
norm) at a shape with seeded random weights, preprocesses a synthetic
1024x768 PNG and JPEG with the worker's preprocessor, encodes it, and prints
one JSON line per format: the rows the image becomes, the median
preprocessing time (CPU, pillow) and the median encoding time (the device).

    python benchmarks/vision_encode.py                      # tiny tower, CPU, float32
    python benchmarks/vision_encode.py --shape 30b --device cuda --dtype bfloat16

``--shape 30b`` is the Muse Glimmer 30B vision tower (50 layers, hidden 1536,
16 heads, MLP 8960, projection to 6656); ``tiny`` the demo projector's shape.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time

import attrs
import numpy as np
import torch
from PIL import Image

from musegl_core.checkpoint.vision import VisionConfig, VisionWeights, vision_shape
from musegl_core.engine.request import ImageInput
from musegl_core.vision.preprocess import ImagePreprocessor
from musegl_cuda.vision import load_vision_encoder

SHAPES = {
    "30b": VisionConfig(hidden_size=1536, intermediate_size=8960, num_layers=50, num_heads=16, pos_side=32,
                        full=VisionConfig.default_full(50), out_hidden_size=6144, projector_hidden_size=4096,
                        text_hidden_size=6656),
    "tiny": VisionConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, pos_side=4,
                         full=VisionConfig.default_full(2), out_hidden_size=128, projector_hidden_size=64,
                         text_hidden_size=64),
}


class RandomVisionWeights(VisionWeights):
    """Seeded random weights in the layout the readers produce (norm scales 1, biases 0)."""

    def __init__(self, config: VisionConfig, seed: int = 0):
        self.source, self.config, self.path, self.seed = "random", config, None, seed

    def read(self, name: str) -> np.ndarray:
        rng = np.random.default_rng([self.seed, sum(map(ord, name))])
        shape = vision_shape(self.config, name)
        if name.endswith("bias"):
            return np.zeros(shape, np.float32)
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)


@attrs.frozen
class TextShape:
    hidden_size: int
    rms_norm_eps: float = 1e-5


def synthetic_image(fmt: str) -> bytes:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:768, 0:1024]
    pixels = np.stack([x % 256, y % 256, (x * y) % 256], -1) + rng.integers(-20, 21, (768, 1024, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format=fmt)
    return buffer.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-vision-patches", type=int, default=4096)
    args = p.parse_args()
    config = SHAPES[args.shape]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    started = time.perf_counter()
    encoder = load_vision_encoder(RandomVisionWeights(config), TextShape(config.text_hidden_size),
                                  dtype, device)
    print(json.dumps({"shape": args.shape, "device": str(device), "dtype": args.dtype,
                      "build_s": round(time.perf_counter() - started, 2)}), flush=True)
    preprocessor = ImagePreprocessor(args.max_vision_patches)
    for fmt, media_type in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
        data = synthetic_image(fmt)
        image = ImageInput(media_type, base64.b64encode(data).decode())
        preprocess, encode = [], []
        for _ in range(args.repeats + 1):  # the first run warms up (allocations, kernels)
            t0 = time.perf_counter()
            prompt_image = preprocessor.preprocess(image)
            t1 = time.perf_counter()
            with torch.inference_mode():
                rows = encoder(torch.as_tensor(prompt_image.pixels, device=device), tuple(prompt_image.grid))
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            preprocess.append(t1 - t0)
            encode.append(t2 - t1)
        print(json.dumps({
            "format": fmt, "bytes": len(data), "rows": int(rows.shape[0]), "grid": list(prompt_image.grid),
            "preprocess_ms_median": round(1000 * statistics.median(preprocess[1:]), 1),
            "encode_ms_median": round(1000 * statistics.median(encode[1:]), 1),
        }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
