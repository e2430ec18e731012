"""The real client: Claude Code 2.1.328 from npm, headless (``claude -p``), against a
musegl server whose "model" answers by rules on the prompt (the scripted executor):
turn 1 calls Claude Code's own ``Write`` tool, and after the tool result it
answers. Claude Code must create the file through its tool, end with exit
status 0, and its second request must find the first one's KV: cached tokens.

Marked slow: it installs Claude Code from the npm registry (cached under
``~/.cache/musegl-tests``) and skips when npm is not there.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import httpx
import pytest

from musegl_core.testing.clients import atem_block as atem, npm_client, scripted_server

VERSION = "2.1.328"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def claude() -> pathlib.Path:
    return npm_client("claude-code", "@anthropic-ai/claude-code", VERSION, "claude")


def test_claude_code_writes_a_file_through_its_tool_and_turn_two_is_cached(claude, tmp_path):
    work = tmp_path / "work"
    (work / "home").mkdir(parents=True)
    target = work / "hello.txt"
    call = atem("Write.Write", [("file_path", str(target)), ("content", "hello from musegl\n")])
    script = [
        {"when": "</tool_output>", "reply": " to=self<|message|>The file exists now.<|eom|><|start|>assistant "
                                            "to=user<|message|>Created hello.txt.<|eot|>"},
        {"when": "create hello.txt", "reply": " to=self<|message|>Write the file.<|eom|><|start|>assistant "
                                              "to=Write.Write<|message|>" + call + "<|eot|>"},
        {"when": "", "reply": " to=user<|message|>ok<|eot|>"},  # any side request Claude Code makes
    ]
    # The tiny demo tokenizer is close to one token per character: Claude Code's
    # system prompt and tools are some 50k of its tokens (the 131,072-token context).
    with scripted_server(tmp_path / "plugin", script, max_sessions=4) as server:
        env = {**os.environ, "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "local",
               "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1",
               "HOME": str(work / "home")}
        run = subprocess.run([str(claude), "-p", "create hello.txt", "--output-format", "stream-json", "--verbose",
                              "--permission-mode", "acceptEdits"],
                             cwd=work, env=env, capture_output=True, text=True, timeout=300)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    assert target.read_text() == "hello from musegl\n"
    result = events[-1]
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"]
    assert result["result"] == "Created hello.txt."
    uses = [block for event in events if event["type"] == "assistant"
            for block in event["message"]["content"] if block["type"] == "tool_use"]
    assert [use["name"] for use in uses] == ["Write"]
    calls = {}
    for event in events:
        if event["type"] == "assistant":
            calls[event["message"]["id"]] = event["message"]["usage"]
    last = list(calls.values())[-1]  # the request after the tool result
    prompt = last["input_tokens"] + last["cache_read_input_tokens"]
    assert last["cache_read_input_tokens"] >= 0.9 * prompt, last


# -- issue 49: what Claude Code tripped on at default settings ----------------------------------------
def claude_env(url: str, work: pathlib.Path) -> dict[str, str]:
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    # no first-run dialogs: onboarding done, the folder trusted, the API key approved
    (home / ".claude.json").write_text(json.dumps({
        "hasCompletedOnboarding": True, "theme": "dark",
        "customApiKeyResponses": {"approved": ["local"], "rejected": []},
        "projects": {str(work): {"hasTrustDialogAccepted": True, "hasCompletedProjectOnboarding": True}}}))
    return {**os.environ, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "local", "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "HOME": str(home),
            "PWD": str(work)}


def run_headless(claude: pathlib.Path, url: str, work: pathlib.Path, *args: str) -> None:
    run = subprocess.run([str(claude), "-p", *args, "--output-format", "stream-json", "--verbose",
                          "--permission-mode", "acceptEdits"],
                         cwd=work, env=claude_env(url, work), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])


def run_interactive(claude: pathlib.Path, url: str, work: pathlib.Path, lines: list[tuple[str, float]]) -> str:
    """Claude Code's terminal UI on a pseudo-terminal: types each line, waits, and returns the screen text."""
    import pty
    import re
    import threading
    import time

    master, slave = pty.openpty()
    env = {**claude_env(url, work), "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    process = subprocess.Popen([str(claude)], cwd=work, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    screen = bytearray()

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            screen.extend(data)

    threading.Thread(target=read, daemon=True).start()
    try:
        time.sleep(8)  # start-up
        for line, wait in lines:
            for char in line:
                os.write(master, char.encode())
                time.sleep(0.02)
            time.sleep(0.3)
            os.write(master, b"\r")
            time.sleep(wait)
    finally:
        process.terminate()
        process.wait(30)
        os.close(master)
    return re.sub(r"\x1b\[[0-9;?<>]*[a-zA-Z]|\x1b\][^\x07]*\x07", "", screen.decode("utf-8", "replace"))


@pytest.fixture
def plain_server(tmp_path):
    from musegl_core.testing.capture import capturing_proxy

    with scripted_server(tmp_path / "plugin", [{"when": "", "reply": " to=user<|message|>ok<|eot|>"}]) as server, \
            capturing_proxy(server.url) as proxy:
        yield server, proxy


def generations(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("request ") and " POST /v1/messages" in r.getMessage()]


def test_claude_code_headless_no_4xx_and_a_second_conversation_reuses_the_first(claude, plain_server, tmp_path,
                                                                                caplog):
    """-p --output-format stream-json --verbose: thinking display "updates", a system message at
    messages[1] with output_config.effort, the billing block's fingerprint; then /compact."""
    import logging

    server, proxy = plain_server
    caplog.set_level(logging.INFO, logger="musegl.http")
    work = tmp_path / "work"
    work.mkdir()
    run_headless(claude, proxy.url, work, "say hello")
    run_headless(claude, proxy.url, work, "write a poem about the sea")
    run_headless(claude, proxy.url, work, "--continue", "/compact")
    statuses = [(e.path, e.status) for e in proxy.exchanges]
    assert all(status == 200 for _, status in statuses), statuses
    first, second = (json.loads(e.body) for e in proxy.exchanges[:2])
    # the shapes that were 400s, as this client version sends them
    assert first["thinking"] == {"type": "adaptive", "display": "updates"}
    assert first["messages"][1]["role"] == "system" and "effort" in first["messages"][1]["output_config"]
    assert first["system"][0]["text"] != second["system"][0]["text"]  # another conversation fingerprint
    lines = generations(caplog)
    assert len(lines) == len(proxy.exchanges) and all(" 200 " in line for line in lines), lines
    cached = [int(line.split(" cached=")[1].split()[0]) for line in lines]
    assert cached[1] >= 25_000, lines  # the second conversation's first request reuses the first one's prefix
    # the first-turn prompt, counted on the body as captured
    counted = httpx.post(f"{server.url}/v1/messages/count_tokens?beta=true", timeout=60,
                         json={k: v for k, v in first.items() if k not in ("max_tokens", "stream")})
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] <= 35_000, counted.json()


def test_claude_code_interactive_with_compact_no_4xx(claude, plain_server, tmp_path, caplog):
    """The terminal UI in its default (auto) permission mode sends ``safeguards``: answered unsupported."""
    import logging

    server, proxy = plain_server
    caplog.set_level(logging.INFO, logger="musegl.http")
    work = tmp_path / "work"
    work.mkdir()
    screen = run_interactive(claude, proxy.url, work, [("say hello", 15), ("/compact", 25)])
    statuses = [(e.path, e.status) for e in proxy.exchanges]
    assert len(statuses) >= 2 and all(status == 200 for _, status in statuses), statuses
    assert all("safeguards" in json.loads(e.body) for e in proxy.exchanges)
    # the compaction turn: the conversation so far and a request to summarise it, answered 200. (The
    # screen is drawn by a differential renderer that skips cells already showing the right character,
    # so its text is read for errors only, never for a word that must appear whole.)
    compaction = json.loads(proxy.exchanges[-1].body)
    assert "say hello" in json.dumps(compaction["messages"]), compaction["messages"]
    assert "summary" in json.dumps(compaction["messages"][-1]).lower(), compaction["messages"][-1]
    assert "Error" not in screen, screen[-3000:]
    assert all(" 200 " in line for line in generations(caplog))


def test_claude_code_drops_an_image_a_text_only_model_refuses_and_goes_on(claude, tmp_path, monkeypatch):
    """Issue 49 item 7: its Read tool returns a PNG; the text-only model's 400 names the image block as
    Anthropic does, and Claude Code resends the turn without the image, once, and finishes."""
    from PIL import Image

    from musegl_core.testing.capture import capturing_proxy

    monkeypatch.setenv("MUSEGL_SCRIPT_VISION", "0")  # the scripted worker reads no images
    work = tmp_path / "work"
    work.mkdir()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(work / "pic.png")
    script = [
        {"when": "</tool_output>", "reply": " to=user<|message|>It is a picture.<|eot|>"},
        {"when": "describe pic.png",
         "reply": " to=Read.Read<|message|>" + atem("Read.Read", [("file_path", str(work / "pic.png"))]) + "<|eot|>"},
        {"when": "", "reply": " to=user<|message|>ok<|eot|>"},
    ]
    with scripted_server(tmp_path / "plugin", script) as server, capturing_proxy(server.url) as proxy:
        run = subprocess.run([str(claude), "-p", "describe pic.png", "--output-format", "stream-json",
                              "--verbose", "--permission-mode", "acceptEdits"],
                             cwd=work, env=claude_env(proxy.url, work), capture_output=True, text=True,
                             timeout=300)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    statuses = [e.status for e in proxy.exchanges]
    assert statuses == [200, 400, 200], statuses  # one round trip for the image, not a dozen

    def images(body: bytes) -> int:
        return json.dumps(json.loads(body)).count('"type": "image"')

    assert images(proxy.exchanges[1].body) == 1 and images(proxy.exchanges[2].body) == 0
