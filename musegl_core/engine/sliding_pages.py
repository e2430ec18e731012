"""The layout of sliding pages (docs/engine.md "Sliding layers keep their window"), shared by
the executors that offer ``use_sliding_pages``: the full-attention layers form one group,
the sliding layers groups of as many; a layer lives at a *place* (its index in its group),
and an executor keeps one cache per place whose pages every group shares."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from musegl_core.errors import ConfigError


@attrs.frozen
class PageGroups:
    places: int  # layers per group: the caches an executor keeps
    layers: tuple[tuple[int, int], ...]  # each layer's (group, place); group 0 holds the full layers
    sliding_layers: int

    @property
    def sliding_groups(self) -> int:
        return self.sliding_layers // self.places

    @classmethod
    def of(cls, sliding: Sequence[bool]) -> PageGroups | None:
        """The groups of a model whose layers are sliding where ``sliding`` says; None where the
        full layers do not form one group (none of them, no sliding layer, or a count of sliding
        layers that is not a multiple of the full ones')."""
        full = [i for i, flag in enumerate(sliding) if not flag]
        windowed = [i for i, flag in enumerate(sliding) if flag]
        if not full or not windowed or len(windowed) % len(full):
            return None
        size = len(full)
        place = {layer: (0, j) for j, layer in enumerate(full)}
        place.update({layer: (1 + k // size, k % size) for k, layer in enumerate(windowed)})
        return cls(size, tuple(place[i] for i in range(len(sliding))), len(windowed))


def group_tables(blocks: Sequence[int], sliding_blocks: Sequence[Sequence[int]]) -> list[list[int]]:
    """Every group's block table of a chunk: the full layers' ``blocks``, then each sliding
    group's pages with -1 (a page out of every row's window, never read) as page 0."""
    return [list(blocks)] + [[b if b >= 0 else 0 for b in table] for table in sliding_blocks]


def check_sliding_pages(sliding_window_kv: bool, spec) -> None:
    """Refuse, in one line before the worker starts, ``--sliding-window-kv`` for an executor
    (its :class:`~musegl_core.plugins.specs.ExecutorSpec`) that never keeps sliding windows."""
    if sliding_window_kv and not spec.sliding_pages:
        raise ConfigError(f"--sliding-window-kv: the {spec.name} executor keeps every position of every layer "
                          "(docs/engine.md \"Sliding layers keep their window\" lists the executors that "
                          "follow it); serve without it")
