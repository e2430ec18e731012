"""Grammar processors: llguidance matchers as the engine's ``LogitsProcessor``.

:func:`compile_grammar` runs on the worker's control thread (``prepare``): it
builds the matcher of one request against the served vocabulary (the
llguidance tokenizer is built once per worker from the checkpoint's
``tokenizer.json``). :class:`GrammarProcessor` then runs on the engine thread:
``mask(generated)`` brings the matcher to ``generated`` (consuming new ids,
rolling back ids that were replaced, e.g. rejected drafts) and returns the
allowed-token bitmask of the next token, padded to the model's vocabulary.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from musegl_core.constrain.failure import failure_reason
from musegl_core.errors import ApiError

_lock = threading.Lock()
_tokenizers: dict[int, Any] = {}


def ll_tokenizer(tokenizer) -> Any:
    """The llguidance tokenizer of a :class:`~musegl_core.tokenizer.MuseTokenizer`
    (built once, ~2 s for a 200k vocabulary; cached per tokenizer object)."""
    import llguidance

    key = id(tokenizer)
    with _lock:
        found = _tokenizers.get(key)
        if found is None:
            found = llguidance.LLTokenizer(
                tokenizer.to_tokenizer_json(),
                n_vocab=tokenizer.vocab_size,
                eos_token=list(tokenizer.end_of_generation_ids),
            )
            _tokenizers[key] = (tokenizer, found)  # keep the key object alive
            return found
        return found[1]


class GrammarProcessor:
    """One request's grammar: the allowed ids of the next token.

    Once the grammar is complete (it accepted its final ``<|eot|>``), ``mask``
    returns None: generation past the end (only with ``ignore_eos``) is
    unconstrained, never an all-zero mask.

    The matcher never leaves an error state, so ids it refuses are not fed to
    it: a draft the grammar does not allow (the verify rows of speculative
    decoding ask for masks after hypothetical drafts) ends the consumed
    prefix there, and the row's mask is that of the last allowed position
    (the row is discarded with the draft). A matcher that fails on ids it
    allowed — llguidance ran out of its per-token budgets (``LexerTooComplex``,
    ``ParserTooComplex``) or found no allowed token — sets :attr:`failure`;
    the engine then ends the request with that error
    (``constraint_failed``) before it emits another token: the constraint is
    never dropped silently.
    """

    def __init__(self, matcher: Any, words: int):
        self.matcher = matcher
        self.words = words
        self.ids: list[int] = []  # what the matcher has consumed
        self.mask_seconds = 0.0  # time spent in mask() (the benchmark reads it)
        self.masks = 0
        #: why the matcher failed on allowed ids (the engine fails the request), else None
        self.failure: str | None = None

    def mask(self, generated: Sequence[int]) -> Any:
        import time

        started = time.perf_counter()
        try:
            return self._mask(generated)
        finally:
            self.mask_seconds += time.perf_counter() - started
            self.masks += 1

    def _mask(self, generated: Sequence[int]) -> Any:
        matcher, ids = self.matcher, self.ids
        common = min(len(ids), len(generated))
        while common and ids[common - 1] != generated[common - 1]:
            common -= 1  # only the tail ever changes (drafts replaced)
        if common < len(ids):
            matcher.rollback(len(ids) - common)
            del ids[common:]
        new = [int(token) for token in generated[common:]]
        if new and not matcher.is_stopped() and not matcher.is_error():
            taken = matcher.try_consume_tokens(new)
            ids.extend(new[:taken])
        if matcher.is_error():
            self.failure = self.failure or failure_reason(matcher)
            return None
        if matcher.is_stopped():
            return None
        packed = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        if matcher.is_error():  # a budget ran out while computing the mask
            self.failure = self.failure or failure_reason(matcher)
            return None
        if len(packed) < self.words:
            packed = np.concatenate([packed, np.zeros(self.words - len(packed), dtype=np.uint32)])
        return packed[: self.words]


def _matcher(grammar: str, tokenizer) -> Any:
    """An llguidance matcher of ``grammar`` (Lark); one that does not compile is a 400."""
    import llguidance

    try:
        matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(grammar),
                                       log_level=0)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # a panic in llguidance (pyo3's PanicException is a BaseException)
        from musegl_core.constrain.grammar import panic_message

        raise ApiError(400, f"the output constraint cannot be compiled: {panic_message(exc)}",
                       "invalid_request_error", "invalid_constraint") from None
    if matcher.is_error():
        raise ApiError(400, f"the output constraint cannot be compiled: {matcher.get_error()}",
                       "invalid_request_error", "invalid_constraint")
    return matcher


def compile_grammar(grammar: str, tokenizer, vocab_size: int) -> GrammarProcessor:
    """The processor of ``grammar`` (llguidance Lark) for the served vocabulary;
    a grammar that does not compile is a 400."""
    return GrammarProcessor(_matcher(grammar, tokenizer), -(-max(vocab_size, tokenizer.vocab_size) // 32))


def compile_lazy(lazy: Any, tokenizer, vocab_size: int) -> Any:
    """The processor of a :class:`~musegl_core.engine.request.LazyGrammar`
    (:class:`~musegl_core.constrain.lazy.LazyCallProcessor`)."""
    from musegl_core.constrain.lazy import LazyCallProcessor

    return LazyCallProcessor(_matcher(lazy.in_tool_message, tokenizer), _matcher(lazy.in_visible_message, tokenizer),
                             lazy.trigger, tokenizer, ll_tokenizer(tokenizer),
                             -(-max(vocab_size, tokenizer.vocab_size) // 32))
