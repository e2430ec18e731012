"""A checkpoint that cannot be served stops `musegl serve` with one line (exit 2);
a worker that keeps dying after a successful load is restarted with backoff,
then given up on (exit 1)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from musegl_core.config import ServeConfig
from musegl_core.worker.client import WorkerClient
from musegl_core.testing.server import scripted_plugin_env


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "musegl_core.cli.main", "serve", *args, "--port", "0"],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny():
    from musegl_core.tiny import default_model_path

    return str(default_model_path())


def test_garbage_bytes_exit_2_with_one_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(os.urandom(4096))
    done = serve(str(bad))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("musegl serve: error: cannot serve"), done.stderr
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    done = serve(str(truncated))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_gguf_without_a_tokenizer_exits_2_with_one_line(tmp_path, tiny):
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.loader import load_checkpoint

    checkpoint = load_checkpoint(tiny)
    path = tmp_path / "model.gguf"
    write_text_gguf(path, checkpoint.config, dict(checkpoint.iter_weights()), None)
    checkpoint.close()
    done = serve(str(path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"musegl serve: error: cannot serve {str(path)!r}: {path} has no tokenizer metadata and no tokenizer.json beside it"
    ]


def test_a_model_the_worker_cannot_load_stops_the_server(tmp_path, tiny):
    with scripted_plugin_env(tmp_path, []) as script:
        script.write_text("[ not json")  # the executor's factory fails inside the worker
        done = serve(tiny, "--plugin", "scripted", "--executor", "scripted", timeout=180)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "musegl worker: cannot load the model" in done.stderr
    assert done.stderr.count("worker started") == 1  # not restarted
    assert done.stderr.strip().splitlines()[-1].startswith("musegl serve: error: the model worker exited with status 2")


def test_a_worker_that_keeps_dying_after_loading_is_given_up_with_backoff(tmp_path, tiny):
    reasons = []

    async def scenario():
        with scripted_plugin_env(tmp_path, [{"when": "", "reply": "ok"}]) as script:
            config = ServeConfig(model=tiny, executor="scripted", plugins=("scripted",)).validate()
            client = WorkerClient(config, restart_delay=0.05, max_failures=3, on_fatal=reasons.append)
            delays = []
            real_sleep = asyncio.sleep

            async def recording_sleep(seconds, *args):
                delays.append(seconds)
                await real_sleep(seconds, *args)

            await client.start()
            try:
                await client.wait_ready(120)
                script.write_text("[ not json")  # every later start fails to create the executor
                asyncio.sleep = recording_sleep
                os.kill(client.pid, signal.SIGKILL)
                for _ in range(600):
                    if client.fatal:
                        break
                    await real_sleep(0.1)
            finally:
                asyncio.sleep = real_sleep
                await client.close()
            return client, delays

    client, delays = asyncio.run(scenario())
    assert client.fatal and "failed 3 times in a row" in client.fatal
    assert reasons == [client.fatal]
    assert client.restarts == 3
    assert [d for d in delays if d >= 0.05][:3] == [0.05, 0.1, 0.2]  # doubled after each failure
