"""Preparing one request for the engine: what the worker's preparation threads
(:mod:`musegl_core.worker.preparation`) run for every generation request, and
what ``musegl generate`` and ``musegl render`` run in-process.

:func:`prepare` turns a :class:`GenerateRequest` (prompt segments, images,
sampling, constraints) into the :class:`PreparedRequest` the engine admits:
the prompt's token ids, the placed images, a fixed seed and the logits
processors; bad input is an :class:`ApiError` (400) for that request alone.
"""

from __future__ import annotations

import attrs

from musegl_core.engine.errors import ContextTooLong
from musegl_core.engine.randomness import random_seed
from musegl_core.engine.request import GenerateRequest, PreparedRequest
from musegl_core.errors import ApiError
from musegl_core.tokenizer import TokenBudgetExceeded
from musegl_core.vision.preprocess import ImagePreprocessor, place_images

__all__ = ["prepare", "prompt_too_long"]


def prepare(request: GenerateRequest, tokenizer, vocab_size: int = 0,
            vision: ImagePreprocessor | None = None, *, max_context: int | None = None) -> PreparedRequest:
    """Prepare a request once, on a preparation thread (:mod:`musegl_core.worker.preparation`):
    tokenize the prompt segments, check the ids, decode and place its images
    (``vision`` None: the model sees no images, so an image is a 400), fix the
    seed (a random one when none was given, so every draw is keyed by seed and
    position), compile the output constraint against the served vocabulary
    (``vocab_size``: the model's, when larger than the tokenizer's).

    Cheap checks come first. With ``max_context`` a prompt that cannot fit is
    refused from its length alone (:meth:`MuseTokenizer.token_count_floor`),
    then as soon as tokenizing it has counted too many ids; images are checked
    from their headers against the decode budget before the prompt is
    tokenized and before any is decoded."""
    budget = reservation = None
    if max_context is not None:
        reservation = request.completion_reservation
        budget = max(max_context - reservation, 0)
        floor = tokenizer.token_count_floor(request.prompt)
        if floor > budget:
            raise prompt_too_long(floor, reservation, max_context)
    admitted = vision.admit(request.images) if request.images and vision is not None else None
    try:
        ids = tokenizer.encode_segments(request.prompt, add_bos=request.add_bos, limit=budget)
    except TokenBudgetExceeded as exc:
        raise prompt_too_long(exc.at_least, reservation, max_context) from None
    except Exception as exc:  # TokenizationError (a tokenizer panic included) and anything else it raises
        raise ApiError(400, f"could not tokenize the prompt: {exc}", "invalid_request_error") from exc
    if not ids:
        raise ApiError(400, "the prompt is empty", "invalid_request_error", param="messages")
    vocab = tokenizer.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:  # (min/max: C loops; a 32k-id prompt costs 0.3 ms, not 2)
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "invalid_request_error")
    ids, images = place_images(ids, request.images, tokenizer, vision, admitted)
    sampling = request.sampling
    limit = max(vocab, vocab_size)
    for token, _ in sampling.logit_bias:
        if not 0 <= token < limit:
            raise ApiError(400, f"logit_bias names token {token}, outside the vocabulary [0, {limit})",
                           "invalid_request_error", param="logit_bias")
    if sampling.seed is None:
        sampling = attrs.evolve(sampling, seed=random_seed())
    processors = ()
    if request.grammar is not None:
        from musegl_core.constrain.matcher import compile_grammar

        processors = (compile_grammar(request.grammar, tokenizer, vocab_size),)
    elif request.lazy_grammar is not None:
        from musegl_core.constrain.matcher import compile_lazy

        processors = (compile_lazy(request.lazy_grammar, tokenizer, vocab_size),)
    for index, token in enumerate(request.stop_token_ids):
        if not 0 <= token < limit:
            raise ApiError(400, f"stop_token_ids names token {token}, outside the vocabulary [0, {limit})",
                           "invalid_request_error", param=f"stop_token_ids[{index}]")
    if request.min_tokens > 0:
        from musegl_core.engine.min_tokens import MinTokensProcessor

        ends = () if request.ignore_eos else tokenizer.end_of_generation_ids
        processors += (MinTokensProcessor(request.min_tokens, (*ends, *request.stop_token_ids), limit),)
    return PreparedRequest.of(
        request,
        prompt_ids=tuple(ids),
        sampling=sampling,
        processors=processors,
        images=images,
    )


def prompt_too_long(at_least: int, reservation: int, max_context: int) -> ApiError:
    """400 ``context_length_exceeded`` for a prompt found too long before it was
    fully tokenized: ``at_least`` is a lower bound of its token count (the
    metadata says so: ``prompt_tokens_exact`` false). Written by the front's table
    (:mod:`musegl_core.worker.errors`), as the engine's own refusal is."""
    from musegl_core.worker.errors import api_error

    return api_error(ContextTooLong(at_least, reservation, max_context, exact=False))
