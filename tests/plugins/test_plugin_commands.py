"""Plugin subcommands (hook ``musegl_commands``) and executors that claim a model format."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from musegl_core.cli.main import main
from musegl_core.plugins.manager import PluginManager

PLUGIN_SOURCE = textwrap.dedent(
    '''
    """A throwaway plugin with a command and a format-claiming executor."""
    import json

    from musegl_core.errors import ConfigError
    from musegl_core.plugins import hookimpl
    from musegl_core.plugins.specs import CommandSpec, ExecutorSpec

    def add_arguments(parser):
        parser.add_argument("word")
        parser.add_argument("--times", type=int, default=1)

    def run(args):
        if args.word == "bad":
            raise ConfigError("the word 'bad' is refused")
        print(json.dumps({"echo": [args.word] * args.times}))
        return 3 if args.word == "three" else None

    def _create(options):
        raise RuntimeError("never created")

    @hookimpl
    def musegl_commands():
        return [CommandSpec("echo-words", "repeat a word", add_arguments, run)]

    @hookimpl
    def musegl_executors():
        return [ExecutorSpec("claimer", "claims *.claimed", _create, lambda: True, priority=-5,
                             claims=lambda model: model.endswith(".claimed"))]
    '''
)
SHADOWING = textwrap.dedent(
    '''
    from musegl_core.plugins import hookimpl
    from musegl_core.plugins.specs import CommandSpec

    @hookimpl
    def musegl_commands():
        return [CommandSpec("serve", "a second serve", lambda parser: None, lambda args: 0)]
    '''
)


def install(tmp_path, monkeypatch, module: str, source: str, entry: str) -> None:
    """A real distribution (dist-info + entry point) on sys.path."""
    (tmp_path / f"{module}.py").write_text(source)
    info = tmp_path / f"{module}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[musegl]\n{entry} = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)


@pytest.fixture()
def commands_plugin(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, "musegl_cmdplugin", PLUGIN_SOURCE, "cmdplugin")
    return tmp_path


def test_a_plugin_command_runs_with_its_arguments_and_status(commands_plugin, capsys):
    assert main(["echo-words", "hi", "--times", "2"]) == 0
    assert capsys.readouterr().out.strip() == '{"echo": ["hi", "hi"]}'
    assert main(["echo-words", "three"]) == 3


def test_a_plugin_command_error_is_one_line_and_status_2(commands_plugin, capsys):
    assert main(["echo-words", "bad"]) == 2
    assert capsys.readouterr().err == "musegl echo-words: error: the word 'bad' is refused\n"
    with pytest.raises(SystemExit) as usage:
        main(["echo-words"])  # the required argument is missing: argparse's one line
    assert usage.value.code == 2
    assert capsys.readouterr().err.startswith("musegl echo-words: error:")


def test_help_lists_plugin_commands_and_unknown_commands_name_them(commands_plugin, capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "plugin commands:" in out and "echo-words" in out and "repeat a word" in out
    assert main(["nope"]) == 2
    assert "echo-words" in capsys.readouterr().err


def test_a_plugin_cannot_replace_a_core_command(tmp_path, monkeypatch, capsys):
    install(tmp_path, monkeypatch, "musegl_shadow", SHADOWING, "shadow")
    assert main(["not-a-command"]) == 2
    assert "plugin 'shadow' adds a command 'serve', which is a core command" in capsys.readouterr().err


def test_an_executor_that_claims_the_model_is_chosen(commands_plugin):
    manager = PluginManager()
    assert manager.choose_executor(None, "weights.claimed").name == "claimer"
    assert manager.choose_executor(None, "model.gguf").name != "claimer"  # lowest priority otherwise
    assert manager.choose_executor("torch-cpu", "weights.claimed").name == "torch-cpu"  # a named one wins


def test_plugin_commands_run_through_the_console_entry(commands_plugin):
    env = {**os.environ, "PYTHONPATH": f"{commands_plugin}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "musegl_core.cli.main", "echo-words", "x"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == '{"echo": ["x"]}'
