"""Shared by the benchmark scripts: the bench checkpoint and a server subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx


def bench_checkpoint() -> Path:
    """The ``bench`` preset (hidden 1024, 8 layers, GQA 8/2, head_dim 128), built once into the cache."""
    from musegl_core.tiny import default_model_path

    return default_model_path(preset="bench", progress=True)


def pin_cpu_kernels(choice: str | None) -> dict[str, str | None]:
    """Fix the stored-weight kernel path ``musegl serve`` will run (``MUSEGL_CPU_KERNELS``
    for the servers this process starts): ``choice``, else the variable's value, else the
    best path this CPU runs; a path that cannot run here stops the benchmark. Returns the
    path's name and what it is (the report's ``cpu_kernels``)."""
    from musegl_cuda.cpu import native

    if choice:
        os.environ[native.ENV] = choice
    native.reset()
    chosen = native.load()  # raises KernelPathError for a path this machine cannot run
    os.environ[native.ENV] = native.selected_path()
    return {"path": native.selected_path(), "summary": chosen.path.summary if chosen else None,
            "why_fallback": native.unavailable_reason(), "forced": choice or None}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(model: Path, *flags: str, ready_timeout: float = 600.0) -> Iterator[str]:
    """Run ``musegl serve MODEL FLAGS`` as a subprocess; yield its base URL once /health is 200.

    The server's output goes to a log file whose path is printed if it fails.
    """
    with serve_process(model, *flags, ready_timeout=ready_timeout) as (url, _process):
        yield url


@contextlib.contextmanager
def serve_process(model: Path, *flags: str, ready_timeout: float = 600.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`serve`, also yielding the front's process (its child is the worker)."""
    port = free_port()
    command = [sys.executable, "-m", "musegl_core.cli.main", "serve", str(model), "--port", str(port), *flags]
    print("$ musegl serve " + " ".join(command[4:]), file=sys.stderr)
    with server_process(command, port, name="musegl-serve", ready_timeout=ready_timeout) as running:
        yield running


@contextlib.contextmanager
def server_process(command: list[str], port: int, *, name: str, health: str = "/health",
                   env: dict[str, str] | None = None,
                   ready_timeout: float = 600.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run an HTTP server ``command`` (listening on ``port``) in its own session, output to a
    log file; yield ``(base URL, process)`` once ``health`` answers 200; stop the whole
    session (a front and its workers) afterwards. Failures name the log file."""
    log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode}; see {log.name}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + health, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not ready within {ready_timeout:.0f} s; see {log.name}")
            time.sleep(0.5)
        yield url, process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()
