"""No arrows back up: the core's packages import each other one way only, and the
edges the layering forbids stay absent (lazy imports count; ``if TYPE_CHECKING:``
imports do not). The layers, bottom up, are in docs/architecture.md."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.support.import_graph import REPO, cycles, import_graph, package_graph, package_roots

#: (importer, imported): no module under the first imports anything under the second
FORBIDDEN = [
    ("musegl_core.service", "musegl_core.http"),  # the service is the floor under every surface
    ("musegl_core.service", "musegl_core.openai"),
    ("musegl_core.http", "musegl_core.openai"),  # the server frame does not know the core's own surfaces
    ("musegl_core.worker", "musegl_core.http"),  # the worker process below the front
    ("musegl_core.worker", "musegl_core.openai"),
    ("musegl_core.worker", "musegl_core.service"),
    ("musegl_core.worker", "musegl_core.cli"),
    ("musegl_core.engine", "musegl_core.worker"),
    ("musegl_core.engine", "musegl_core.service"),
    ("musegl_core.engine", "musegl_core.http"),
    ("musegl_core.chat", "musegl_core.engine"),  # both read musegl_core.prompt
    ("musegl_core.checkpoint", "musegl_core.tiny"),  # the readers below what is built on them
    ("musegl_core.checkpoint", "musegl_core.tokenizer"),
    ("musegl_core.checkpoint", "musegl_core.model_tokenizer"),
]

#: plugin packages that provide API surfaces or dialects: none imports another surface's module
SURFACE_PLUGINS = ("musegl_anthropic", "musegl_responses", "musegl_openrouter")


def core_graph() -> dict[str, set[str]]:
    return import_graph(REPO / "musegl_core", outside=True)


def test_the_core_packages_import_each_other_one_way():
    graph = import_graph(REPO / "musegl_core")
    assert cycles(package_graph(graph)) == []


@pytest.mark.parametrize("importer,imported", FORBIDDEN, ids=lambda pair: pair.rpartition(".")[2])
def test_no_arrow_back_up(importer, imported):
    graph = core_graph()
    found = sorted((name, target) for name, targets in graph.items() if name.startswith(importer + ".")
                   or name == importer for target in targets if target == imported or target.startswith(imported + "."))
    assert found == []


@pytest.mark.parametrize("root", package_roots(), ids=lambda root: root.name)
def test_no_cycle_even_through_type_only_imports(root):
    """A helper that needs its owner names a small Protocol of public members
    (``RankChannel``, ``ProgramRunner``), not the owner's class under
    ``TYPE_CHECKING`` with calls of its private methods."""
    assert cycles(import_graph(root, type_checking=True)) == []


def declared_plugins(root) -> set[str]:
    """The plugin packages ``root``'s distribution depends on (its pyproject's ``dependencies``)."""
    project = tomllib.loads((root.parent / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[^A-Za-z0-9_-]", dep, maxsplit=1)[0].replace("-", "_") for dep in project.get("dependencies", ())}
    return {name for name in names if name.startswith("musegl_")}


@pytest.mark.parametrize("root", package_roots()[1:], ids=lambda root: root.name)
def test_a_plugin_imports_only_the_plugins_it_depends_on(root):
    """Surface and dialect plugins depend on none; an executor may build on
    another executor's modules (executorch on cuda and dflash) it declares."""
    allowed = {root.name, "musegl_core", *declared_plugins(root)}
    if root.name in SURFACE_PLUGINS:
        assert declared_plugins(root) == set()
    graph = import_graph(root, outside=True)
    found = sorted((name, target) for name, targets in graph.items() for target in targets
                   if target.split(".")[0].startswith("musegl_") and target.split(".")[0] not in allowed)
    assert found == []


@pytest.mark.parametrize("name", SURFACE_PLUGINS)
def test_a_surface_plugin_imports_no_sibling_surface(name):
    """A surface builds on the service and the schema kit, never on the core's own
    surface modules; a Chat Completions dialect may read their wire shapes only."""
    root = next(root for root in package_roots() if root.name == name)
    allowed = ("musegl_core.openai.schemas",) if name == "musegl_openrouter" else ()
    graph = import_graph(root, outside=True)
    found = sorted((module, target) for module, targets in graph.items() for target in targets
                   if target.startswith("musegl_core.openai")
                   and not any(target == a or target.startswith(a + ".") for a in allowed))
    assert found == []


def test_the_checker_sees_a_forbidden_lazy_edge(tmp_path):
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "high").mkdir()
    for folder in (package, package / "low", package / "high"):
        (folder / "__init__.py").write_text("")
    (package / "high" / "a.py").write_text("import pkg.low.b\n")
    (package / "low" / "b.py").write_text("def f():\n    from pkg.high import a\n")
    graph = import_graph(package)
    assert cycles(package_graph(graph)) == [["pkg.high", "pkg.low"]]
    assert "pkg.high.a" in import_graph(package, outside=True)["pkg.low.b"]
