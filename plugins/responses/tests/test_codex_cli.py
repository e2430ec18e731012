"""Codex CLI 0.169.0, installed from npm, completes real tool loops against musegl
(issue 27, "real clients"; ../shared/spec/agent-apis.md section 4).

The executor answers by rules on the prompt (musegl_core/testing/scripted.py):
turn 1 calls the client's own tool as a Muse tool call (``exec_command``, or
the freeform ``apply_patch`` whose input the Lark grammar constrains), and
once a tool result is in the prompt it answers. Codex runs the tool, sends
turn 2 with the whole transcript, its thread id as ``prompt_cache_key`` and
the reasoning's ``encrypted_content``, and exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from musegl_core.testing.clients import atem_block as block, npm_client, scripted_server

pytestmark = pytest.mark.slow

VERSION = "0.169.0"
PATCH = "*** Begin Patch\n*** Add File: patched.txt\n+patched\n*** End Patch\n"


def call(name: str, params: list[tuple[str, str]], why: str) -> str:
    return f" to=self<|message|>{why}<|eom|><|start|>assistant to={name}<|message|>" + block(name, params) + "<|eot|>"


SCRIPT = [
    {"when": "</tool_output>",
     "reply": " to=self<|message|>The tool ran.<|eom|><|start|>assistant to=user<|message|>Done.<|eot|>"},
    {"when": "create patched.txt", "reply": call("apply_patch.apply_patch", [("input", PATCH)], "I will patch.")},
    {"when": "create hello.txt",
     "reply": call("exec_command.exec_command", [("cmd", "echo hello > hello.txt")], "I will run a command.")},
    {"when": "", "reply": " to=user<|message|>Hello.<|eot|>"},
]

#: A model catalog entry for the served model, so that Codex offers its freeform apply_patch tool.
CATALOG = {"models": [{
    "slug": "muse", "display_name": "Muse Glimmer", "description": "Muse Glimmer served by musegl",
    "base_instructions": "You are a coding agent. Use the tools to act in the workspace.",
    "apply_patch_tool_type": "freeform", "shell_type": "shell_command", "visibility": "list",
    "supported_in_api": True, "priority": 1, "context_window": 200000, "max_context_window": 200000,
    "default_reasoning_level": "medium", "supported_reasoning_levels": [{"effort": "medium", "description": "medium"}],
    "supports_reasoning_summaries": True, "supports_parallel_tool_calls": True, "support_verbosity": False,
    "truncation_policy": {"mode": "tokens", "limit": 10000}, "input_modalities": ["text"],
    "experimental_supported_tools": [],
}]}


@pytest.fixture(scope="module")
def codex():
    return npm_client("codex", "@openai/codex", VERSION, "codex")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Codex's first request is ~36k tokens of the demo tokenizer
    with scripted_server(tmp_path_factory.mktemp("codex-script"), SCRIPT, max_context=262144) as running:
        yield running


def codex_home(path, url: str):
    path.mkdir(parents=True, exist_ok=True)
    (path / "catalog.json").write_text(json.dumps(CATALOG))
    (path / "config.toml").write_text(f'''model = "muse"
model_provider = "musegl"
model_catalog_json = "{path / 'catalog.json'}"

[model_providers.musegl]
name = "musegl"
base_url = "{url}/v1"
wire_api = "responses"
requires_openai_auth = false
request_max_retries = 0
stream_max_retries = 0
''')
    return path


def run_codex(codex, server, tmp_path, prompt: str) -> list[dict]:
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "CODEX_HOME": str(codex_home(tmp_path / "home", server.url)), "HOME": str(tmp_path)}
    done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", "--json",
                           prompt], cwd=work, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert events[-1]["type"] == "turn.completed", events[-3:]
    usage = events[-1]["usage"]
    # two requests: turn 2 resends turn 1 and reuses it from the prompt_cache_key session
    assert usage["cached_input_tokens"] >= 0.45 * usage["input_tokens"], usage
    return events


def test_codex_creates_a_file_through_exec_command(codex, server, tmp_path):
    events = run_codex(codex, server, tmp_path, "create hello.txt containing hello")
    assert (tmp_path / "work" / "hello.txt").read_text() == "hello\n"
    kinds = [e["item"]["type"] for e in events if e["type"] == "item.completed"]
    assert "command_execution" in kinds and kinds[-1] == "agent_message"


def test_codex_creates_a_file_through_the_freeform_apply_patch(codex, server, tmp_path):
    events = run_codex(codex, server, tmp_path, "create patched.txt containing patched")
    assert (tmp_path / "work" / "patched.txt").read_text() == "patched\n"
    kinds = [e["item"]["type"] for e in events if e["type"] == "item.completed"]
    assert "file_change" in kinds and kinds[-1] == "agent_message"
