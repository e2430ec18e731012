"""Shared by the benchmark scripts: the bench checkpoint and a server subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx

#: Set (by h200_run.sh) to a file: every server this process starts appends its process group id
#: there, so that the caller can reap the groups of a script that died without its cleanup (SIGKILL).
GROUPS_ENV = "MUSEGL_BENCH_SERVER_GROUPS"
#: The signals that end a benchmark script through its cleanup (``timeout`` sends SIGTERM).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _raise_exit(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def exit_on_termination() -> None:
    """Turn SIGTERM, SIGINT and SIGHUP into ``SystemExit`` (once, in the main thread), so that
    ``finally`` blocks, and with them :func:`server_process`'s stop of its server, run when the
    script is terminated; Python's default SIGTERM ends the process at once and orphans them."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(signum, _raise_exit)


def group_alive(pgid: int) -> bool:
    """Whether the process group ``pgid`` has a process that is not a zombie (on Linux from
    /proc: a finished child nobody has reaped yet still counts for ``killpg(pgid, 0)``)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def stop_group(pgid: int, grace: float = 30.0, process: subprocess.Popen | None = None) -> bool:
    """SIGTERM the process group ``pgid``, SIGKILL what is left after ``grace`` seconds (reaping
    ``process``, its leader when it is this process's child); whether any process of it was there."""
    if not group_alive(pgid):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if process is not None:
            process.poll()
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    return True


def reap_server_groups(path: str | Path, grace: float = 10.0) -> list[int]:
    """Stop every process group listed in ``path`` (one id a line, :data:`GROUPS_ENV`) that still
    has a process, then empty the file; the ids that were still alive."""
    path = Path(path)
    if not path.exists():
        return []
    alive = []
    for line in path.read_text().split():
        if line.isdigit() and stop_group(int(line), grace):
            alive.append(int(line))
    path.write_text("")
    return alive


def bench_checkpoint() -> Path:
    """The ``bench`` preset (hidden 1024, 8 layers, GQA 8/2, head_dim 128), built once into the cache."""
    from musegl_core.tiny import default_model_path

    return default_model_path(preset="bench", progress=True)


def pin_cpu_kernels(choice: str | None) -> dict[str, str | None]:
    """Fix the stored-weight kernel path ``musegl serve`` will run (``MUSEGL_CPU_KERNELS``
    for the servers this process starts): ``choice``, else the variable's value, else the
    best path this CPU runs; a path that cannot run here stops the benchmark. Returns the
    path's name and what it is (the report's ``cpu_kernels``)."""
    from musegl_cuda.cpu import native

    if choice:
        os.environ[native.ENV] = choice
    native.reset()
    chosen = native.load()  # raises KernelPathError for a path this machine cannot run
    os.environ[native.ENV] = native.selected_path()
    return {"path": native.selected_path(), "summary": chosen.path.summary if chosen else None,
            "why_fallback": native.unavailable_reason(), "forced": choice or None}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(model: Path, *flags: str, ready_timeout: float = 600.0) -> Iterator[str]:
    """Run ``musegl serve MODEL FLAGS`` as a subprocess; yield its base URL once /health is 200.

    The server's output goes to a log file whose path is printed if it fails.
    """
    with serve_process(model, *flags, ready_timeout=ready_timeout) as (url, _process):
        yield url


@contextlib.contextmanager
def serve_process(model: Path, *flags: str, ready_timeout: float = 600.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`serve`, also yielding the front's process (its child is the worker)."""
    port = free_port()
    command = [sys.executable, "-m", "musegl_core.cli.main", "serve", str(model), "--port", str(port), *flags]
    print("$ musegl serve " + " ".join(command[4:]), file=sys.stderr)
    with server_process(command, port, name="musegl-serve", ready_timeout=ready_timeout) as running:
        yield running


@contextlib.contextmanager
def server_process(command: list[str], port: int, *, name: str, health: str = "/health",
                   env: dict[str, str] | None = None,
                   ready_timeout: float = 600.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run an HTTP server ``command`` (listening on ``port``) in its own session, output to a
    log file; yield ``(base URL, process)`` once ``health`` answers 200; stop the whole
    session (a front and its workers) afterwards. Failures name the log file."""
    exit_on_termination()
    log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    if os.environ.get(GROUPS_ENV):
        with open(os.environ[GROUPS_ENV], "a", encoding="utf-8") as groups:
            groups.write(f"{process.pid}\n")  # its own session: the group id is its pid
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode}; see {log.name}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + health, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not ready within {ready_timeout:.0f} s; see {log.name}")
            time.sleep(0.5)
        yield url, process
    finally:
        # the whole group (a front and its workers, even once the front is gone); a second
        # termination signal waits until the group is stopped
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            stop_group(process.pid, process=process)
            process.wait()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            log.close()


if __name__ == "__main__":  # python benchmarks/common.py reap FILE: what h200_run.sh runs after each part
    if len(sys.argv) != 3 or sys.argv[1] != "reap":
        sys.exit("usage: common.py reap GROUPS_FILE")
    print(" ".join(map(str, reap_server_groups(sys.argv[2]))))
