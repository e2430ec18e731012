"""``POST /tokenize`` and ``POST /detokenize`` with the served tokenizer.

``/tokenize`` takes either ``prompt`` (raw text, read exactly as
``/v1/completions`` reads it: special tokens written out become their ids, no
BOS added) or ``messages`` (rendered with the chat template exactly as a chat
request with the same ``tools``, ``tool_choice``, reasoning and
``chat_template_kwargs`` fields; the ids start with BOS, as the worker's do).
It answers ``{"tokens": [...], "count": N, "max_model_len": --max-context}``.
Images are refused: how many positions an image takes is decided by the
worker's vision preprocessing, not by the tokenizer.

``/detokenize`` takes ``tokens`` and answers ``{"prompt": text}`` with special
tokens written out.

Both run in the front, off the event loop, and need the tokenizer the front
loads at start-up; without it they answer 503. Long text is tokenized in
bounded pieces (:meth:`MuseTokenizer.encode_bounded`); a text the tokenizer
fails on is a 400 naming ``prompt`` or ``messages``.
"""

from __future__ import annotations

from typing import Any

from musegl_core.config import ServeConfig
from musegl_core.errors import bad_request, unavailable
from musegl_core.http.offload import off_loop
from musegl_core.openai import schemas as s
from musegl_core.openai.chat import plan_chat
from musegl_core.openai.completions import prompt_segment
from musegl_core.tokenizer import TokenizationError


def _need(tokenizer: Any) -> Any:
    if tokenizer is None:
        raise unavailable("the tokenizer is not loaded", code="model_loading")
    return tokenizer


async def tokenize(
    request: s.TokenizeRequest, *, tokenizer: Any, template: Any, tool_parser: Any, config: ServeConfig
) -> s.TokenizeResult:
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'", param="prompt")
    if request.prompt is not None:
        segments, add_bos = (prompt_segment(request.prompt),), False
    else:
        chat = s.ChatCompletionRequest(
            messages=request.messages,
            tools=request.tools,
            tool_choice=request.tool_choice,
            reasoning_effort=request.reasoning_effort,
            reasoning=request.reasoning,
            chat_template_kwargs=request.chat_template_kwargs,
        )
        plan = plan_chat(chat, request_id="tokenize", config=config, template=template, tool_parser=tool_parser)
        if plan.image_count:
            raise bad_request("/tokenize does not count images; send text only", code="unsupported_parameter",
                              param="messages")
        segments, add_bos = plan.generate.prompt, plan.generate.add_bos
    try:
        ids = await off_loop(_need(tokenizer).encode_segments, segments, add_bos=add_bos)  # (a lane: http/offload.py)
    except TokenizationError as exc:  # the tokenizer failed on this text (a Rust panic included)
        raise bad_request(f"could not tokenize the prompt: {exc}",
                          param="prompt" if request.prompt is not None else "messages") from None
    return s.TokenizeResult(tokens=ids, count=len(ids), max_model_len=config.max_context)


async def detokenize(request: s.DetokenizeRequest, *, tokenizer: Any) -> s.DetokenizeResult:
    tokenizer = _need(tokenizer)
    vocab = tokenizer.vocab_size
    for index, token_id in enumerate(request.tokens):
        if not 0 <= token_id < vocab:
            raise bad_request(f"token ids must be in [0, {vocab}), got {token_id}", param=f"tokens[{index}]")
    text = await off_loop(tokenizer.decode, request.tokens)
    return s.DetokenizeResult(prompt=text)
