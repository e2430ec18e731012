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
import shutil
import subprocess

import pytest

from musegl_core.config import ServeConfig
from musegl_core.tiny import default_model_path
from musegl_core.testing.server import running_server, scripted_plugin_env

VERSION = "2.1.328"
CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "musegl-tests" / "claude-code"

pytestmark = pytest.mark.slow


def atem(name: str, params: list[tuple[str, str]]) -> str:
    body = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in params)
    return f'<atem:function_calls>\n<atem:invoke name="{name}">\n{body}</atem:invoke>\n</atem:function_calls>'


@pytest.fixture(scope="module")
def claude() -> pathlib.Path:
    binary = CACHE / VERSION / "node_modules" / ".bin" / "claude"
    if not binary.exists():
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed")
        (CACHE / VERSION).mkdir(parents=True, exist_ok=True)
        install = subprocess.run(["npm", "install", "--no-audit", "--no-fund", f"@anthropic-ai/claude-code@{VERSION}"],
                                 cwd=CACHE / VERSION, capture_output=True, text=True, timeout=600)
        if install.returncode != 0:
            pytest.skip(f"npm could not install Claude Code: {install.stderr[-500:]}")
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    assert VERSION in version.stdout, version.stdout + version.stderr
    return binary


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
    (tmp_path / "plugin").mkdir()
    with scripted_plugin_env(tmp_path / "plugin", script):
        # The tiny demo tokenizer is close to one token per character: Claude Code's
        # system prompt and tools are some 50k of its tokens.
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", tool_parser="atem",
                             max_context=131072, max_sessions=4)
        with running_server(config) as server:
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
