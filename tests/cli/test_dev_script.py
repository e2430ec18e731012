"""``./dev serve`` installs what serving needs, ``./dev test`` everything (issue 47 item 21).

The script runs for real against a virtual environment whose ``python`` and
``musegl`` only write down how they were called, so what each command would
install is read without installing anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    venv, calls = tmp_path / "venv", tmp_path / "calls.txt"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    for name in ("python", "musegl"):
        tool = venv / "bin" / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\n')
        tool.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'PATH="{venv}/bin:$PATH"\n')
    return venv, calls


def run_dev(tmp_path: Path, *args: str) -> list[str]:
    venv, calls = fake_venv(tmp_path)
    env = {**os.environ, "MUSEGL_VENV": str(venv)}
    calls.unlink(missing_ok=True)
    subprocess.run([str(ROOT / "dev"), *args], cwd=ROOT, env=env, check=True, capture_output=True, timeout=60)
    return calls.read_text().splitlines()


def test_dev_serve_installs_no_test_extras_and_no_export_runtime(tmp_path):
    calls = run_dev(tmp_path, "serve", "--help")
    installs = " ".join(line for line in calls if " pip install " in line)
    assert "torch==2.13.0" in installs
    assert "-e ." in installs and "[test" not in installs and "bench]" not in installs
    assert "plugins/cuda" in installs and "plugins/responses" in installs
    assert "plugins/executorch" not in installs and "plugins/mlx" not in installs
    assert calls[-1] == "musegl serve --help"
    assert (tmp_path / "venv" / ".musegl-serve-installed").exists()
    # a second start installs nothing
    again = run_dev(tmp_path, "serve", "--help")
    assert [line for line in again if " pip install " in line] == []


def test_dev_test_installs_everything_over_a_serve_install(tmp_path):
    run_dev(tmp_path, "serve", "--help")
    calls = run_dev(tmp_path, "test", "--co", "-q")
    installs = " ".join(line for line in calls if " pip install " in line)
    assert ".[test,bench]" in installs and "plugins/executorch" in installs
