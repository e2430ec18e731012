"""Whether the ``cuda`` executor can run here, answered without importing torch.

``musegl serve`` and ``musegl plugins`` ask every executor whether it is
available, in the front process, which never runs a model; importing torch
there only to call ``torch.cuda.is_available()`` costs seconds on every start.
This module gives the same answer from what torch's own check rests on:

1. torch is installed and was built with CUDA (its ``torch/version.py``, read
   as text; a CPU build answers no at once);
2. the NVIDIA driver library (``libcuda.so.1``) loads, ``cuInit`` succeeds
   and ``cuDeviceGetCount`` counts at least one device (the driver applies
   ``CUDA_VISIBLE_DEVICES`` itself);
3. the driver's CUDA major version is at least that of torch's runtime (an
   older driver makes torch's ``cudaGetDeviceCount`` fail).

``cuInit`` loads the driver but creates no context and allocates no device
memory. A ROCm build of torch (``torch.version.hip``), a CUDA build outside
Linux, and a request for torch's NVML-based check
(``PYTORCH_NVML_BASED_CUDA_CHECK``) are answered by torch itself, as before.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["cuda_available", "torch_build"]


def torch_build() -> dict[str, str | None] | None:
    """``{"cuda": ..., "hip": ...}`` as torch's ``version.py`` declares them (None: not a
    GPU build), or None when torch is not installed or its version file cannot be read."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except (OSError, SyntaxError, StopIteration):
        return None
    found: dict[str, str | None] = {"cuda": None, "hip": None}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in found and node.value is not None:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None  # not a literal: let torch answer
            found[target.id] = value if isinstance(value, str) else None
    return found


def _major(version: str) -> int | None:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return None


def driver_device_count(min_major: int | None = None) -> int:
    """CUDA devices the driver reports (0 when the driver is missing, fails to
    initialise, or is older than CUDA ``min_major``)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    if libcuda.cuInit(0) != 0:
        return 0
    if min_major is not None:
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value // 1000 < min_major:
            return 0
    count = ctypes.c_int(0)
    if libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def _torch_says() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def cuda_available() -> bool:
    """True when torch is installed, built with CUDA, and would see at least one
    CUDA device (``torch.cuda.is_available()``), without importing torch."""
    build = torch_build()
    if build is None:
        return importlib.util.find_spec("torch") is not None and _torch_says()
    if build["hip"] is not None or os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1":
        return _torch_says()
    if build["cuda"] is None:
        return False
    if not sys.platform.startswith("linux"):
        return _torch_says()  # the driver library has another name there (nvcuda.dll on Windows)
    return driver_device_count(_major(build["cuda"])) > 0
