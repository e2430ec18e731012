"""The cuda executor's availability check: torch's answer, without importing torch in the front."""

from __future__ import annotations

import subprocess
import sys

import pytest

from musegl_cuda.cuda import availability


def test_choosing_an_executor_imports_no_torch():
    code = ("import sys; from musegl_core.plugins.manager import PluginManager; "
            "spec = PluginManager(only=['cuda']).choose_executor(); "
            "print(spec.name, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    name, torch_imported = out.stdout.split()
    assert torch_imported == "False"
    import torch

    assert name == ("cuda" if torch.cuda.is_available() else "torch-cpu")


def test_the_answer_is_torchs():
    import torch

    assert availability.cuda_available() is bool(torch.cuda.is_available())


def fake_torch(tmp_path, monkeypatch, version_py: str):
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('the fake torch is never imported')\n")
    (package / "version.py").write_text(version_py)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)


@pytest.mark.parametrize("text, build", [
    ("from typing import Optional\ncuda: Optional[str] = None\nhip: Optional[str] = None\n", {"cuda": None, "hip": None}),
    ("cuda: Optional[str] = '12.8'\nhip = None\n", {"cuda": "12.8", "hip": None}),
    ("cuda = None\nhip: Optional[str] = '6.3.42131'\n", {"cuda": None, "hip": "6.3.42131"}),
])
def test_the_build_is_read_from_torchs_version_file(tmp_path, monkeypatch, text, build):
    fake_torch(tmp_path, monkeypatch, text)
    assert availability.torch_build() == build


def test_a_cuda_build_asks_the_driver_with_its_major_version(tmp_path, monkeypatch):
    fake_torch(tmp_path, monkeypatch, "cuda = '12.8'\nhip = None\n")
    asked = []
    monkeypatch.setattr(availability, "driver_device_count", lambda major: asked.append(major) or 2)
    monkeypatch.setattr(availability.sys, "platform", "linux")
    assert availability.cuda_available() is True
    monkeypatch.setattr(availability, "driver_device_count", lambda major: asked.append(major) or 0)
    assert availability.cuda_available() is False
    assert asked == [12, 12]


def test_a_cpu_build_answers_without_the_driver_or_torch(tmp_path, monkeypatch):
    fake_torch(tmp_path, monkeypatch, "cuda = None\nhip = None\n")
    monkeypatch.setattr(availability, "driver_device_count", lambda major: pytest.fail("the driver was asked"))
    assert availability.cuda_available() is False  # the fake torch raises if imported


def test_no_torch_is_not_available(monkeypatch):
    monkeypatch.setattr(availability, "torch_build", lambda: None)
    monkeypatch.setattr(availability.importlib.util, "find_spec", lambda name: None)
    assert availability.cuda_available() is False


def test_no_driver_library_counts_no_device(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(availability.ctypes, "CDLL", missing)
    assert availability.driver_device_count(12) == 0
