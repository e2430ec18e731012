"""What one committed id adds to its request's output: the per-token text pipeline.

:func:`push_token` appends the id to the sequence and runs it through the
detokenizer and the stop matcher: end ids and ``stop_token_ids`` add no text,
stop strings count only after the first ``min_tokens`` ids (vLLM's rule), and
at the end held bytes and held stop prefixes are released. The ids whose text
is still held back wait in ``seq.unreported`` until a later id completes some
text. The engine emits the result's event and ends the sequence when it says so.
"""

from __future__ import annotations

from collections.abc import Collection

import attrs

from musegl_core.engine import events as ev
from musegl_core.engine.executor import TokenLogprobs
from musegl_core.engine.request import SequenceState


@attrs.frozen
class TokenOutput:
    """``event``: the text completed so far with its ids (None: all held back);
    ``finish``: ``stop`` or ``length`` when the id ended the sequence, with the
    stop string it matched (a stop token's text counts as one)."""

    event: ev.Tokens | None = None
    finish: str | None = None
    matched_stop: str | None = None


def push_token(seq: SequenceState, token: int, logprobs: TokenLogprobs | None, end_ids: Collection[int],
               tokenizer) -> TokenOutput:
    """Commit ``token`` to ``seq`` (generated ids, fed tokens, cache keys) and say what it emits."""
    request = seq.request
    seq.generated.append(token)
    seq.tokens.append(token)
    seq.keys.append(token)
    eos = token in end_ids and not request.ignore_eos
    stop_token = token in request.stop_token_ids  # masked before min_tokens
    piece = "" if eos or stop_token else seq.detokenizer.push(token)
    seq.chars.append(len(piece))
    # stop strings apply to the text of ids after the first min_tokens (vLLM's rule)
    checked = len(seq.generated) > request.min_tokens
    text, matched = seq.stops.push(piece) if checked else (piece, None)
    at_end = eos or stop_token or len(seq.generated) >= seq.max_new
    if matched is None and at_end:
        # End of generation: release held bytes and held stop prefixes.
        tail = seq.detokenizer.flush()
        if checked:
            tail, matched = seq.stops.push(tail)
        text += tail
        if matched is None and checked:
            text += seq.stops.flush()
            matched = seq.stops.matched
        if matched is None and stop_token:  # like a stop string: its text is not part of the answer
            matched = tokenizer.token_bytes(token).decode("utf-8", "replace")
    seq.unreported.append(token)
    if logprobs is not None:
        seq.unreported_logprobs.append(logprobs)
    event = None
    if text:
        event = ev.Tokens(seq.id, tuple(seq.unreported), text, tuple(seq.unreported_logprobs))
        seq.unreported.clear()
        seq.unreported_logprobs.clear()
    if matched is not None:
        return TokenOutput(event, "stop", matched)
    if eos:
        return TokenOutput(event, "stop", None)
    if at_end:
        return TokenOutput(event, "length", None)
    return TokenOutput(event)
