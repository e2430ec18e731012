"""The request rules every API surface shares, whatever its wire format.

Each function checks one parameter (or a group that belongs together) and
returns what the worker request takes, or raises a 400
(:class:`~musegl_core.errors.ApiError`) that names the parameter: the
completion limit, the sampling parameters with ``logit_bias``, stop strings,
the number of choices, the session named by the body or ``X-Session-Id``,
``cache_salt`` and ``prompt_cache_key``. A surface whose parameter is spelled
otherwise passes its own value (Anthropic's ``stop_sequences`` to
:func:`stop_strings`); request objects are read by attribute
(``temperature``, ``top_p``, ``top_k`` and ``seed`` must be there, ``None``
meaning unset; the penalties, ``min_p`` and ``logit_bias`` may be absent).
"""

from __future__ import annotations

import re
from typing import Any

from musegl_core.config import ServeConfig
from musegl_core.engine.executor import SamplingParams
from musegl_core.errors import bad_request
from musegl_core.service.sessions import MAX_CLIENT_KEY

MAX_STOPS = 4
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SEED_RANGE = (-(2**63), 2**64 - 1)
#: ``cache_salt``: the longest salt accepted (characters)
MAX_CACHE_SALT = 256


def choice_count(n: int | None, config: ServeConfig, session: str | None) -> int:
    """``n``: 1..``--max-n``; above 1 it must fit the server at all (each
    choice is a request of its own: it takes an admission slot and a session
    slot) and may not name a session (a session holds one transcript, which
    n answers cannot all extend). docs/protocol.md 2.6."""
    if n is None:
        return 1
    if not 1 <= n <= config.max_n:
        raise bad_request(f"'n' must be between 1 and {config.max_n} (--max-n), got {n}", param="n")
    if n > 1:
        if session is not None:
            raise bad_request(
                "'n' above 1 cannot be used with a named session (session_id / X-Session-Id): a session holds "
                "one transcript, and n answers cannot all extend it; send n > 1 without a session",
                param="n",
            )
        fits = min(config.max_inflight_requests, config.max_sessions)
        if n > fits:
            raise bad_request(
                f"'n' = {n} choices can never run at once on this server: each choice takes an admission slot "
                f"(--max-inflight-requests {config.max_inflight_requests}) and a session slot "
                f"(--max-sessions {config.max_sessions}); the most is {fits}",
                param="n",
            )
    return n


def completion_limit(request: Any) -> int | None:
    """``max_completion_tokens`` or its deprecated twin ``max_tokens``; both must
    be positive and agree when both are given. ``None`` leaves the limit to the
    context budget."""
    limit = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(request, name, None)  # /v1/completions has only max_tokens
        if value is None:
            continue
        if value < 1:
            raise bad_request(f"'{name}' must be a positive integer, got {value}", param=name)
        if limit is not None and value != limit:
            raise bad_request(
                f"'max_tokens' ({value}) and 'max_completion_tokens' ({limit}) disagree; send one",
                param=name,
            )
        limit = value
    return limit


def sampling_params(request: Any) -> SamplingParams:
    """temperature in [0, 2], top_p in (0, 1], top_k >= 0, a 64-bit seed, and
    the processors of docs/constrained.md: ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2], ``repetition_penalty`` > 0, ``min_p`` in
    [0, 1], ``logit_bias`` (at most 300 token ids, each biased by -100..100).
    Out of range is a 400 naming the parameter."""
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    top_k = 0 if request.top_k is None else request.top_k
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"'temperature' must be between 0 and 2, got {temperature}", param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    if top_k < 0:
        raise bad_request(f"'top_k' must be 0 (off) or positive, got {top_k}", param="top_k")
    seed = request.seed
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise bad_request("'seed' must fit in 64 bits", param="seed")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name, None)
        if value is not None:
            if not -2.0 <= value <= 2.0:
                raise bad_request(f"'{name}' must be between -2 and 2, got {value}", param=name)
            penalties[name] = float(value)
    repetition = getattr(request, "repetition_penalty", None)
    if repetition is not None:
        if not 0.0 < repetition <= 1e6 or repetition != repetition:
            raise bad_request(f"'repetition_penalty' must be greater than 0, got {repetition}",
                              param="repetition_penalty")
        penalties["repetition_penalty"] = float(repetition)
    min_p = getattr(request, "min_p", None)
    if min_p is not None:
        if not 0.0 <= min_p <= 1.0:
            raise bad_request(f"'min_p' must be between 0 and 1, got {min_p}", param="min_p")
        penalties["min_p"] = float(min_p)
    return SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=seed,
                          logit_bias=logit_bias(getattr(request, "logit_bias", None)), **penalties)


MAX_LOGIT_BIAS = 300


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token id (a decimal string) -> bias in [-100, 100],
    at most 300 entries; sorted by id. The worker checks the ids against the vocabulary."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
                          param="logit_bias")
    out = []
    for key, value in bias.items():
        if not key.isdigit() or len(key) > 9:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"'logit_bias' values must be between -100 and 100, got {value} for {key}",
                              param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """A string or up to four non-empty strings."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    for i, text in enumerate(stops):
        if not text:
            raise bad_request("stop strings must not be empty", param="stop" if isinstance(stop, str) else f"stop[{i}]")
    return tuple(dict.fromkeys(stops))


def session_id(body: str | None, header: str | None) -> str | None:
    """The session named by ``session_id`` or ``X-Session-Id``."""
    for value, param in ((body, "session_id"), (header, "X-Session-Id")):
        if value is not None and not SESSION_ID.fullmatch(value):
            raise bad_request(
                f"'{param}' must be 1-128 characters of A-Z a-z 0-9 . _ : -", param=param
            )
    if body is not None and header is not None and body != header:
        raise bad_request("the body's session_id and the X-Session-Id header differ", param="session_id")
    return body if body is not None else header


def prompt_cache_key(value: str | None) -> str | None:
    """``prompt_cache_key``: a non-empty string of at most :data:`MAX_CLIENT_KEY` characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_CLIENT_KEY:
        raise bad_request(f"'prompt_cache_key' must be a string of 1-{MAX_CLIENT_KEY} characters",
                          param="prompt_cache_key")
    return value


def cache_salt(value: str | None) -> str | None:
    """``cache_salt``: a non-empty string of at most :data:`~musegl_core.openai.schemaMAX_CACHE_SALT`
    characters (any characters: it is hashed, never shown)."""
    if value is not None and not 1 <= len(value) <= MAX_CACHE_SALT:
        raise bad_request(f"'cache_salt' must be a string of 1-{MAX_CACHE_SALT} characters, got {len(value)}",
                          param="cache_salt")
    return value
