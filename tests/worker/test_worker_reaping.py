"""Stopping the worker leaves its reaping to asyncio's child watcher (issue 47 item 24).

Shutdown closes the worker's stdin (it stops on EOF) and then signals it. The signal
went through ``subprocess.Popen.send_signal``, which polls first: a worker that had
just exited was reaped by that poll, the watcher's ``waitpid`` failed, and asyncio
logged "Unknown child process pid N, will report returncode 255" (2 of 11 SIGINTs of
``musegl serve``). The race is made certain here: the watcher's ``waitpid`` waits at a
gate until the worker has exited and been signalled."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time

import pytest

from musegl_core.config import ServeConfig
from musegl_core.worker.client import WorkerClient, send_signal

#: a stand-in worker: reads its stdin to EOF, then exits 0 (the real one stops the same way)
CHILD = "import sys; sys.stdin.buffer.read()"


def zombie(pid: int, timeout: float = 30) -> None:
    """Until ``pid`` has exited and waits to be reaped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not exit")


@pytest.fixture
def gated_waitpid(monkeypatch):
    """asyncio's child watcher calls ``os.waitpid``; ``subprocess.Popen`` polls through its own
    reference (bound at import), so only the watcher waits at this gate."""
    gate = threading.Event()
    real = os.waitpid

    def waitpid(pid, options):
        if options == 0:  # the watcher's blocking wait
            gate.wait(30)
        return real(pid, options)

    monkeypatch.setattr(os, "waitpid", waitpid)
    return gate


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stopping_an_exited_worker_leaves_it_to_the_watcher(gated_waitpid, caplog):
    async def scenario() -> int | None:
        client = WorkerClient(ServeConfig())
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, stdin=asyncio.subprocess.PIPE)
        client._proc = proc
        proc.stdin.close()  # the worker's signal to stop: it exits at once
        await asyncio.to_thread(zombie, proc.pid)
        threading.Timer(0.5, gated_waitpid.set).start()  # the watcher reaps after the signal
        await client._stop_process()
        return proc.returncode

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        code = asyncio.run(scenario())
    assert not [r for r in caplog.records if "child process" in r.getMessage()], caplog.text
    assert code == 0  # its own status, not the watcher's 255 for a child someone else reaped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_send_signal_reaches_a_running_worker_and_skips_a_reaped_one():
    async def scenario() -> tuple[int | None, int | None]:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
        send_signal(proc, signal.SIGTERM)
        first = await asyncio.wait_for(proc.wait(), 30)
        send_signal(proc, signal.SIGKILL)  # reaped: returncode is set, nothing is signalled
        return first, proc.returncode

    assert asyncio.run(scenario()) == (-signal.SIGTERM, -signal.SIGTERM)
