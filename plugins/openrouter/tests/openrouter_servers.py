"""Test support: several fronts (one per dialect) over one real worker.

The plugin's tests run inside the musegl repository and reuse its test support
(``tests/support``: the scripted executor plugin and its script). One worker
on the tiny checkpoint replays scripted output; an ``openrouter`` front and an
``openai`` front (built without this plugin loaded, as after uninstalling it)
share it, each on its own port, all in one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import attrs
import httpx
import uvicorn

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from musegl_core.config import ServeConfig  # noqa: E402
from musegl_core.http.app import create_app  # noqa: E402
from musegl_core.plugins.manager import PluginManager  # noqa: E402
from musegl_core.worker.client import WorkerClient  # noqa: E402
from musegl_core.testing.server import free_port, scripted_plugin_env  # noqa: E402

__all__ = ["FrontSpec", "serving", "scripted_plugin_env"]


@attrs.frozen
class FrontSpec:
    """One front: its dialect and the plugins it loads (``extra``: in-process
    test plugins as ``(name, module_or_object)``)."""

    dialect: str
    plugins: tuple[str, ...]
    extra: tuple[tuple[str, Any], ...] = ()
    tool_parser: str | None = None


@contextlib.contextmanager
def serving(config: ServeConfig, fronts: dict[str, FrontSpec], *, ready_timeout: float = 180) -> Iterator[dict[str, str]]:
    """Start one worker for ``config`` and the named fronts; yields name → base URL
    once every front answers ``/health`` with 200."""
    worker = WorkerClient(config.validate())
    servers: list[uvicorn.Server] = []
    urls: dict[str, str] = {}
    for index, (name, front) in enumerate(fronts.items()):
        port = free_port()
        front_config = attrs.evolve(
            config, port=port, api_dialect=front.dialect, tool_parser=front.tool_parser
        ).validate()
        plugins = PluginManager(only=front.plugins, extra=front.extra)
        app = create_app(front_config, plugins, worker, manage_worker=index == 0)
        servers.append(uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")))
        urls[name] = f"http://127.0.0.1:{port}"

    async def serve_all() -> None:
        await asyncio.gather(*(server.serve() for server in servers))

    thread = threading.Thread(target=asyncio.run, args=(serve_all(),), name="musegl-fronts", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + ready_timeout
        for url in urls.values():
            while not _healthy(url):
                if time.monotonic() > deadline or not thread.is_alive():
                    raise RuntimeError(f"{url} did not become ready within {ready_timeout} s")
                time.sleep(0.1)
        yield urls
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(2)
        # WorkerClient.close() waits for the worker to exit before it terminates
        # it; ending the worker here lets the shutdown finish without that wait.
        if thread.is_alive() and worker.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGTERM)
            thread.join(30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
