"""Test-only plugins that live in this support folder (the drafts speculator, an executor
of the previous contract), installed for the worker; the server helpers themselves are
in :mod:`musegl_core.testing.server`."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from musegl_core.testing.server import plugin_env

SUPPORT = Path(__file__).resolve().parent


@contextlib.contextmanager
def support_plugin_env(tmp_dir: Path, name: str, module: str, env: dict[str, str]) -> Iterator[None]:
    """Install the test-only plugin ``module`` of this folder (entry point ``name``) and set ``env``."""
    with plugin_env(tmp_dir, name, module, env, paths=[SUPPORT]):
        yield
