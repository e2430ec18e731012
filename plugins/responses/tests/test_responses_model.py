"""The Responses surface on the real tiny demo model: logprobs, and a
``previous_response_id`` turn that is greedy-identical to the full history."""

from __future__ import annotations

import openai
import pytest

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server


@pytest.fixture(scope="module")
def client():
    from musegl_core.tiny import default_model_path

    config = ServeConfig(model=str(default_model_path()), port=0, max_context=1024, max_sessions=4,
                         max_inflight_requests=2, max_decode_sequences=2)
    with running_server(config) as running:
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0,
                            _strict_response_validation=True)


GREEDY = {"temperature": 0, "max_output_tokens": 12}


def echo(output) -> list[dict]:
    """The output items as a client resends them (assistant items without id and status)."""
    items = []
    for item in output:
        if item.type == "reasoning":
            items.append({"type": "reasoning", "summary": [], "encrypted_content": item.encrypted_content})
        elif item.type == "message":
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": item.content[0].text}]})
    return items


def test_output_logprobs_are_included_when_asked_for(client):
    response = client.responses.create(model="m", input="Say something.", store=False, top_logprobs=2,
                                       include=["message.output_text.logprobs"], **GREEDY)
    messages = [item for item in response.output if item.type == "message"]
    for message in messages:
        part = message.content[0]
        assert "".join(entry.token for entry in part.logprobs) == part.text
        assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert messages or response.status == "incomplete"
    plain = client.responses.create(model="m", input="Say something.", store=False, **GREEDY)
    assert all(not item.content[0].logprobs for item in plain.output if item.type == "message")


def test_previous_response_id_is_greedy_identical_to_the_full_history_and_prefills_only_the_new_input(client):
    """A ``previous_response_id`` turn and the same conversation resent in full
    (Codex's way, in its ``prompt_cache_key`` session) render the same prompt,
    reuse the same KV and generate the same output."""
    story = [{"role": "user", "content": "Tell me a story."}]
    follow = [{"role": "user", "content": "And then?"}]
    first = client.responses.create(model="m", input=story, include=["reasoning.encrypted_content"], **GREEDY)
    chained = client.responses.create(model="m", previous_response_id=first.id, input=follow, **GREEDY)
    twin = client.responses.create(model="m", input=story, include=["reasoning.encrypted_content"], store=False,
                                   prompt_cache_key="twin", **GREEDY)
    assert twin.output_text == first.output_text
    full = client.responses.create(model="m", input=[*story, *echo(twin.output), *follow], store=False,
                                   prompt_cache_key="twin", **GREEDY)
    assert chained.usage.input_tokens == full.usage.input_tokens
    assert [i.model_dump(exclude={"id"}) for i in chained.output] == [i.model_dump(exclude={"id"}) for i in full.output]
    # both ran in the session of their first turn: only the new input was prefilled
    for turn_two, turn_one in ((chained, first), (full, twin)):
        cached = turn_two.usage.input_tokens_details.cached_tokens
        assert cached >= turn_one.usage.input_tokens + turn_one.usage.output_tokens - 1
