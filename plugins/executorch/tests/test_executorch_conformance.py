"""The executor conformance suite (musegl_core.testing.conformance) on an exported
ExecuTorch program (a tiny random checkpoint, float32): the slow tier, because the
export takes over a minute on two cores."""

from __future__ import annotations

import pytest

from musegl_core.cli.main import main
from musegl_core.testing.conformance import ExecutorConformance
from musegl_core.tiny import TinyPreset, make_tiny

#: One sliding layer (an 8-key window) and one full layer: a small, quick export.
PRESET = TinyPreset(name="etc", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, sliding_window=8, max_position_embeddings=1024)


@pytest.mark.slow
class TestExecuTorchProgram(ExecutorConformance):
    logits_atol = 1e-4  # XNNPACK's float32 products round by call shape
    num_blocks = 256  # 4096 cells: what the program is exported for

    @pytest.fixture(scope="class")
    @classmethod
    def executor(cls, tmp_path_factory):
        from musegl_executorch.executor import ExecuTorchExecutor

        checkpoint = make_tiny(tmp_path_factory.mktemp("etc_ckpt"), preset=PRESET, file_type="f32")
        out = tmp_path_factory.mktemp("etc_export")
        status = main(["export", str(checkpoint), "-o", str(out), "--forward-sizes", "4", "--max-prefill-chunk", "32",
                       "--max-cells", "4096", "--overwrite"])
        assert status == 0
        executor = ExecuTorchExecutor(str(out))
        yield executor
        executor.close()
