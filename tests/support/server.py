"""Run a real musegl server (front + worker) in-process for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import attrs
import httpx
import uvicorn

from musegl_core.config import ServeConfig
from musegl_core.http.app import create_app
from musegl_core.plugins.manager import PluginManager
from musegl_core.worker.client import WorkerClient

SUPPORT = Path(__file__).resolve().parent


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
    app = create_app(config, PluginManager(only=config.plugins), worker)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning"))
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
def support_plugin_env(tmp_dir: Path, name: str, module: str, env: dict[str, str]) -> Iterator[None]:
    """Install a test-only plugin from this support folder (entry point ``name`` ->
    ``module``) and set ``env`` for the duration.

    The worker is a subprocess, so the plugin travels through PYTHONPATH: a
    dist-info folder declaring the entry point, plus this support folder.
    """
    info = tmp_dir / f"{module}-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[musegl]\n{name} = {module}\n")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", *env)}
    parts = [str(tmp_dir), str(SUPPORT), os.environ.get("PYTHONPATH", "")]
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
    with support_plugin_env(tmp_dir, "scripted", "musegl_scripted", {"MUSEGL_SCRIPT": str(script_path)}):
        yield script_path
