"""A verify-shaped step through a decode graph's body and through the dynamic path launch the
attention alike and give the same logits (FP8 KV, Triton's interpreter on the CPU:
``graph_dynamic_checks.py``, in a subprocess because ``TRITON_INTERPRET`` must be set before
Triton is imported). ``test_kv_fp8_gpu.py::test_fp8_graphs_match_the_dynamic_path`` checks it
on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # Triton's interpreter, the tiny model's 6 layers twice
def test_a_verify_step_runs_as_its_graph_on_the_dynamic_path():
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    code = (f"import os, sys; sys.path.insert(0, {str(here)!r}); "
            "from graph_dynamic_checks import check_verify_step_graph_vs_dynamic; "
            "check_verify_step_graph_vs_dynamic(); print('checked', flush=True); os._exit(0)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-4000:]
