"""The MLX executor through the HTTP API (`musegl serve --executor mlx --dtype float32`):
greedy chat continuations equal transformers', sessions over several turns, batched
decode and seeded sampling reproducible alone and batched."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server
from musegl_core.testing.reference_models import build_tiny_model

VOCAB = 202048  # the real vocabulary, so the chat template's special tokens are real ids


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny decoder over the real vocabulary with the make-tiny tokenizer, as a Hugging
    Face directory and as its f32 GGUF twin."""
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.tiny import build_tiny_tokenizer

    model = build_tiny_model(seed=2, vocab_size=VOCAB, bos_token_id=200000, eos_token_id=200001)
    root = tmp_path_factory.mktemp("mlx_chat")
    hf, gguf_dir = root / "hf", root / "gguf"
    model.save_pretrained(hf)
    gguf_dir.mkdir()
    tokenizer = build_tiny_tokenizer()
    for folder in (hf, gguf_dir):
        (folder / "tokenizer.json").write_text(tokenizer.to_tokenizer_json(), encoding="utf-8")
    checkpoint = load_checkpoint(hf)
    write_text_gguf(gguf_dir / "model.gguf", checkpoint.config, dict(checkpoint.iter_weights()), None,
                    file_type="f32")
    return model, hf, gguf_dir / "model.gguf"


def serve(path, **extra):
    config = ServeConfig(model=str(path), port=0, executor="mlx", dtype="float32", max_context=512,
                         max_sessions=8, max_inflight_requests=8, max_decode_sequences=8, **extra)
    return running_server(config)


@pytest.fixture(scope="module")
def gguf_server(chat_model):
    with serve(chat_model[2]) as server:
        yield server


def body(text: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 32, "temperature": 0,
            "ignore_eos": True, **extra}


def post(server, payload: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(response: dict) -> str:
    message = response["choices"][0]["message"]
    return (message.get("reasoning_content") or "") + (message.get("content") or "")


#: Prompts tried in turn: the first whose reference continuation is plain text is compared. The
#: rendered prompt carries today's date, so the random model's continuation changes from day to
#: day, and on some days a prompt's continuation holds special tokens (their text is not shown).
QUESTIONS = ("Tell me about the sea.", "Name three colours.", "What is a river?", "Describe a quiet morning.",
             "Why is the sky blue?", "Count to five.")


def plain_reference(model, tokenizer) -> tuple[dict, list[int], str]:
    """The first of :data:`QUESTIONS` whose greedy reference continuation is plain text."""
    for question in QUESTIONS:
        payload = body(question)
        found = reference(model, payload, tokenizer)
        if found is not None:
            return (payload, *found)
    raise AssertionError(f"the reference emitted special tokens for every one of {QUESTIONS}")


def reference(model, payload: dict, tokenizer) -> tuple[list[int], str] | None:
    """The prompt ids musegl's front renders, and transformers' greedy continuation of
    them as text (None: the continuation holds special tokens)."""
    from musegl_core.cli.render import render_request
    from musegl_core.plugins.manager import PluginManager

    ids = list(render_request(json.dumps(payload), plugins=PluginManager(), tokenizer=tokenizer).ids)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=payload["max_tokens"], do_sample=False)
    generated = out[0, len(ids):].tolist()
    if not all(i < 200000 for i in generated):
        return None
    return ids, tokenizer.decode(generated)


def test_chat_continues_like_transformers(chat_model, gguf_server):
    """(The GGUF path; the executor tests cover the Hugging Face path at the step level.)"""
    from musegl_core.tokenizer import MuseTokenizer

    model, hf, _gguf = chat_model
    tokenizer = MuseTokenizer.load(hf)
    payload, ids, expected = plain_reference(model, tokenizer)
    result = post(gguf_server, payload)
    assert result["usage"]["prompt_tokens"] == len(ids)
    assert result["usage"]["completion_tokens"] == 32
    assert text_of(result) == expected


def conversation(server, session: str) -> list[tuple[str, int, int]]:
    """Four turns in one named session: (reply, cached tokens, prompt tokens) per turn."""
    messages = [{"role": "system", "content": "Be brief."}]
    turns = []
    for question in ["hello there", "and the mountains?", "one more thing", "bye"]:
        messages.append({"role": "user", "content": question})
        result = post(server, {**body("x", max_tokens=8), "messages": list(messages), "session_id": session})
        usage = result["usage"]
        turns.append((text_of(result), usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))
        messages.append({"role": "assistant", "content": result["choices"][0]["message"].get("content") or ""})
    return turns


def test_a_session_over_several_turns_matches_the_torch_executor(chat_model, gguf_server):
    """Every turn reuses the cached prefix (read from the paged blocks) and answers exactly
    as the reference torch executor does over the same conversation."""
    ours = conversation(gguf_server, "mlx-turns")
    for (_, cached, _), (_, _, previous_prompt) in zip(ours[1:], ours):
        assert cached >= previous_prompt - 1
    config = ServeConfig(model=str(chat_model[2]), port=0, executor="torch-cpu", dtype="float32", max_context=512,
                         max_sessions=8)
    with running_server(config) as torch_server:
        assert conversation(torch_server, "torch-turns") == ours


async def _together(server, payloads: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(timeout=300) as client:
        responses = await asyncio.gather(*[client.post(f"{server.url}/v1/chat/completions", json=p)
                                           for p in payloads])
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


def test_batched_decode_gives_each_request_its_own_continuation(gguf_server):
    payloads = [body(f"question number {i} " + "word " * (3 * i)) for i in range(4)]
    alone = [text_of(post(gguf_server, p)) for p in payloads]
    batched = [text_of(r) for r in asyncio.run(_together(gguf_server, payloads))]
    assert batched == alone
    assert len(set(alone)) > 1


def test_seeded_sampling_is_reproducible_alone_and_batched(gguf_server):
    seeded = body("roll the dice", temperature=1.0, top_p=0.95, seed=4321, max_tokens=16)
    alone = text_of(post(gguf_server, seeded))
    assert text_of(post(gguf_server, seeded)) == alone
    noise = body("noise " * 20, temperature=1.0, max_tokens=24)
    batched = asyncio.run(_together(gguf_server, [noise, seeded, {**noise, "seed": 5}]))
    assert text_of(batched[1]) == alone
    other = text_of(post(gguf_server, {**seeded, "seed": 4322}))
    assert other != alone
