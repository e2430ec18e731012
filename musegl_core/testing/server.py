"""A real musegl server (front + worker) in-process, for end-to-end tests.

:func:`running_server` starts the front on a free port and the worker as a
subprocess, as ``musegl serve`` does, and waits for ``/health`` 200.
:func:`plugin_env` installs a test-only plugin for the worker (which is a
subprocess, so the plugin travels through ``PYTHONPATH`` and a dist-info
folder declaring its entry point); :func:`scripted_plugin_env` installs the
scripted executor (:mod:`musegl_core.testing.scripted`) with its script.
:func:`metric` and :func:`wait_idle` read ``/metrics``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

import attrs
import httpx
import uvicorn

from musegl_core.config import ServeConfig
from musegl_core.http.app import create_app
from musegl_core.http.connections import uvicorn_options
from musegl_core.plugins.manager import PluginManager
from musegl_core.worker.client import WorkerClient


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@attrs.frozen
class RunningServer:
    url: str
    config: ServeConfig
    worker: WorkerClient
    app: object


@contextlib.contextmanager
def running_server(config: ServeConfig, *, ready_timeout: float = 180) -> Iterator[RunningServer]:
    """Start front + worker for ``config`` (port chosen if 0); wait for /health 200."""
    if config.port == 0:
        config = attrs.evolve(config, port=free_port())
    config = config.validate()
    worker = WorkerClient(config)
    app = create_app(config, PluginManager(only=config.plugins, process="front"), worker)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning",
                                           **uvicorn_options(config)))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    deadline = time.monotonic() + ready_timeout
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the server did not become ready within {ready_timeout} s")
            time.sleep(0.1)
        yield RunningServer(url, config, worker, app)
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def plugin_env(tmp_dir: Path, name: str, module: str, env: dict[str, str],
               paths: Iterable[str | os.PathLike[str]] = ()) -> Iterator[None]:
    """Install a test-only plugin (entry point ``name`` -> ``module``, importable from
    ``paths`` or already) and set ``env`` for the duration."""
    info = tmp_dir / f"{module.replace('.', '_')}-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[musegl]\n{name} = {module}\n")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", *env)}
    parts = [str(tmp_dir), *map(str, paths), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def scripted_plugin_env(tmp_dir: Path, script: list[dict]) -> Iterator[Path]:
    """Install the scripted executor plugin (entry point ``scripted``) and its script."""
    script_path = tmp_dir / "script.json"
    script_path.write_text(json.dumps(script))
    with plugin_env(tmp_dir, "scripted", "musegl_core.testing.scripted", {"MUSEGL_SCRIPT": str(script_path)}):
        yield script_path


def metric(url: str, name: str, default: float | None = None) -> float:
    """One unlabelled series of ``/metrics`` (``_total`` optional); ``default`` when it is
    absent (None: fail)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    if match is None:
        assert default is not None, f"{name} missing from /metrics"
        return default
    return float(match.group(1))


def wait_idle(url: str, timeout: float = 60) -> None:
    """Wait until no request runs or waits."""
    deadline = time.monotonic() + timeout
    while metric(url, "musegl_requests_running") or metric(url, "musegl_requests_waiting"):
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.05)


class ServeProcess:
    """``musegl serve`` as a child process in its own process group (as an operator runs it:
    signals reach it alone), its stderr collected; ``args`` after the model path."""

    def __init__(self, model: str, *args: str):
        import subprocess
        import sys

        argv = [sys.executable, "-m", "musegl_core.cli.main", "serve", model, "--port", "0", *args]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url: str | None = None

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 180) -> str:
        """The server's URL once ``/health`` answers 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.url is None:
                found = re.search(r"listening on (http://\S+)", self.stderr)
                self.url = found.group(1) if found else None
            if self.url is not None:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the server did not become ready:\n{self.stderr}")

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
