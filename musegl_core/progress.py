"""Progress bars for long user-facing work (model loading, conversion, benchmarks)."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def loading_progress(title: str) -> Iterator[Callable[[int, int, str], None]]:
    """A rich progress bar on stderr; yields ``progress(done, total, what)``."""
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
