"""The MLX executor's compute dtype: the decision for every condition
(``musegl_mlx.precision``, pure), and the executor following it where the BLAS
routing is off (forced with ``MUSEGL_MLX_BLAS=reference``, as on a CPU whose
OpenBLAS is not batch-invariant)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from musegl_mlx.precision import choose_dtype


@pytest.mark.parametrize(("stored", "on_cpu", "routed", "expected"), [
    # a float32 checkpoint keeps float32 everywhere (the issue: bfloat16 on an unrouted CPU diverged)
    ("f32", True, False, "float32"),
    ("f32", True, True, "float32"),
    ("f32", False, False, "float32"),
    # the routed CPU computes in float32 (the fast products), whatever the checkpoint
    ("bf16", True, True, "float32"),
    ("f16", True, True, "float32"),
    ("q8_0", True, True, "float32"),
    # elsewhere a half-precision checkpoint keeps its dtype; quantized or mixed ones compute in bfloat16
    ("bf16", True, False, "bfloat16"),
    ("bf16", False, False, "bfloat16"),
    ("f16", False, False, "float16"),
    ("f16", True, False, "float16"),
    ("q4_0", False, False, "bfloat16"),
    ("mixed", True, False, "bfloat16"),
    (None, False, False, "bfloat16"),
])
def test_the_default_follows_the_checkpoint_and_the_device(stored, on_cpu, routed, expected):
    choice = choose_dtype(None, stored, on_cpu=on_cpu, blas_routed=routed)
    assert choice.name == expected
    assert choice.reason  # logged at load
    if stored == "f32":
        assert "checkpoint is float32" in choice.reason
    elif on_cpu and routed:
        assert "OpenBLAS" in choice.reason


@pytest.mark.parametrize("requested", ["float32", "bfloat16", "float16", "bf16", "fp32"])
@pytest.mark.parametrize("stored", ["f32", "bf16", "q8_0"])
def test_dtype_flag_wins(requested, stored):
    for on_cpu, routed in ((True, True), (True, False), (False, False)):
        choice = choose_dtype(requested, stored, on_cpu=on_cpu, blas_routed=routed)
        assert choice.name == {"bf16": "bfloat16", "fp32": "float32"}.get(requested, requested)
        assert choice.reason == "--dtype"


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float32, float16, bfloat16"):
        choose_dtype("int8", "f32", on_cpu=True, blas_routed=False)


_LOAD = """
import json, logging, sys
records = []
logging.basicConfig(level=logging.INFO, handlers=[type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r.getMessage())})()])
from musegl_mlx import blas
status = blas.route()
from musegl_core.plugins.specs import ExecutorOptions
from musegl_mlx import plugin
(spec,) = plugin.musegl_executors()
out = {"routed": status.routed}
for path in sys.argv[1:]:
    executor = spec.create(ExecutorOptions(model=path))
    out[path] = [executor.info.dtype, spec.kv_layout(ExecutorOptions(model=path))[0], executor.kv_bytes_per_block()]
    executor.close()
out["log"] = [r for r in records if "computes in" in r]
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's Linux CPU build")
def test_without_the_routing_a_float32_gguf_computes_in_float32(tiny_gguf, tiny_hf, tmp_path):
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.testing.reference_models import tiny_tokenizer_data

    checkpoint = load_checkpoint(tiny_hf.path)
    bf16 = tmp_path / "model-bf16.gguf"
    write_text_gguf(bf16, checkpoint.config, dict(checkpoint.iter_weights()), tiny_tokenizer_data(),
                    file_type="bf16", name="Tiny Muse Glimmer")
    checkpoint.close()
    done = subprocess.run([sys.executable, "-c", _LOAD, str(tiny_gguf), str(bf16)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MUSEGL_MLX_BLAS": "reference"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["routed"] is False
    f32_dtype, f32_layout, f32_block = out[str(tiny_gguf)]
    bf16_dtype, bf16_layout, bf16_block = out[str(bf16)]
    assert f32_dtype == "float32" and bf16_dtype == "bfloat16"
    assert f32_layout == f32_block == 2 * bf16_layout == 2 * bf16_block  # the KV sizing agrees with the executor
    assert any("float32" in line and "checkpoint is float32" in line for line in out["log"]), out["log"]
    assert any("bfloat16" in line and "checkpoint's dtype" in line for line in out["log"]), out["log"]
