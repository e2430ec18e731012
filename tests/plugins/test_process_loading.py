"""Plugins load where they are used: the worker calls only the executor and
speculator hooks and imports no surface or dialect; the front imports no
executor; a misspelled hook is a start-up error."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from musegl_core.errors import ConfigError
from musegl_core.plugins.hookspecs import CALLED_IN, FRONT, WORKER, hookimpl
from musegl_core.plugins.manager import PluginManager
from tests.support.import_graph import REPO


def test_a_misspelled_hook_fails_at_start_up():
    plugin = types.ModuleType("typo_plugin")

    @hookimpl
    def musegl_executor():  # musegl_executors
        return []

    plugin.musegl_executor = musegl_executor
    with pytest.raises(ConfigError, match="typo.*musegl_executor"):
        PluginManager(only=[], extra=[("typo", plugin)])


def test_every_hook_says_which_process_calls_it():
    manager = PluginManager(only=[])
    assert set(CALLED_IN) == {name for name in dir(manager.pm.hook) if name.startswith("musegl_")}


def test_a_process_manager_calls_only_its_hooks():
    worker = PluginManager(only=[], process=WORKER)
    assert worker.kinds() == ["executors", "speculators"]
    with pytest.raises(RuntimeError, match="musegl_api_surfaces is not called in the worker"):
        worker.specs("api_surfaces")
    with pytest.raises(RuntimeError, match="musegl_dialects"):
        worker.get("dialects", "openai")
    front = PluginManager(only=[], process=FRONT)
    assert {"chat", "completions", "tokenize"} <= set(front.specs("api_surfaces"))
    with pytest.raises(RuntimeError, match="musegl_commands"):
        front.specs("commands")


def loaded_modules(code: str) -> list[str]:
    """The modules a fresh interpreter holds after ``code`` (every installed plugin loaded)."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


SURFACES_AND_DIALECTS = ("musegl_core.openai", "musegl_core.http", "musegl_core.service", "litestar",
                         "musegl_anthropic.surface", "musegl_anthropic.request", "musegl_responses.surface",
                         "musegl_responses.planning", "musegl_openrouter.dialect")


def test_the_worker_imports_no_surface_and_no_dialect():
    modules = loaded_modules(
        "from musegl_core.plugins.manager import PluginManager\n"
        "import musegl_core.worker.main, musegl_core.worker.loading\n"
        "plugins = PluginManager(process='worker')\n"
        "plugins.specs('executors'); plugins.specs('speculators')\n")
    assert "musegl_anthropic.plugin" in modules  # every installed plugin is registered
    assert [m for m in modules if m.startswith(SURFACES_AND_DIALECTS)] == []


def test_the_front_imports_no_executor():
    """The app and the executor specs it checks the configuration with; an
    executor's ``available()`` may still import its device library to ask."""
    modules = loaded_modules(
        "from musegl_core.config import ServeConfig\n"
        "from musegl_core.http.app import create_app\n"
        "from musegl_core.plugins.manager import PluginManager\n"
        "from musegl_core.worker.client import WorkerClient\n"
        "config = ServeConfig()\n"
        "plugins = PluginManager(process='front')\n"
        "create_app(config, plugins, WorkerClient(config), manage_worker=False)\n"
        "plugins.specs('executors'); plugins.specs('speculators')  # the start-up checks' specs\n")
    assert "musegl_anthropic.surface" in modules and "musegl_core.openai.surface" in modules
    heavy = ("torch", "mlx", "executorch", "musegl_core.engine.engine", "musegl_cuda.executor", "musegl_cuda.model",
             "musegl_mlx.executor", "musegl_executorch.executor", "musegl_dflash.speculator")
    assert [m for m in modules if m.split(".")[0] in heavy[:3] or m.startswith(heavy[3:])] == []
