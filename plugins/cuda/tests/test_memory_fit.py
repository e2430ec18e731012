"""``musegl serve``'s start-up fit on the torch-cpu executor: the weights' bytes as the
executor will hold them (from the tensor table), the KV at the limits, the refusal."""

from __future__ import annotations

import logging

import numpy as np

import pytest

from musegl_core.checkpoint.gguf_writer import write_text_gguf
from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine import memory
from musegl_core.engine.fit import check_serve_fit, checkpoint_tensor_bytes, serve_fit
from musegl_core.errors import ConfigError
from musegl_core.testing.reference_models import tiny_tokenizer_data


@pytest.fixture(scope="module")
def q8_gguf(tiny_hf, tmp_path_factory):
    checkpoint = load_checkpoint(tiny_hf.path)
    path = tmp_path_factory.mktemp("fit") / "model-q8_0.gguf"
    write_text_gguf(path, checkpoint.config, dict(checkpoint.iter_weights()), tiny_tokenizer_data(),
                    file_type="q8_0")
    return path


def prepared(*argv):
    from musegl_core.cli.serve import prepare

    config, plugins, _ = prepare([*argv, "--executor", "torch-cpu"])
    return config, plugins


def test_the_startup_line_gives_the_weights_as_held_and_the_kv_room(q8_gguf, monkeypatch, caplog):
    """The tiny model's Q8_0 matrices run as stored: the plan's bytes are the file's Q8_0
    bytes, the norms float32; the KV is 6 layers x 2 x 2 heads x 16 x 4 bytes a token."""
    monkeypatch.setattr(memory, "available_ram", lambda meminfo=memory.MEMINFO: 8 << 30)
    config, plugins = prepared(str(q8_gguf), "--max-context", "4096", "--max-sessions", "2")
    fit = serve_fit(config, plugins)
    file_bytes = checkpoint_tensor_bytes(q8_gguf)
    assert fit.plan.weights["q8_0"] == file_bytes["q8_0"] and fit.plan.weights["f32"] == file_bytes["f32"]
    assert fit.kv_bytes_per_token == 6 * 2 * 2 * 16 * 4 and fit.kv_needed == 4096 * 1536
    with caplog.at_level(logging.INFO):
        check_serve_fit(config, plugins, logging.getLogger("test.fit"))
    line = caplog.records[-1].getMessage()
    assert line.startswith("memory: weights ") and "on cpu (host memory available) (q8_0 " in line
    assert "one 4096-token request (1.50 KiB/token; blocks on demand)" in line and "KV room" in line
    assert "sessions of --max-context" in line and "left" in line


def test_a_model_that_does_not_fit_refuses_in_one_line_with_flags(q8_gguf, monkeypatch):
    weights = sum(checkpoint_tensor_bytes(q8_gguf).values())
    monkeypatch.setattr(memory, "available_ram", lambda meminfo=memory.MEMINFO: weights + (8 << 20))
    config, plugins = prepared(str(q8_gguf), "--max-context", "32768", "--max-sessions", "4")
    with pytest.raises(ConfigError) as err:
        check_serve_fit(config, plugins, logging.getLogger("test.fit"))
    line = str(err.value)
    assert "\n" not in line and line.startswith("the model does not fit cpu")
    assert "KV 48.00 MiB for one 32768-token request" in line and "--max-context 5461" in line
    # upcast to float32 would take more: the refusal names the stored form as the lighter one
    config, plugins = prepared(str(q8_gguf), "--weights", "upcast", "--max-context", "8192")
    line = serve_fit(config, plugins).refusal()
    assert "--weights stored (weights " in line


def test_the_plan_matches_the_executor_and_imports_no_torch(q8_gguf):
    """The front computes the plan without torch (seconds, and a CUDA context on a GPU
    machine); its tables are the kernels' and the executor's."""
    import subprocess
    import sys

    from musegl_core.checkpoint.stored import mlx_dtype
    from musegl_cuda.cpu.stored_matrix import A4_LAYOUT, KINDS
    from musegl_cuda.executor import DEFAULT_BLOCK_SIZE
    from musegl_cuda.memory_plan import BLOCK_SIZE, STORED_BLOCKS

    # the kernels' A4 kinds are mlx-lm's 4-bit groups of 64, laid out again (same bytes)
    file_kinds = {kind: block for kind, (_, block) in KINDS.items() if not kind.startswith("a4_")}
    assert STORED_BLOCKS == {**file_kinds, mlx_dtype(*A4_LAYOUT): A4_LAYOUT[1]}
    assert BLOCK_SIZE == DEFAULT_BLOCK_SIZE
    code = ("import sys\nfrom musegl_core.plugins.specs import ExecutorOptions\n"
            "from musegl_cuda.memory_plan import memory_plan\n"
            f"plan = memory_plan(ExecutorOptions(model={str(q8_gguf)!r}), 'cpu')\n"
            "assert plan.weights['q8_0'] > 0 and plan.kv_layout == (6 * 2 * 16 * 2 * 16 * 4, 16), plan\n"
            "print(sorted(m for m in ('torch', 'musegl_cuda.executor', 'musegl_cuda.cpu.native') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def sparse_30b_q4_k_m(path):
    """A GGUF of the released 30B shape laid out as llama.cpp's ``llama-quantize`` writes a
    Q4_K_M file (the converter's metadata and tensor names, each matrix in the type
    :func:`~musegl_core.engine.fit.q4_k_m_types` gives), its 17 GB of tensor data a sparse hole:
    what ``musegl serve`` reads at start-up is the tensor table, never the values."""
    import gguf

    from musegl_core.checkpoint.gguf_writer import _add_metadata, _gguf_tensors, _nbytes, add_tokenizer_metadata
    from musegl_core.checkpoint.hf_reader import (
        TEXT_CONFIG_DEFAULTS,
        expected_shape,
        text_config_from_dict,
        text_weight_names,
    )
    from musegl_core.engine.fit import q4_k_m_types

    config = text_config_from_dict(dict(TEXT_CONFIG_DEFAULTS))
    types = q4_k_m_types(config)
    writer = gguf.GGUFWriter(str(path), "muse-glimmer")
    _add_metadata(writer, config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "Muse Glimmer 30B shape, Q4_K_M table")
    add_tokenizer_metadata(writer, tiny_tokenizer_data(config.vocab_size), config.vocab_size)
    vectors = {n: np.zeros(expected_shape(config, n), np.float32) if len(expected_shape(config, n)) == 1 else None
               for n in text_weight_names(config)}  # the norms (their values are read at load), no matrix
    end, norms = 0, []
    for name, make, shape in _gguf_tensors(config, vectors, False):
        qtype = gguf.GGMLQuantizationType[types[name].upper()] if name in types else gguf.GGMLQuantizationType.F32
        stored_shape, nbytes = _nbytes(shape, qtype)
        dtype = np.dtype(np.float32) if qtype == gguf.GGMLQuantizationType.F32 else np.dtype(np.uint8)
        writer.add_tensor_info(name, stored_shape, dtype, nbytes,
                               raw_dtype=None if qtype == gguf.GGMLQuantizationType.F32 else qtype)
        if qtype == gguf.GGMLQuantizationType.F32:
            norms.append((end, make))
        end = -(-(end + nbytes) // writer.data_alignment) * writer.data_alignment
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(path, "r+b") as f:  # the data section (from the next aligned offset): a hole, no disk blocks
        start = -(-f.seek(0, 2) // writer.data_alignment) * writer.data_alignment
        f.truncate(start + end)
        for offset, make in norms:
            f.seek(start + offset)
            f.write(np.ascontiguousarray(make(), dtype=np.float32).tobytes())
    return config


def test_the_30b_shape_at_q4_k_m_with_a_32k_context_fits_a_24_gb_card_at_start_up(tmp_path, monkeypatch, caplog):
    """Issue 48's memory bound, by the start-up arithmetic: ``musegl serve`` on a Q4_K_M file of
    the 30B shape (its tensor table as llama-quantize writes it) on a CUDA card of 24 GB
    (24e9 bytes, what the driver reports for a 24 GB card being at least that): the weights as
    stored (Q4_K and Q6_K at the file's bytes) and the bfloat16 KV of one 32768-token request
    fit beside the executor's reserve, and the plan's weights are the file's tensor bytes."""
    from musegl_core.engine.fit import Fit, checkpoint_tensor_bytes
    from musegl_core.engine.kv_sizing import GIB
    from musegl_core.plugins.specs import ExecutorOptions
    from musegl_cuda import memory_plan as cuda_plan

    path = tmp_path / "muse-glimmer-30b-Q4_K_M.gguf"
    sparse_30b_q4_k_m(path)
    file_bytes = checkpoint_tensor_bytes(path)
    assert set(file_bytes) == {"q4_k", "q6_k", "f32"} and 16.5e9 < sum(file_bytes.values()) < 17.5e9
    monkeypatch.setattr(cuda_plan, "cuda_total_memory", lambda index: (24 * 10**9, "a 24 GB card"))
    plan = cuda_plan.memory_plan(ExecutorOptions(model=str(path), device="cuda:0"), "cuda:0")
    assert plan.weights == file_bytes  # --weights stored, the CUDA default for a quantized file
    block_bytes, block = plan.kv_layout
    fit = Fit(plan, block_bytes / block, max_sessions=1, max_context=32768)
    assert fit.fits, fit.refusal()
    assert fit.room - fit.kv_needed > 3 * GIB  # 15.8 GiB of weights, 1.6 GiB of KV, 1 GiB reserve in 22.4 GiB
    line = fit.line()
    assert "weights 15.7" in line and "one 32768-token request" in line and "a 24 GB card" in line
