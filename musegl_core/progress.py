"""Progress bars for long user-facing work (model loading, conversion, benchmarks)."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


_shown = True


def show_progress(shown: bool) -> None:
    """Turn the bars on or off for this process (the worker follows ``--log-level``:
    off at ``warning`` and ``error``, where only problems are to be printed)."""
    global _shown
    _shown = shown


def _ignore(done: int, total: int, what: str = "") -> None:
    pass


@contextlib.contextmanager
def loading_progress(title: str) -> Iterator[Callable[[int, int, str], None]]:
    """A rich progress bar on stderr; yields ``progress(done, total, what)`` (which does
    nothing while :func:`show_progress` turned the bars off)."""
    if not _shown:
        yield _ignore
        return
    console = Console(file=sys.stderr)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[what]}", style="dim"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task(title, total=None, what="")

        def update(done: int, total: int, what: str = "") -> None:
            bar.update(task, completed=done, total=total, what=what)

        yield update
