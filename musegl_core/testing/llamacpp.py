"""llama.cpp's own quantizer, ``llama-quantize``, built once into the musegl cache.

The exactness tests of stored GGUF weights quantize checkpoints with the tool users
run (``llama-quantize model.gguf out.gguf Q4_K_M``), not with a quantizer of ours.
:func:`llama_quantize` returns the tool's path, building it on first use from the
llama.cpp tree vendored in the ``llama-cpp-python`` sdist on PyPI (the only source
registry CI reaches): ``pip download`` of the sdist, its ``vendor/llama.cpp`` unpacked,
then CMake (Ninja where installed) builds the ``llama-quantize`` target only, CPU
only, static. The result lives in ``<musegl cache>/llama.cpp-<version>/bin`` (see
:func:`musegl_core.tiny.cache_root`; ``$MUSEGL_LLAMA_QUANTIZE`` names a tool built
elsewhere instead). A file lock keeps concurrent test workers to one build; a failed
build raises :class:`LlamaCppUnavailable` with the step that failed and its output's tail.

Needs: a C/C++ compiler, CMake >= 3.14, pip reaching PyPI (first build only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

#: The llama-cpp-python release whose vendored llama.cpp is built (the one the
#: benchmarks build llama-server from: benchmarks/llamacpp_cuda.sh).
LLAMA_CPP_PYTHON = "0.3.36"
TOOL_ENV = "MUSEGL_LLAMA_QUANTIZE"


class LlamaCppUnavailable(RuntimeError):
    """llama-quantize could not be built or found (the message says which step failed)."""


def cache_dir() -> Path:
    from musegl_core.tiny import cache_root

    return cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def _run(step: str, cmd: list[str], cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        raise LlamaCppUnavailable(f"{step} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                                  f"{proc.stdout[-3000:]}")


def _unpack_vendor_tree(sdist: Path, dest: Path) -> Path:
    """``vendor/llama.cpp`` of the sdist, unpacked under ``dest``; returns its root."""
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        tar.extractall(dest, members=members, filter="data")
    return dest / prefix.rstrip("/")


def build(root: Path, jobs: int | None = None) -> Path:
    """Build llama-quantize under ``root`` (downloads the sdist there); returns the tool's path."""
    root.mkdir(parents=True, exist_ok=True)
    sdists = root / "sdist"
    sdist = sdists / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        _run("downloading the llama-cpp-python sdist",
             [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(sdists)])
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        src = _unpack_vendor_tree(sdist, work)
        build_dir = work / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        if shutil.which("cmake") is None:
            raise LlamaCppUnavailable("building llama-quantize needs cmake (apt-get install cmake)")
        _run("configuring llama.cpp", ["cmake", "-S", str(src), "-B", str(build_dir), *generator,
                                       "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
                                       "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                                       "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF",
                                       "-DLLAMA_OPENSSL=OFF", "-DGGML_CCACHE=OFF", "-DGGML_OPENMP=OFF"])
        _run("building llama-quantize", ["cmake", "--build", str(build_dir), "--target", "llama-quantize",
                                         "-j", str(jobs or os.cpu_count() or 1)])
        built = next(build_dir.rglob("llama-quantize"), None)
        if built is None or not built.is_file():
            raise LlamaCppUnavailable(f"the build left no llama-quantize under {build_dir}")
        bin_dir = root / "bin"
        bin_dir.mkdir(exist_ok=True)
        staged = bin_dir / ".llama-quantize.tmp"
        shutil.copy2(built, staged)
        os.replace(staged, bin_dir / "llama-quantize")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root / "bin" / "llama-quantize"


def llama_quantize() -> Path:
    """The path of llama-quantize: ``$MUSEGL_LLAMA_QUANTIZE``, or the cached build (built
    on first call; minutes on two cores)."""
    named = os.environ.get(TOOL_ENV)
    if named:
        if not os.access(named, os.X_OK):
            raise LlamaCppUnavailable(f"{TOOL_ENV}={named} is not an executable")
        return Path(named)
    root = cache_dir()
    tool = root / "bin" / "llama-quantize"
    if tool.is_file():
        return tool
    import filelock

    root.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(root / ".build.lock")):
        if tool.is_file():  # another worker built it while we waited
            return tool
        return build(root)


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], kind: str, threads: int = 2) -> Path:
    """``llama-quantize src dst kind threads`` (kind: ``Q4_K_M``, ``Q6_K``, ``Q8_0`` ...); returns ``dst``."""
    _run(f"llama-quantize {kind}", [str(llama_quantize()), str(src), str(dst), kind, str(threads)])
    return Path(dst)


if __name__ == "__main__":  # python -m musegl_core.testing.llamacpp: build (once) and print the tool's path
    print(llama_quantize())
