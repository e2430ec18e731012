"""Export and lower the program's methods in several processes.

Every stage of the lowering up to the program's emission (``torch.export``, the
decompositions, the edge passes, XNNPACK's partitions and preprocessing) is per
method, and runs on one core. With ``jobs`` processes, the export process forks
``jobs - 1`` workers (which inherit the loaded modules, nothing is copied in);
each process takes the next method not yet taken (the costliest first), exports
and lowers it, and a worker hands its lowered method back through ExecuTorch's
edge-dialect serialization (``executorch.exir.serde``: the graph, its
delegates' XNNPACK bytes and their weights) in a file of ``scratch``. The
export process loads them back and emits the program as if it had lowered
every method itself (the same ``.pte`` bytes).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch

from musegl_executorch.export.lower import (DRAFT_BLOCK, DRAFT_CONTEXT, EMBED_TEXT, FROM_EMBEDDINGS, OTHERS,
                                            VISION_ENCODER)

#: ``report(method, done, total, what)``: a method's progress (2 steps: exported, lowered).
Report = Callable[[str, int, int, str], None]
STEPS = 2
#: What a method's report says before a process takes it.
WAITING = "waiting"


def default_jobs() -> int:
    """Two processes when this process may run on two cores or more, else one."""
    return 2 if len(os.sched_getaffinity(0)) >= 2 else 1


def claim_order(names: list[str]) -> list[str]:
    """The order processes take methods in: the costliest first (the prefill methods
    of ``max_prefill_chunk`` rows, the draft block, the widest decode method, ...),
    so that the last methods taken are the short ones and the processes end together."""
    rank = {OTHERS: 0, FROM_EMBEDDINGS: 0, DRAFT_BLOCK: 1, VISION_ENCODER: 3, DRAFT_CONTEXT: 4, EMBED_TEXT: 5}

    def key(name: str):
        if name in rank:
            return rank[name], 0
        width = name.removeprefix("forward_")
        return 2, -int(width) if width.isdigit() else 0  # forward_{N}, widest first

    return sorted(names, key=key)


class WorkerFailed(RuntimeError):
    """A worker process could not lower a method (the message holds its traceback), or
    ended before it did."""


def lower_all(names: list[str], export: Callable[[str], torch.export.ExportedProgram],
              lower: Callable[[str, torch.export.ExportedProgram], torch.export.ExportedProgram],
              jobs: int, scratch: Path, report: Report | None = None) -> dict[str, torch.export.ExportedProgram]:
    """``lower(name, export(name))`` of every method, in ``jobs`` processes (this one and
    ``jobs - 1`` forked workers), returned in the order of ``names``."""
    report = report or (lambda *_: None)
    for name in names:  # every bar, in the program's order
        report(name, 0, STEPS, WAITING)
    order = claim_order(names)
    jobs = max(1, min(jobs, len(order)))
    if jobs == 1:
        done = {}
        for name in order:
            done[name] = _one(name, export, lower, report, "")
            report(name, STEPS, STEPS, "lowered")
        return {name: done[name] for name in names}

    ctx = multiprocessing.get_context("fork")  # the workers inherit the loaded modules
    taken = ctx.Value("i", 0)
    events = ctx.Queue()
    scratch.mkdir(parents=True, exist_ok=True)
    workers = [ctx.Process(target=_worker, args=(order, taken, events, export, lower, scratch, f"worker {i}"),
                           name=f"musegl-export-{i}", daemon=True) for i in range(1, jobs)]
    files: dict[str, Path] = {}
    failures: list[str] = []
    exited = threading.Event()

    def listen() -> None:  # the workers' progress and results, while this process lowers
        ended = 0
        while ended < len(workers):
            kind, *rest = events.get()
            if kind == "report":
                report(*rest)
            elif kind == "lowered":
                files[rest[0]] = Path(rest[1])
                report(rest[0], STEPS, STEPS, f"lowered ({rest[2]})")
            elif kind == "failed":
                failures.append(rest[0])
            elif kind == "ended":
                ended += 1
        exited.set()

    for worker in workers:
        worker.start()
    listener = threading.Thread(target=listen, name="musegl-export-listener", daemon=True)
    listener.start()
    mine: dict[str, torch.export.ExportedProgram] = {}
    try:
        while not failures:
            index = _claim(taken, len(order))
            if index is None:
                break
            name = order[index]
            mine[name] = _one(name, export, lower, report, "")
            report(name, STEPS, STEPS, "lowered")
        for worker in workers:
            worker.join()
        exited.wait(timeout=5)
    except BaseException:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
        raise
    if failures:
        raise WorkerFailed(failures[0])
    missing = [name for name in order if name not in mine and name not in files]
    if missing:
        codes = ", ".join(f"{w.name}: {w.exitcode}" for w in workers)
        raise WorkerFailed(f"a lowering worker ended before lowering {', '.join(missing)} (exit status {codes})")
    for name, path in files.items():
        mine[name] = _load(path)
        path.unlink()
    return {name: mine[name] for name in names}


def _claim(taken, count: int) -> int | None:
    with taken.get_lock():
        index = taken.value
        if index >= count:
            return None
        taken.value = index + 1
        return index


def _one(name: str, export, lower, report: Report, where: str) -> torch.export.ExportedProgram:
    """One method exported and lowered (its bar at the second step: the caller reports the end)."""
    suffix = f" ({where})" if where else ""
    report(name, 0, STEPS, f"torch.export{suffix}")
    with torch.no_grad():
        program = export(name)
        report(name, 1, STEPS, f"to edge + XNNPACK{suffix}")
        lowered = lower(name, program)
    return lowered


def _worker(order: list[str], taken, events, export, lower, scratch: Path, where: str) -> None:
    """A forked worker: lower the methods it claims, hand each back in a file."""
    from executorch.exir.serde.serialize import save

    _quiet_child()
    torch.set_num_threads(1)  # one core per process
    name = "?"
    try:
        while (index := _claim(taken, len(order))) is not None:
            name = order[index]
            lowered = _one(name, export, lower, lambda *args: events.put(("report", *args)), where)
            events.put(("report", name, 1, STEPS, f"handing back ({where})"))
            path = scratch / f"{name}.pt2"
            save(lowered, path)
            events.put(("lowered", name, str(path), where))
    except BaseException:
        events.put(("failed", f"lowering {name} failed in the {where} process:\n{traceback.format_exc()}"))
    finally:
        events.put(("ended",))
        events.close()
        events.join_thread()


def _quiet_child() -> None:
    """A worker writes nothing to the terminal: the export process draws the bars there
    (a forked copy of the live display, or of a lock its threads held, must not be
    used), and the worker's warnings are the ones the export process prints too. A
    failure comes back through the events queue."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")


def _load(path: Path) -> torch.export.ExportedProgram:
    from executorch.exir.serde.serialize import load

    # The loader warns once per symbol of the dynamic axes that the delegates hide.
    quiet = logging.getLogger("executorch.exir.serde.export_serialize")
    with _level(quiet, logging.ERROR):
        return load(path)


@contextlib.contextmanager
def _level(logger: logging.Logger, level: int):
    old = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(old)
