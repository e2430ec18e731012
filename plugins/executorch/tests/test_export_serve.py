"""``musegl export`` of a tiny random checkpoint, then the program served through the
``executorch`` executor: greedy output token-identical to the eager torch executor
(float32) through ``musegl generate`` and through the HTTP API with sessions and
batched decode; the one-line errors (exit status 2)."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from musegl_core.cli.main import main
from musegl_core.config import ServeConfig
from musegl_core.tiny import TinyPreset, make_tiny
from musegl_core.testing.server import running_server

#: Two layers (one sliding with an 8-key window, one full) and a 1024-position native
#: context: small enough that the export (two methods) stays well under a minute.
PRESET = TinyPreset(name="et", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, sliding_window=8, max_position_embeddings=1024)
HISTORY = [{"role": "system", "content": "S."}, {"role": "user", "content": "tell me " * 20}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("et_ckpt"), preset=PRESET, file_type="f32")


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("et_export")
    status = main(["export", str(checkpoint), "-o", str(out), "--forward-sizes", "4", "--max-prefill-chunk", "32",
                   "--max-cells", "4096", "--max-seq-len", "99", "--overwrite"])
    assert status == 0
    return out


@pytest.mark.slow  # needs the export (over a minute on two cores): the slow tier
def test_the_export_directory_holds_program_weights_manifest_and_tokenizer(exported):
    manifest = json.loads((exported / "musegl-export.json").read_text())
    assert manifest["abi"] == "musegl-offgraph-kv/1" and manifest["format"] == "musegl-executorch"
    assert manifest["methods"] == ["forward_4", "forward_others"]
    assert manifest["limits"] == {"native_context": 1024, "max_prefill_chunk": 32, "max_cells": 4096,
                                  "forward_sizes": [4], "min_head_rows": 0}
    assert manifest["config"]["num_layers"] == 2 and manifest["activation_dtype"] == "float32"
    # the weights live in the .ptd (once, whatever the number of methods), the program in the .pte
    ptd, pte = (exported / "model.ptd").stat().st_size, (exported / "model.pte").stat().st_size
    embedding = PRESET.vocab_size * PRESET.hidden_size * 4
    assert 2 * embedding <= ptd < 3 * embedding and pte < embedding / 4
    assert (exported / "tokenizer.json").is_file()


def generate(capsys, *args) -> dict:
    assert main(["generate", "--json", "--ignore-eos", "--max-tokens", "24", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow  # needs the export (over a minute on two cores): the slow tier
def test_generate_is_token_identical_to_the_torch_executor(exported, checkpoint, capsys):
    prompt = ",".join(str(i) for i in range(1000, 1040))  # 40 positions: two prefill calls, past the window
    mine = generate(capsys, "--model", str(exported), "--token-ids", prompt)
    theirs = generate(capsys, "--model", str(checkpoint), "--executor", "torch-cpu", "--token-ids", prompt)
    assert mine["backend"] == "executorch-xnnpack" and theirs["backend"] == "torch-cpu"
    assert mine["token_ids"] == theirs["token_ids"]
    pte = generate(capsys, "--model", str(exported / "model.pte"), "--token-ids", prompt)  # the .pte itself
    assert pte["token_ids"] == theirs["token_ids"]


def chat(url, messages, **extra):
    body = {"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def conversation(url) -> list:
    """A session extended twice, then three requests at once (one decode batch)."""
    first = chat(url, HISTORY, session_id="s")
    longer = HISTORY + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "and more"}]
    second = chat(url, longer, session_id="s")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    prompts = [[{"role": "user", "content": word * n}] for word, n in (("a ", 3), ("bc ", 9), ("def ", 17))]

    async def together():
        async with httpx.AsyncClient(timeout=300) as client:
            replies = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json={
                "model": "m", "messages": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
                for p in prompts))
        return [r.json()["choices"][0]["message"]["content"] for r in replies]

    return [first["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"],
            *asyncio.run(together())]


@pytest.mark.slow  # needs the export (over a minute on two cores): the slow tier
def test_http_sessions_and_batched_decode_match_the_torch_executor(exported, checkpoint):
    limits = dict(port=0, max_context=256, max_sessions=4, max_inflight_requests=4, max_decode_sequences=4)
    with running_server(ServeConfig(model=str(exported), **limits)) as server:
        assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 200
        mine = conversation(server.url)
    with running_server(ServeConfig(model=str(checkpoint), executor="torch-cpu", **limits)) as server:
        theirs = conversation(server.url)
    assert mine == theirs
    assert all(mine)


@pytest.mark.slow  # needs the export (over a minute on two cores): the slow tier
def test_max_context_beyond_the_native_context_is_one_line_exit_2(exported, capsys):
    assert main(["serve", str(exported), "--max-context", "2048"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "beyond the exported native context 1024" in err


@pytest.mark.slow  # needs the export (over a minute on two cores): the slow tier
def test_an_artifact_without_the_offgraph_abi_is_refused(exported, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(exported / "model.pte", bare / "model.pte")
    assert main(["serve", str(bare / "model.pte"), "--max-context", "256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "off-graph KV ABI" in err
    other = tmp_path / "other"
    shutil.copytree(exported, other)
    manifest = json.loads((other / "musegl-export.json").read_text())
    (other / "musegl-export.json").write_text(json.dumps({**manifest, "abi": "in-graph-kv"}))
    assert main(["serve", str(other), "--max-context", "256"]) == 2
    assert "exported without the off-graph KV ABI" in capsys.readouterr().err


def test_unsupported_export_settings_are_one_line_exit_2(checkpoint, tmp_path, capsys):
    for flags, message in ((["--max-prefill-chunk", "2048"], "exceeds the native context 1024"),
                           (["--forward-sizes", "64", "--max-cells", "512"], "need at least 1024 --max-cells"),
                           (["--forward-sizes", "0"], "--forward-sizes must list widths")):
        assert main(["export", str(checkpoint), "-o", str(tmp_path / "x"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


@pytest.mark.slow  # needs the export (over a minute on two cores): the slow tier
def test_max_seq_len_warns_before_loading_and_a_used_directory_is_kept(checkpoint, exported, capsys):
    assert main(["export", str(checkpoint), "-o", str(exported), "--max-seq-len", "99"]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning == ("musegl export: warning: --max-seq-len 99 is ignored; the export uses the "
                       "checkpoint's native context")
    assert error.startswith("musegl export: error:") and "--overwrite" in error
