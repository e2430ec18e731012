"""Plugin discovery through entry points, selection with --plugin, executor choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from musegl_core.errors import ConfigError
from musegl_core.plugins.manager import PluginManager

PLUGIN_SOURCE = textwrap.dedent(
    '''
    """A throwaway plugin written by the test suite."""
    from musegl_core.plugins import hookimpl
    from musegl_core.plugins.specs import ExecutorSpec, ToolParserSpec

    def _create(options):
        raise RuntimeError("the throwaway executor only exists to be chosen")

    @hookimpl
    def musegl_executors():
        return [
            ExecutorSpec("throwaway-best", "always available, top priority", _create, lambda: True, 10_000),
            ExecutorSpec("throwaway-unavailable", "never available", _create, lambda: False, 20_000),
        ]

    @hookimpl
    def musegl_tool_parsers():
        return [ToolParserSpec("throwaway-tools", "a tool parser name", lambda tools, options: None)]

    @hookimpl
    def musegl_serve_options(group):
        group.add_argument("--throwaway-knob", type=int, default=3)
    '''
)


@pytest.fixture()
def throwaway_plugin(tmp_path, monkeypatch):
    """Install a real distribution (dist-info + entry point) on sys.path."""
    (tmp_path / "musegl_throwaway.py").write_text(PLUGIN_SOURCE)
    info = tmp_path / "musegl_throwaway-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: musegl-throwaway\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[musegl]\nthrowaway = musegl_throwaway\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "musegl_throwaway", raising=False)
    return tmp_path


def test_discovery_finds_the_throwaway_plugin(throwaway_plugin):
    manager = PluginManager()
    names = {p.name for p in manager.describe()}
    assert {"core", "throwaway"} <= names
    info = next(p for p in manager.describe() if p.name == "throwaway")
    assert info.distribution == "musegl-throwaway" and info.version == "0.0.1"
    assert info.provides["executors"] == ("throwaway-best", "throwaway-unavailable")
    assert info.provides["tool_parsers"] == ("throwaway-tools",)


def test_best_available_executor_is_chosen(throwaway_plugin):
    manager = PluginManager()
    assert manager.choose_executor().name == "throwaway-best"  # the unavailable one has higher priority
    with pytest.raises(ConfigError, match="cannot run on this machine"):
        manager.choose_executor("throwaway-unavailable")


def test_plugin_flag_loads_only_the_named_plugins(throwaway_plugin):
    only_throwaway = PluginManager(only=["throwaway"])
    assert [p.name for p in only_throwaway.describe()] == ["core", "throwaway"]
    assert "torch-cpu" not in only_throwaway.specs("executors")
    only_cuda = PluginManager(only=["cuda"])
    assert "throwaway-best" not in only_cuda.specs("executors")
    assert only_cuda.choose_executor().name == "torch-cpu"  # no GPU on the test machine


def test_unknown_plugin_is_a_clear_error(throwaway_plugin):
    with pytest.raises(ConfigError, match="plugin 'nope' is not installed"):
        PluginManager(only=["nope"])


def test_core_defaults_are_registered_through_hooks():
    manager = PluginManager(only=[])
    assert "openai" in manager.specs("dialects")
    assert "muse" in manager.specs("templates")
    with pytest.raises(ConfigError, match="musegl-openrouter"):
        manager.get("dialects", "openrouter")


def test_plugin_serve_options_reach_the_parser(throwaway_plugin):
    from musegl_core.cli.serve import build_parser

    parser = build_parser(PluginManager())
    args = parser.parse_args(["--throwaway-knob", "7"])
    assert args.throwaway_knob == 7


def test_musegl_plugins_command_lists_the_throwaway(throwaway_plugin):
    env = {**os.environ, "PYTHONPATH": f"{throwaway_plugin}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-m", "musegl_core.cli.main", "plugins", "--json"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    listed = {p["name"]: p for p in json.loads(out)}
    assert listed["throwaway"]["provides"]["executors"] == ["throwaway-best", "throwaway-unavailable"]
    assert "torch-cpu" in listed["cuda"]["provides"]["executors"]
