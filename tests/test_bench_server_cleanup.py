"""benchmarks/common.py: a benchmark script that is terminated (``timeout``'s SIGTERM) stops the
servers it started, workers included; one killed outright leaves groups that
``common.py reap`` (what h200_run.sh runs after each part) stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

def group_alive(pgid: int) -> bool:  # the helper of benchmarks/common.py, loaded by path
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common", BENCHMARKS / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.group_alive(pgid)

# A server with a worker child in its group, like musegl serve's front and worker: /health is 200.
SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")

# A benchmark script: starts the server through server_process, says its group, then "measures".
SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from common import free_port, server_process
    port = free_port()
    with server_process([sys.executable, "-c", sys.argv[2], str(port)], port, name="fake", ready_timeout=60) as (_, p):
        print(p.pid, flush=True)
        time.sleep(600)
""")


def wait_gone(pgid: int, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    return False


def start(env=None) -> tuple[subprocess.Popen, int]:
    script = subprocess.Popen([sys.executable, "-c", SCRIPT, str(BENCHMARKS), SERVER], stdout=subprocess.PIPE,
                              text=True, env=env)
    pgid = int(script.stdout.readline())
    deadline = time.monotonic() + 10  # the worker child is up (two processes in the group)
    while time.monotonic() < deadline:
        if len(subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()) >= 2:
            break
        time.sleep(0.1)
    return script, pgid


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_terminated_script_stops_its_server_group(signum):
    script, pgid = start()
    assert group_alive(pgid)
    script.send_signal(signum)
    assert script.wait(30) == 128 + signum
    assert wait_gone(pgid), "the server (or its worker) outlived the terminated script"


def test_reap_stops_the_groups_of_a_killed_script(tmp_path):
    groups = tmp_path / "groups"
    script, pgid = start({**os.environ, "MUSEGL_BENCH_SERVER_GROUPS": str(groups)})
    script.kill()  # SIGKILL: no cleanup runs, the server survives
    script.wait(10)
    assert group_alive(pgid)
    assert groups.read_text().split() == [str(pgid)]
    done = subprocess.run([sys.executable, str(BENCHMARKS / "common.py"), "reap", str(groups)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(pgid)]
    assert wait_gone(pgid)
    assert groups.read_text() == ""
