"""Quantized weights as stored on CUDA (GGUF k-quants, FP8), proven on the CPU.

* The weights mode CUDA picks for each kind of checkpoint, and the flag checks.
* FP8 checkpoints written by compressed-tensors (per-tensor, per-channel and
  128 x 128 block scales) and in the HF ``quant_method: fp8`` layout load as stored
  (e4m3 bytes and their scales) and decode exactly to the weights compressed-tensors
  itself dequantizes; the torch-cpu executor's logits on the FP8 checkpoint equal, bit
  for bit, its logits on the dequantized checkpoint. ``--quantization fp8`` likewise.
* Slow tier, Triton's interpreter: the kernels of :mod:`musegl_cuda.cuda.quantized`
  against gguf-py's dequantizers and float32 FP8 references
  (:mod:`quantized_checks`), and a Q4_K_M-typed GGUF run through them, embedding and
  head included, against the same file dequantized.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("file_type, quantization, want", [
    ("q4_k_m", None, "stored"), ("q8_0", None, "stored"), ("f8_e4m3", None, "stored"),
    ("bf16", None, "upcast"), ("mixed", None, "upcast"), ("bf16", "fp8", "stored"),
])
def test_cuda_keeps_quantized_checkpoints_as_stored(file_type, quantization, want):
    from musegl_cuda.executor import resolve_weights

    assert resolve_weights(None, torch.device("cuda"), torch.bfloat16, file_type, quantization) == want


def test_weight_mode_checks():
    from musegl_cuda.executor import resolve_weights

    assert resolve_weights(None, torch.device("cpu"), torch.float32, "f32", "fp8") == "stored"
    assert resolve_weights("stored", torch.device("cuda"), torch.bfloat16, "q4_k_m") == "stored"
    with pytest.raises(ValueError, match="needs weights 'stored'"):
        resolve_weights("upcast", torch.device("cuda"), torch.bfloat16, "bf16", "fp8")
    with pytest.raises(ValueError, match="float32 activations"):
        resolve_weights("stored", torch.device("cpu"), torch.bfloat16, "bf16")
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_weights(None, torch.device("cuda"), torch.bfloat16, "bf16", "int4")


# -- FP8 checkpoints ---------------------------------------------------------------


@pytest.fixture(scope="module", params=["FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def fp8_checkpoint(request, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    sys.path.insert(0, str(HERE))
    from fp8_checkpoint_support import write_fp8_checkpoint

    fp8, plain = write_fp8_checkpoint(tmp_path_factory.mktemp(request.param.lower()), request.param)
    return request.param, fp8, plain


def test_fp8_checkpoint_loads_as_stored_and_decodes_to_its_dequantized_weights(fp8_checkpoint):
    from musegl_core.checkpoint.loader import load_checkpoint

    preset, fp8, plain = fp8_checkpoint
    quantized, reference = load_checkpoint(fp8), load_checkpoint(plain)
    assert quantized.file_type == "f8_e4m3"
    blocks = set()
    for name in quantized.tensor_names:
        stored = quantized.read_stored(name)
        if name.endswith("_proj.weight"):
            assert stored.dtype == "f8_e4m3" and stored.data.dtype == np.uint8 and stored.data.shape == stored.shape
            blocks.add("tensor" if stored.scales.size == 1 else "row" if stored.scale_block[0] == 1 else
                       stored.scale_block)
            assert np.array_equal(stored.to_float32(), reference.read(name)), name
            assert np.array_equal(quantized.read(name), reference.read(name)), name
        else:
            assert stored.dtype == "f32"  # the embedding, head and norms stay as the tool left them
    # FP8_BLOCK: the MLP's 384 x 128 and 128 x 384 matrices hold 3 blocks, the attention's one
    assert blocks == {"FP8": {"tensor"}, "FP8_DYNAMIC": {"row"}, "FP8_BLOCK": {(128, 128), "tensor"}}[preset]


def _run_logits(path, **kwargs) -> torch.Tensor:
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.executor import TorchExecutor

    executor = TorchExecutor(load_checkpoint(path), device="cpu", dtype="float32", **kwargs)
    executor.allocate_kv(8)
    prompt = list(np.random.default_rng(0).integers(4, 500, size=20))
    out = executor.step(Step([SeqChunk(0, prompt, list(range(20)), list(range(8)), logit_rows=True)]))
    rows = [torch.as_tensor(out.logits[0]).float()]
    token = int(rows[-1][-1].argmax())
    out = executor.step(Step([SeqChunk(0, [token], [20], list(range(8)), logit_rows=True)]))
    rows.append(torch.as_tensor(out.logits[0]).float())
    executor.close()
    return torch.cat(rows)


def test_torch_cpu_runs_an_fp8_checkpoint_exactly_as_its_dequantized_weights(fp8_checkpoint):
    _, fp8, plain = fp8_checkpoint
    assert torch.equal(_run_logits(fp8), _run_logits(plain, weights="stored"))


def test_hf_fp8_block_layout_loads_as_stored(fp8_checkpoint, tmp_path):
    from fp8_checkpoint_support import write_hf_fp8_checkpoint

    from musegl_core.checkpoint.loader import load_checkpoint

    preset, _, plain = fp8_checkpoint
    if preset != "FP8_DYNAMIC":
        pytest.skip("one source checkpoint is enough")
    hf = write_hf_fp8_checkpoint(plain, tmp_path / "hf_fp8")
    checkpoint = load_checkpoint(hf)
    stored = checkpoint.read_stored("layers.0.mlp.gate_proj.weight")
    assert stored.dtype == "f8_e4m3" and stored.scale_block == (128, 128) and stored.scales.shape == (3, 1)
    reference = load_checkpoint(plain).read("layers.0.mlp.gate_proj.weight")
    assert np.abs(stored.to_float32() - reference).max() <= np.abs(reference).max() / 8  # e4m3's 3 mantissa bits
    assert torch.equal(_run_logits(hf), _run_logits(_dequantized_copy(checkpoint, tmp_path / "hf_plain", plain),
                                                    weights="stored"))


def _dequantized_copy(checkpoint, directory: Path, like: Path) -> Path:
    """``checkpoint``'s weights as :meth:`Checkpoint.read` decodes them, float32 safetensors."""
    import shutil

    from safetensors.numpy import save_file

    directory.mkdir()
    shutil.copy(like / "config.json", directory / "config.json")
    save_file({f"model.language_model.{n}" if n != "lm_head.weight" else n: checkpoint.read(n)
               for n in checkpoint.tensor_names}, str(directory / "model.safetensors"))
    return directory


def test_quantization_fp8_on_the_cpu_runs_the_quantized_weights_exactly(fp8_checkpoint, tmp_path):
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_cuda.quantization import quantized_stored

    preset, _, plain = fp8_checkpoint
    if preset != "FP8_DYNAMIC":
        pytest.skip("one source checkpoint is enough")
    checkpoint = load_checkpoint(plain)
    stored = quantized_stored(checkpoint.read_stored("layers.1.self_attn.o_proj.weight"))
    assert stored.dtype == "f8_e4m3" and stored.scale_block == (1, 64) and stored.scales.shape == (128, 1)

    class Quantized:  # the checkpoint's weights through quantize -> dequantize, for the reference copy
        tensor_names = checkpoint.tensor_names

        @staticmethod
        def read(name):
            return quantized_stored(checkpoint.read_stored(name)).to_float32()

    reference = _dequantized_copy(Quantized, tmp_path / "fp8_dequantized", plain)
    assert torch.equal(_run_logits(plain, quantization="fp8"), _run_logits(reference, weights="stored"))


# -- the Triton kernels in the interpreter ------------------------------------------


def _interpreted(code: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); {code}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow  # Triton's interpreter: ~25 s on two cores
def test_quantized_kernels_match_the_references_in_the_interpreter():
    pytest.importorskip("triton")
    _interpreted("import torch; from quantized_checks import check_gguf, check_fp8; "
                 "check_gguf('cpu', torch.float32); check_fp8('cpu', torch.float32)")


@pytest.mark.slow  # Triton's interpreter: ~40 s on two cores
def test_decode_gemv_kernels_and_w8a8_activations_match_the_references_in_the_interpreter():
    pytest.importorskip("triton")
    _interpreted("import torch; from quantized_checks import check_gemv, check_quantize_rows; "
                 "check_gemv('cpu', torch.float32); check_quantize_rows('cpu', torch.float32); "
                 "check_quantize_rows('cpu', torch.bfloat16)")


@pytest.mark.slow  # Triton's interpreter: ~25 s on two cores
def test_q4_k_m_file_runs_as_stored_through_the_kernels_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    _interpreted(f"from q4km_support import write_q4_k_m; from quantized_checks import check_gguf_model; "
                 f"from pathlib import Path; r = check_gguf_model(write_q4_k_m(Path({str(tmp_path)!r}))); "
                 "assert r['types'] == ['q4_k', 'q6_k'], r")


def test_fp8_matrix_gathers_stacks_and_runs_w8a8_without_the_kernels():
    pytest.importorskip("triton")
    from musegl_cuda.cuda.device_weights import FP8Matrix, MatrixGroup
    from musegl_cuda.quantization import E4M3_MAX, quantize_fp8

    gen = torch.Generator().manual_seed(0)
    a = FP8Matrix(*quantize_fp8(torch.randn(32, 64, generator=gen)), (1, 64), torch.float32, w8a8_rows=8)
    b = FP8Matrix(*quantize_fp8(torch.randn(16, 64, generator=gen)), (1, 64), torch.float32, w8a8_rows=8)
    one = FP8Matrix(a.weight, torch.tensor([[0.5]]), (32, 64), torch.float32)  # one scale: kept per row
    assert one.block == (1, 64) and torch.equal(one.dequantized(), a.weight.float() * 0.5)
    group = MatrixGroup([a, b])
    assert len(group.parts) == 1 and group.parts[0].rows_count == 48
    assert torch.equal(group.parts[0].dequantized(), torch.cat([a.dequantized(), b.dequantized()]))
    ids = torch.tensor([0, 5, 31, 5])
    assert torch.equal(a.rows(ids), a.dequantized()[ids])
    x = torch.randn(9, 64, generator=gen)  # 9 rows >= w8a8_rows: torch._scaled_mm
    scale = (x.abs().amax(-1, keepdim=True) / E4M3_MAX)
    xq = (x / scale).to(torch.float8_e4m3fn).double() * scale.double()
    want = xq @ a.dequantized().double().T
    assert torch.allclose(a.matmul(x).double(), want, rtol=1e-5, atol=1e-5)
    block = FP8Matrix(a.weight, torch.ones(2, 4), (16, 16), torch.float32)  # block-scaled: weight-only
    assert block.w8a8_rows is None and block.block == (16, 16)


@pytest.mark.parametrize("kind", ["q4_k_m", "fp8"])
def test_dummy_weights_as_stored_take_the_kind_s_types(kind):
    pytest.importorskip("triton")
    from q4km_support import small_config

    from musegl_cuda.model import MuseGlimmerDecoder

    config = small_config(layers=8)
    model = MuseGlimmerDecoder(config, torch.float32, torch.device("cpu"), device_weights=True)
    sizes = model.randomize_device(0, kind)
    if kind == "fp8":
        assert set(sizes) == {"f8_e4m3"}
        return
    # llama.cpp's use_more_bits at 8 layers: layers 0, 3, 6, 7 (first and last eighth, every third between)
    more = ["q6_k", "q4_k", "q4_k", "q6_k", "q4_k", "q4_k", "q6_k", "q6_k"]
    # q/k/v/gate: one Q4_K product, or Q4_K q+k, Q6_K v, Q4_K gate
    assert [[p.dtype for p in layer.self_attn.qkvg_matrix.parts] for layer in model.layers] == [
        ["q4_k", "q6_k", "q4_k"] if t == "q6_k" else ["q4_k"] for t in more]
    assert [layer.mlp.down_proj.matrix.dtype for layer in model.layers] == more
    assert model.lm_head.matrix.dtype == "q6_k" and model.embed_matrix.dtype == "q4_k"
    assert sizes["q4_k"] + sizes["q6_k"] == sum(m.nbytes for m in model.device_matrices()) + model.embed_matrix.nbytes


def test_serve_flags_are_checked_with_one_line(tmp_path):
    import json

    from musegl_core.errors import ConfigError
    from musegl_core.plugins.specs import ExecutorOptions
    from musegl_core.testing.reference_models import TINY_TEXT_CONFIG
    from musegl_cuda import plugin

    spec = {s.name: s for s in plugin.musegl_executors()}["torch-cpu"]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "muse_glimmer_text", **TINY_TEXT_CONFIG}))
    dummy = {"load_format": "dummy"}
    with pytest.raises(ConfigError, match="--quantization: quantization with dummy weights runs on CUDA"):
        spec.create(ExecutorOptions(model=str(config), extra={**dummy, "quantization": "fp8"}))
    with pytest.raises(ConfigError, match="--quantization must be one of"):
        spec.create(ExecutorOptions(model=str(config), extra={**dummy, "quantization": "int4"}))
    with pytest.raises(ConfigError, match="--fp8-w8a8-rows must be a positive integer"):
        spec.create(ExecutorOptions(model=str(config), extra={**dummy, "fp8_w8a8_rows": 0}))


@pytest.mark.slow  # Triton's compiler and ptxas on two cores: ~30 s (seconds from Triton's cache)
def test_quantized_kernels_compile_for_hopper():
    """The kernels as a GPU build compiles them (sm_90, bf16), which the interpreter does not
    check; needs no GPU (Triton ships ptxas)."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(HERE))
    from quantized_checks import compile_for_hopper

    assert len(compile_for_hopper()) == 6


@pytest.mark.slow  # Triton's compiler and ptxas on two cores: ~45 s (seconds from Triton's cache)
def test_decode_gemv_kernels_compile_for_hopper_without_spills():
    """The GEMV kernels at the table's launches for 1 and 8 rows, the scratch's decoder and
    W8A8's quantizer, built
    for sm_90 (bf16): no register spills, and the loops' weight loads of Q4_K, Q5_K, Q8_0 and
    FP8 (whose blocks are 4-byte aligned) pipelined through ``cp.async``."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(HERE))
    from quantized_checks import compile_gemv_for_hopper

    built = compile_gemv_for_hopper()
    assert len(built) == 20, built
    assert all(k["spill_bytes"] == 0 for k in built), built
    for k in built:
        if k["kernel"].startswith(("gemv q4_k", "gemv q5_k", "gemv q8_0", "gemv fp8")):  # loops only
            assert k["async_copies"] > 0, k
