"""Start-up options of the cuda plugin: `--load-format dummy` serving a bare config.json end to end
(random weights, demo tokenizer), and the cuBLAS workspace default."""

from __future__ import annotations

import json

import attrs
import httpx
import pytest

from musegl_core.cli.serve import prepare
from musegl_core.errors import ConfigError
from musegl_core.model_tokenizer import load_tokenizer
from musegl_core.testing.server import running_server

# A small shape with the real vocabulary: the demo tokenizer needs the Muse special ids (200000+).
CONFIG = {
    "model_type": "muse_glimmer_text", "vocab_size": 202048, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "sliding_window": 8, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


@pytest.fixture()
def bare_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def serve_args(model, *extra: str) -> list[str]:
    return [str(model), "--executor", "torch-cpu", "--port", "0", "--max-sessions", "4", "--max-context", "256",
            *extra]


def test_a_bare_config_gets_the_demo_tokenizer_only_without_weights(bare_config):
    tokenizer = load_tokenizer(bare_config)
    assert tokenizer.vocab_size == CONFIG["vocab_size"]
    assert tokenizer.token_id("<|eot|>") is not None
    assert load_tokenizer(bare_config / "config.json").vocab_size == CONFIG["vocab_size"]
    (bare_config / "model.safetensors").write_bytes(b"")
    with pytest.raises(Exception, match="tokenizer.json"):
        load_tokenizer(bare_config)  # weights without a tokenizer: a broken checkpoint, not a dummy one


def test_the_serve_check_needs_weights_unless_dummy(bare_config):
    with pytest.raises(ConfigError, match="cannot serve"):
        prepare(serve_args(bare_config))
    config, _plugins, _level = prepare(serve_args(bare_config, "--load-format", "dummy"))
    assert config.extra["load_format"] == "dummy"
    with pytest.raises(ConfigError, match="--load-format"):
        prepare(serve_args(bare_config, "--load-format", "random"))


def test_serving_a_bare_config_end_to_end_repeats(bare_config):
    config, _plugins, _level = prepare(serve_args(bare_config / "config.json", "--load-format", "dummy"))
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "temperature": 0}
    answers = []
    for _ in range(2):  # two worker starts: the seeded random weights are the same
        with running_server(attrs.evolve(config, port=0)) as server:
            reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            data = reply.json()
            assert data["usage"]["completion_tokens"] >= 1
            answers.append(data["choices"][0]["message"])
    assert answers[0] == answers[1]


def test_cuda_uses_no_cublas_workspace_unless_the_user_chose_one(monkeypatch):
    from musegl_cuda import executor

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    executor.unsplit_cublas_products()
    assert executor.os.environ["CUBLAS_WORKSPACE_CONFIG"] == executor.CUBLAS_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    executor.unsplit_cublas_products()
    assert executor.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
