"""``musegl``: serve, generate, make-tiny, plugins, render, parse, worker,
and the commands plugins add (hook ``musegl_commands``).

Each core subcommand lives in its own module under :mod:`musegl_core.cli`;
this module only dispatches. Usage errors and bad values exit with status 2
and a one-line reason.
"""

from __future__ import annotations

import argparse
import sys

from musegl_core import __version__
from musegl_core.docstrings import summary
from musegl_core.errors import ConfigError


class OneLineParser(argparse.ArgumentParser):
    """argparse, but usage errors are one line: ``musegl serve: error: ...``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


COMMANDS = {
    "serve": "musegl_core.cli.serve",
    "generate": "musegl_core.cli.generate",
    "make-tiny": "musegl_core.cli.make_tiny",
    "plugins": "musegl_core.cli.plugins",
    "render": "musegl_core.cli.render",
    "parse": "musegl_core.cli.parse",
    "bench": "musegl_core.cli.bench",
    "worker": "musegl_core.worker.main",
}


def plugin_commands() -> dict:
    """The ``CommandSpec`` objects of every installed plugin, by name. A plugin
    command named like a core command is a ConfigError naming its plugin."""
    from musegl_core.plugins.manager import PluginManager

    found = PluginManager().provided("commands")
    for name, (plugin, _spec) in found.items():
        if name in COMMANDS:
            raise ConfigError(f"plugin {plugin!r} adds a command {name!r}, which is a core command")
    return {name: spec for name, (_plugin, spec) in found.items()}


def run_plugin_command(spec, argv: list[str]) -> int:
    parser = OneLineParser(prog=f"musegl {spec.name}", description=spec.description)
    spec.add_arguments(parser)
    args = parser.parse_args(argv)
    return spec.run(args) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"musegl {__version__}: serve Muse Glimmer models\n")
        print("usage: musegl COMMAND [options]   (musegl COMMAND --help for details)\n")
        print("commands:")
        for name, module in COMMANDS.items():
            print(f"  {name:<10} {summary(__import__(module, fromlist=['_']).__doc__)}")
        try:
            extra = plugin_commands()
        except ConfigError as exc:  # a broken plugin must not hide the help
            print(f"\n(plugin commands unavailable: {exc})")
            extra = {}
        if extra:
            print("\nplugin commands:")
            for name, spec in sorted(extra.items()):
                print(f"  {name:<10} {spec.description}")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"musegl {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command not in COMMANDS:
            extra = plugin_commands()
            if command not in extra:
                known = ", ".join([*COMMANDS, *sorted(extra)])
                print(f"musegl: error: unknown command {command!r} (choose from {known})", file=sys.stderr)
                return 2
            return run_plugin_command(extra[command], rest)
        module = __import__(COMMANDS[command], fromlist=["main"])
        return module.main(rest) or 0
    except ConfigError as exc:
        print(f"musegl {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
