"""Tiny FP8 checkpoints written by compressed-tensors, as llm-compressor saves them.

A float32 transformers ``MuseGlimmerForConditionalGeneration``
(:func:`~musegl_core.testing.reference_models.build_tiny_model`) gets one of
compressed-tensors' FP8 presets on the text decoder's projections (``FP8``: one
weight scale per tensor; ``FP8_DYNAMIC``: one per output channel; ``FP8_BLOCK``:
128 x 128 blocks). The weight scales are computed the way llm-compressor's
min-max observer does (the range of each tensor / row / block, through
compressed-tensors' ``calculate_qparams``), then ``ModelCompressor`` compresses
the model (e4m3 weights + ``weight_scale``) and writes the ``quantization_config``.
The same compressor's ``decompress_model`` gives the dequantized float32 weights,
saved as a second checkpoint: the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

#: hidden 128 and an MLP of 384: the FP8_BLOCK preset's 128 x 128 blocks tile the MLP
#: matrices into several blocks (the attention matrices are one partial block each)
SHAPE = dict(hidden_size=128, intermediate_size=384)


def _calibrate(model) -> None:
    """Min-max weight scales for every quantized module (what llm-compressor's observer
    computes before it saves), through compressed-tensors' own ``calculate_qparams``."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams

    for _, module in list(model.named_modules()):
        if not hasattr(module, "weight_scale"):
            continue
        args = module.quantization_scheme.weights
        w = module.weight.data
        if args.strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        elif args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:  # block: the partial blocks at the edges padded with zeros (no effect on a symmetric range)
            bn, bk = args.block_structure
            rows, cols = w.shape
            padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk, dtype=w.dtype)
            padded[:rows, :cols] = w
            blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
            lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
        scale, _ = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))


def _save(model, directory: Path, quantization_config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not k.endswith(("input_scale", "input_zero_point", "weight_zero_point"))}
    save_file(state, str(directory / "model.safetensors"))
    model.config.save_pretrained(directory)
    if quantization_config is not None:
        config = json.loads((directory / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def write_fp8_checkpoint(directory: Path, preset: str = "FP8_DYNAMIC", seed: int = 5) -> tuple[Path, Path]:
    """``(fp8, dequantized)``: the compressed-tensors FP8 checkpoint of a tiny model
    (``directory/fp8``) and the same weights dequantized by compressed-tensors, float32
    (``directory/dequantized``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus,
                                                 apply_quantization_config, preset_name_to_scheme)

    from musegl_core.testing.reference_models import build_tiny_model

    model = build_tiny_model(seed=seed, **SHAPE)
    scheme = preset_name_to_scheme(preset, ["re:.*language_model.*_proj$"])
    config = QuantizationConfig(config_groups={"group_0": scheme},
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    _calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    fp8 = _save(model, Path(directory) / "fp8")
    compressor.update_config(str(fp8))  # the quantization_config as compressed-tensors writes it
    compressor.decompress_model(model)
    plain = _save(model, Path(directory) / "dequantized")
    config = json.loads((plain / "config.json").read_text())
    config.pop("quantization_config", None)
    (plain / "config.json").write_text(json.dumps(config, indent=2))
    return fp8, plain


def write_hf_fp8_checkpoint(source: Path, directory: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """The float32 checkpoint ``source`` in the HF ``quant_method: fp8`` layout (DeepSeek-V3
    style, what transformers' ``FineGrainedFP8Config`` loads): e4m3 ``weight`` and float32
    ``weight_scale_inv`` per ``block`` of the projections, ``weight = q · scale_inv``."""
    import torch
    from safetensors.torch import load_file, save_file

    from musegl_cuda.quantization import E4M3_MAX

    state = load_file(str(Path(source) / "model.safetensors"))
    out = {}
    bn, bk = block
    for name, value in state.items():
        if "language_model" in name and name.endswith("_proj.weight"):
            rows, cols = value.shape
            padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk)
            padded[:rows, :cols] = value
            blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
            scale = blocks.abs().amax((1, 3)) / E4M3_MAX
            full = scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
            out[name] = (value / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            out[name.removesuffix("weight") + "weight_scale_inv"] = scale.contiguous()
        else:
            out[name] = value
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(out, str(directory / "model.safetensors"))
    config = json.loads((Path(source) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
