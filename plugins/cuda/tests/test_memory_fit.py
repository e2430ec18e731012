"""``musegl serve``'s start-up fit on the torch-cpu executor: the weights' bytes as the
executor will hold them (from the tensor table), the KV at the limits, the refusal."""

from __future__ import annotations

import logging

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
