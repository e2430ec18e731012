"""How the worker gets its settings: a setup frame on stdin, never argv, without the API key."""

from __future__ import annotations

import io

import pytest

from musegl_core.config import ServeConfig
from musegl_core.errors import ConfigError
from musegl_core.worker import messages as m
from musegl_core.worker.client import worker_command, worker_env, worker_setup
from musegl_core.worker.main import read_setup


def test_the_command_line_carries_no_settings():
    assert worker_command()[1:] == ["-m", "musegl_core.worker.main"]


def test_the_setup_frame_has_the_settings_but_not_the_key():
    config = ServeConfig(model="/m.gguf", api_key="sekrit-key", max_sessions=7)
    frame = m.encode(worker_setup(config, "warning"))
    assert b"sekrit-key" not in frame
    setup = read_setup(io.BytesIO(frame + b'{"op":"stats","id":"x"}\n'))
    assert setup.config.api_key is None and setup.config.max_sessions == 7 and setup.log_level == "warning"
    assert setup.config == ServeConfig(model="/m.gguf", max_sessions=7)


def test_the_worker_environment_has_no_secrets(monkeypatch):
    monkeypatch.setenv("MUSEGL_API_KEY", "sekrit-key")
    env = worker_env()
    assert "MUSEGL_API_KEY" not in env and env["PYTHONUNBUFFERED"] == "1"


@pytest.mark.parametrize("stdin", [b"", b"{not json}\n", b'{"op":"stats","id":"x"}\n', b'{"op":"setup"'])
def test_a_worker_without_a_setup_frame_says_so(stdin):
    with pytest.raises(ConfigError):
        read_setup(io.BytesIO(stdin))


def test_a_worker_not_ready_is_a_503_whose_retry_after_is_known_or_absent():
    """Before any start finished nothing is known: no Retry-After. After one, the estimate
    is that start's duration less the time the current one has run."""
    import time

    from litestar.testing import TestClient

    from musegl_core.http.app import create_app
    from musegl_core.plugins.manager import PluginManager
    from musegl_core.worker.client import WorkerClient

    config = ServeConfig(max_context=321).validate()
    worker = WorkerClient(config)
    with TestClient(create_app(config, PluginManager(only=[]), worker, manage_worker=False)) as client:
        first = client.get("/health")
        assert first.status_code == 503 and first.json()["error"]["code"] == "model_loading"
        assert "retry-after" not in first.headers
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503 and "retry-after" not in chat.headers
        worker._load_seconds, worker._spawned_at = 40.0, time.monotonic() - 10  # a restart 10 s in
        assert 29 <= int(client.get("/health").headers["retry-after"]) <= 30
        worker._spawned_at = time.monotonic() - 100  # slower than last time: any moment now
        assert client.get("/health").headers["retry-after"] == "1"
