"""The CUDA path's Triton kernels, run on the CPU by Triton's interpreter.

CI has no GPU; this runs every kernel of ``musegl_cuda.cuda.kernels`` through
``TRITON_INTERPRET=1`` (which must be set before Triton is imported, hence
the subprocess) against the same plain-torch references as the GPU test
(``kernel_checks.py``), float32, at a small head size (two query heads per KV
head, so a decode program's tile holds several rows). Skipped where Triton
is not installed (it is a Linux test dependency).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow  # Triton's interpreter: ~35 s on two cores; CI runs the slow tier as its second step
def test_kernels_match_the_reference_in_the_interpreter():
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r}); import torch; "
            "from kernel_checks import check_kernels; "
            "check_kernels('cpu', (torch.float32,), heads=4, kv_heads=2, head_dim=16, small=True)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow  # Triton's interpreter over 1,200 keys at 1, 12 and 80 splits (~60 s on two shared cores)
def test_long_context_split_attention_matches_the_reference_in_the_interpreter():
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r}); import torch; "
            "from kernel_checks import check_long_decode_attention; "
            "check_long_decode_attention('cpu', torch.float32, heads=4, kv_heads=2, head_dim=16, keys=1200, "
            "splits=(1, 12, 80))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
