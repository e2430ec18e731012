"""llama.cpp's ``test_logprobs`` / ``test_logprobs_stream`` (tools/server/tests/unit/test_chat_completion.py)
against musegl, and the case that failed it (issue 49 item 6): an answer cut by ``max_tokens`` inside a
multi-byte character. Its ``content`` ends with U+FFFD, and so does the aggregated text of its
``logprobs.content[].token`` entries, streamed (in the chunks before the finish chunk, where llama.cpp's test
reads them) and not."""

from __future__ import annotations

import pytest
from openai import OpenAI

from musegl_core.config import ServeConfig
from musegl_core.testing.server import running_server
from musegl_core.tiny import default_model_path

MESSAGES = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def client():
    config = ServeConfig(model=str(default_model_path()), port=0, max_context=1024, max_sessions=2)
    with running_server(config) as server:
        with OpenAI(api_key="dummy", base_url=f"{server.url}/v1") as sdk:
            yield sdk


@pytest.fixture(scope="module")
def first_byte_of_a_four_byte_character() -> dict[str, int]:
    from musegl_core.tokenizer import MuseTokenizer

    tokenizer = MuseTokenizer.load(str(default_model_path()))
    (lead,) = [i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == b"\xf0"]
    return {str(lead): 100}  # every id drawn is this lead byte: each next one proves the last incomplete


def streamed(client, **extra) -> tuple[str, str]:
    """llama.cpp's test_logprobs_stream loop: content and token texts of the chunks before the finish."""
    output_text = aggregated_text = ""
    for data in client.chat.completions.create(model="m", temperature=0.0, messages=MESSAGES, max_tokens=5,
                                               logprobs=True, top_logprobs=10, stream=True, **extra):
        choice = data.choices[0]
        if choice.finish_reason is None:
            if choice.delta.content:
                output_text += choice.delta.content
            assert choice.logprobs is not None
            assert choice.logprobs.content is not None
            for token in choice.logprobs.content:
                aggregated_text += token.token
                assert token.logprob <= 0.0
                assert token.bytes is not None
                assert token.top_logprobs is not None and len(token.top_logprobs) > 0
    return output_text, aggregated_text


def whole(client, **extra) -> tuple[str, str]:
    """llama.cpp's test_logprobs: the message's content and its token texts."""
    res = client.chat.completions.create(model="m", temperature=0.0, messages=MESSAGES, max_tokens=5,
                                         logprobs=True, top_logprobs=10, **extra)
    tokens = res.choices[0].logprobs.content
    assert all(t.logprob <= 0.0 and t.bytes is not None and len(t.top_logprobs) > 0 for t in tokens)
    return res.choices[0].message.content or "", "".join(t.token for t in tokens)


def test_llama_cpp_logprobs_tests(client):
    output, aggregated = streamed(client)
    assert aggregated == output
    content, tokens = whole(client)
    assert tokens == content


def test_an_answer_cut_inside_a_character_ends_in_u_fffd_in_content_and_in_its_logprobs(
        client, first_byte_of_a_four_byte_character):
    bias = {"logit_bias": first_byte_of_a_four_byte_character}
    output, aggregated = streamed(client, **bias)
    assert output == aggregated == "\ufffd" * 5  # the fifth: the character max_tokens cut
    assert whole(client, **bias) == (output, output)
