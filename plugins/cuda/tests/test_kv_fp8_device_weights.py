"""FP8 KV scales of a model whose matrices are CUDA device matrices (``--weights stored`` on
CUDA: a quantized checkpoint, or ``--quantization fp8``). Their torch parameters stay on
"meta", so the V scales read V's rows from the device matrices: the float32 rows the CPU
reference decodes from the same file, so the same scales. Built on the CPU (the device
matrices take any device); GGUF rows are decoded by the Triton kernel, in the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def device_weight_scales(path, quantization=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_scales`` of the file's model with device matrices, and of the CPU reference
    (the stored model, float32 decodes; ``quantization``: the matrices quantized at load)."""
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_cuda import kv_fp8
    from musegl_cuda.model import MuseGlimmerDecoder
    from musegl_cuda.quantization import quantized_stored

    checkpoint = load_checkpoint(path)
    device = MuseGlimmerDecoder(checkpoint.config, torch.float32, torch.device("cpu"), device_weights=True)
    reference = MuseGlimmerDecoder(checkpoint.config, torch.float32, torch.device("cpu"), stored=True)
    for stored in checkpoint.iter_stored():
        device.load_device(stored, quantization)
        reference.load_stored(quantized_stored(stored) if quantization else stored)
    device.finish_device()
    reference.finish_stored()
    return kv_fp8.layer_scales(device), kv_fp8.layer_scales(reference)


def check_q4_k_m(directory: str) -> None:
    from q4km_support import small_config, write_q4_k_m

    got, want = device_weight_scales(write_q4_k_m(Path(directory), small_config(layers=2)))
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_device_matrices_give_the_reference_s_v_scales(tiny_gguf, quantization):
    pytest.importorskip("triton")  # device_weights imports the kernels (none runs here)
    got, want = device_weight_scales(tiny_gguf, quantization)
    assert torch.isfinite(got).all() and (got > 0).all()
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.slow  # Triton's interpreter decodes the GGUF rows
def test_gguf_device_matrices_give_the_reference_s_v_scales_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); "
            f"from test_kv_fp8_device_weights import check_q4_k_m; check_q4_k_m({str(tmp_path)!r})")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
