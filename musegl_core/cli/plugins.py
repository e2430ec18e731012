"""List installed plugins and what each provides."""

from __future__ import annotations

import json

from musegl_core.cli.main import OneLineParser
from musegl_core.plugins.manager import PluginManager


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="musegl plugins", description=__doc__)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    manager = PluginManager()
    infos = manager.describe()
    if args.json:
        print(json.dumps([
            {"name": p.name, "distribution": p.distribution, "version": p.version,
             "provides": {k: list(v) for k, v in p.provides.items()}}
            for p in infos
        ], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="musegl plugins")
    table.add_column("plugin")
    table.add_column("distribution")
    table.add_column("provides")
    for p in infos:
        provides = "; ".join(f"{kind.replace('_', ' ')}: {', '.join(names)}" for kind, names in p.provides.items())
        dist = f"{p.distribution} {p.version}" if p.distribution else "-"
        table.add_row(p.name, dist, provides or "(hooks only)")
    Console().print(table)
    executors = {name: spec for name, spec in manager.specs("executors").items()}
    if executors:
        best = manager.choose_executor()
        print(f"executor chosen on this machine: {best.name}")
    return 0
