"""What the tests of real agent clients share: the client from npm, and the server it meets.

:func:`npm_client` installs a pinned npm package once under
``~/.cache/musegl-tests/<name>/<version>`` (``$XDG_CACHE_HOME`` respected) and
returns its command; a test skips when npm is not there or the install fails.
:func:`scripted_server` runs musegl with the scripted executor
(:mod:`musegl_core.testing.scripted`) and the ATEM tool parser, as those tests
need it; :func:`atem_block` writes the tool-call markup a script replies with.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import subprocess
from typing import Any, Iterator

import pytest

#: where installed clients are kept between test runs
CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "musegl-tests"


def npm_client(name: str, package: str, version: str, command: str) -> pathlib.Path:
    """The ``command`` of npm ``package@version``, installed once under :data:`CACHE`/``name``/``version``;
    its ``--version`` must name ``version``. Skips the test when npm is missing or cannot install it."""
    folder = CACHE / name / version
    binary = folder / "node_modules" / ".bin" / command
    if not binary.exists():
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed")
        folder.mkdir(parents=True, exist_ok=True)
        install = subprocess.run(["npm", "install", "--no-audit", "--no-fund", f"{package}@{version}"],
                                 cwd=folder, capture_output=True, text=True, timeout=600)
        if install.returncode != 0:
            pytest.skip(f"npm could not install {package}@{version}: {install.stderr[-500:]}")
    shown = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    assert version in shown.stdout, shown.stdout + shown.stderr
    return binary


@contextlib.contextmanager
def scripted_server(folder: pathlib.Path, script: list[dict], *, max_context: int = 131072,
                    **settings: Any) -> Iterator[Any]:
    """A running musegl (:class:`~musegl_core.testing.server.RunningServer`) on the demo
    checkpoint whose "model" replays ``script`` (kept in ``folder``), with the ATEM tool
    parser and a context for the clients' long system prompts; ``settings`` are more
    :class:`~musegl_core.config.ServeConfig` fields."""
    from musegl_core.config import ServeConfig
    from musegl_core.testing.server import running_server, scripted_plugin_env
    from musegl_core.tiny import default_model_path

    folder.mkdir(parents=True, exist_ok=True)
    with scripted_plugin_env(folder, script):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", tool_parser="atem",
                             max_context=max_context, **settings)
        with running_server(config) as server:
            yield server


def atem_block(name: str, params: list[tuple[str, str]]) -> str:
    """One ATEM call block: an invoke of ``name`` with raw-text ``params``."""
    body = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in params)
    return f'<atem:function_calls>\n<atem:invoke name="{name}">\n{body}</atem:invoke>\n</atem:function_calls>'
