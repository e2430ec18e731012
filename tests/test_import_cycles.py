"""No import cycles inside the core or inside any plugin package (lazy imports count;
``if TYPE_CHECKING:`` imports do not)."""

from __future__ import annotations

import pytest

from tests.support.import_graph import cycles, import_graph, package_roots


@pytest.mark.parametrize("root", package_roots(), ids=lambda root: root.name)
def test_no_import_cycles(root):
    assert cycles(import_graph(root)) == []


def test_the_checker_sees_a_lazy_cycle_and_skips_type_checking_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("def thing():\n    from . import a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n")
    (package / "d.py").write_text("import pkg.c\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_the_worker_process_module_is_no_library():
    """``musegl_core.worker.main`` is the worker's entry point: nothing in the core imports it
    (``musegl generate`` and ``musegl render`` use ``worker.loading`` and ``worker.prepare``)."""
    from tests.support.import_graph import REPO

    graph = import_graph(REPO / "musegl_core")
    assert sorted(name for name, targets in graph.items() if "musegl_core.worker.main" in targets) == []
