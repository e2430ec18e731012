"""The import graph of a package, read from its source with :mod:`ast`, and its cycles.

Every ``import`` and ``from ... import`` counts, at module level and inside
functions alike (a lazy import still ties two modules together), except those
under ``if TYPE_CHECKING:``, which never run. ``from a.b import c`` is an edge
to the module ``a.b.c`` when there is one, else to ``a.b``. Only modules of
the package itself are nodes.

``python -m tests.support.import_graph [ROOT ...]`` prints each package's
module and edge count and its cycles (default: the core and every plugin).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]


def package_roots() -> list[Path]:
    """The core package and every plugin's package directory."""
    roots = [REPO / "musegl_core"]
    for plugin in sorted((REPO / "plugins").iterdir()):
        roots.extend(sorted(p for p in plugin.glob("musegl_*") if (p / "__init__.py").is_file()))
    return roots


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of a module, skipping ``if TYPE_CHECKING:`` bodies
    (``type_checking``: those too)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, outside: bool = False, type_checking: bool = False) -> dict[str, set[str]]:
    """Module → the package's modules it imports (``outside``: everything it
    imports, other packages' included; ``from a.b import c`` of another package
    is ``a.b.c``, whether ``c`` is a module or a name in ``a.b``; ``type_checking``:
    the imports under ``if TYPE_CHECKING:`` count too)."""
    files = {_module_name(root, path): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            if outside and isinstance(node, ast.ImportFrom) and not node.level:  # a name of another package
                targets = [t if t in files else f"{base}.{alias.name}" for t, alias in zip(targets, node.names)]
            graph[name].update(t for t in targets if (outside or t in files) and t != name)
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the subpackages of one package (``musegl_core.http``;
    a top-level module is a node of its own): an edge where any module of one
    imports a module of the other."""

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {package(name): set() for name in graph}
    for name, targets in graph.items():
        packages[package(name)].update(package(t) for t in targets if package(t) != package(name))
    return packages


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


def main(argv: list[str]) -> int:
    roots = [Path(arg).resolve() for arg in argv] or package_roots()
    status = 0
    for root in roots:
        graph = import_graph(root)
        found = cycles(graph)
        edges = sum(len(targets) for targets in graph.values())
        print(f"{root.name}: {len(graph)} modules, {edges} internal imports, {len(found)} cycles")
        for component in found:
            print("  cycle: " + " <-> ".join(component))
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
