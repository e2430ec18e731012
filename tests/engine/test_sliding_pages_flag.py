"""``--sliding-window-kv`` is refused in one line, before the worker starts, for an executor
whose spec says it keeps every position of every layer, and taken by the ones that follow
sliding pages (docs/engine.md "Sliding layers keep their window"; ExecuTorch's programs follow
when exported with ``--sliding-pages``, and the engine refuses the others at load)."""

from __future__ import annotations

import pytest

import attrs

from musegl_core.engine.sliding_pages import PageGroups, check_sliding_pages
from musegl_core.errors import ConfigError
from musegl_core.plugins.manager import PluginManager


def test_the_executors_that_follow_take_the_flag_and_the_others_refuse_it_in_one_line():
    specs = PluginManager(process="front").specs("executors")
    for name in ("torch-cpu", "cuda", "mlx", "executorch"):
        check_sliding_pages(True, specs[name])
    keeps_all = attrs.evolve(specs["executorch"], sliding_pages=False)  # an executor that keeps every position
    with pytest.raises(ConfigError) as refused:
        check_sliding_pages(True, keeps_all)
    assert "--sliding-window-kv" in str(refused.value) and "executorch" in str(refused.value)
    assert "\n" not in str(refused.value)
    check_sliding_pages(False, keeps_all)


def test_page_groups_of_the_layer_layouts():
    assert PageGroups.of([True, True, True, False]) == PageGroups(1, ((1, 0), (2, 0), (3, 0), (0, 0)), 3)
    groups = PageGroups.of([True, True, True, False] * 13)  # the 30B: 13 full, 39 sliding layers
    assert (groups.places, groups.sliding_groups, groups.sliding_layers) == (13, 3, 39)
    assert PageGroups.of([True, False, True, False, True]) is None  # 3 sliding, 2 full: no groups
    assert PageGroups.of([False, False]) is None and PageGroups.of([True]) is None
