"""The scripted executor plugin drives the real engine and HTTP stack."""

from __future__ import annotations

import httpx
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server, scripted_plugin_env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from musegl_core.tiny import default_model_path

    script = [
        {"when": "What is 2+2?", "reply": " to=self<|message|>Add them.<|eom|><|start|>assistant to=user<|message|>4<|eot|>"},
    ]
    with scripted_plugin_env(tmp_path_factory.mktemp("scripted"), script):
        config = ServeConfig(model=str(default_model_path()), port=0, executor="scripted", max_context=512)
        with running_server(config) as running:
            yield running


def test_reasoning_and_content_come_from_the_script(server):
    body = {"model": "m", "messages": [{"role": "user", "content": "What is 2+2?"}]}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    message = reply["choices"][0]["message"]
    assert message["content"] == "4"
    assert message["reasoning_content"] == "Add them."
    assert reply["choices"][0]["finish_reason"] == "stop"
