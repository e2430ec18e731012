"""opencode 1.18.33, installed from npm, against a server with no session flags (issue 49 item 1).

opencode sends ``X-Session-Id: ses_…`` with ``x-session-affinity`` of the same
value on every request of a conversation, its title request included. That is
its conversation key, not a session it asks the server to keep: it names a
soft session (docs/sessions.md), so six conversations in a row on the default
four slots all succeed, and an anonymous request afterwards is served.

Marked slow: it installs opencode from the npm registry (cached under
``~/.cache/musegl-tests``) and skips when npm is not there. The scripted
executor answers every prompt with a short text, so what is checked is the
server's side: the status of every request, and the sessions it holds.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import subprocess

import httpx
import pytest

from musegl_core.testing.clients import npm_client, scripted_server

VERSION = "1.18.33"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def opencode() -> pathlib.Path:
    return npm_client("opencode", "opencode-ai", VERSION, "opencode")


def run_opencode(opencode: pathlib.Path, url: str, root: pathlib.Path, prompt: str) -> subprocess.CompletedProcess:
    work, home = root / "work", root / "home"
    work.mkdir(parents=True)
    home.mkdir()
    (work / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"musegl": {"npm": "@ai-sdk/openai-compatible", "name": "musegl",
                                "options": {"baseURL": f"{url}/v1", "apiKey": "local"},
                                "models": {"muse": {"name": "Muse", "limit": {"context": 131072, "output": 4096}}}}},
        "model": "musegl/muse", "small_model": "musegl/muse", "autoupdate": False, "share": "disabled",
    }))
    # opencode takes its project directory from $PWD, not from the working directory
    env = {**os.environ, "HOME": str(home), "PWD": str(work), "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    return subprocess.run([str(opencode), "run", "-m", "musegl/muse", prompt], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_six_opencode_conversations_on_a_default_server_then_an_anonymous_request(opencode, tmp_path, caplog):
    script = [{"when": "", "reply": " to=user<|message|>ok<|eot|>"}]
    caplog.set_level(logging.INFO, logger="musegl.http")
    with scripted_server(tmp_path / "plugin", script) as server:
        # no session flags: 4 slots, named sessions persist, no eviction of named sessions
        config = server.config
        assert config.max_sessions == 4 and not config.evict_idle_sessions and config.session_idle_timeout is None
        for i in range(6):
            done = run_opencode(opencode, server.url, tmp_path / f"c{i}", f"say hello number {i}")
            assert done.returncode == 0, (i, done.stdout[-2000:], done.stderr[-2000:])
        sessions = httpx.get(f"{server.url}/v1/sessions").json()["data"]
        anonymous = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert anonymous.status_code == 200, anonymous.text
    # opencode's conversations ran in soft sessions; none of them holds a slot for good
    assert sessions and all(re.fullmatch(r"opencode:ses_\w+", s["id"]) for s in sessions), sessions
    assert len(sessions) <= 4
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    chat = [line for line in lines if " POST /v1/chat/completions " in line]
    assert len(chat) >= 13, lines  # each conversation's answer and its title request, then the anonymous one
    assert all(" 200 " in line for line in chat), [line for line in chat if " 200 " not in line]
