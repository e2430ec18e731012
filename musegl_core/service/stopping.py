"""vLLM's ``stop_token_ids`` and ``min_tokens`` on both generation routes.

* ``stop_token_ids``: generation ends when one of these ids is drawn
  (``finish_reason: "stop"``); like a stop string, the id's text is not part
  of the answer, and it is counted in ``completion_tokens``. At most
  :data:`MAX_STOP_TOKEN_IDS` ids, each a token id (the worker checks them
  against the vocabulary). They apply with ``ignore_eos`` too.
* ``min_tokens``: until this many ids were generated, the end-of-generation
  ids (unless ``ignore_eos``) and the ``stop_token_ids`` are masked, and stop
  strings are applied only to the text of later ids (a stop string that lies
  wholly in the first ``min_tokens`` ids' text does not end generation), as
  in vLLM. It must not exceed ``max_tokens``. With a whole-output constraint
  (``response_format``, ``json_schema``, ``tool_choice`` ``"required"`` or a
  function) it is refused: the grammar decides where that output ends.

See docs/protocol.md 1.1 and the engine (``musegl_core/engine/min_tokens.py``).
"""

from __future__ import annotations

from musegl_core.errors import bad_request

MAX_STOP_TOKEN_IDS = 256


def stop_token_ids(ids: list[int] | None) -> tuple[int, ...]:
    """The request's ``stop_token_ids``, checked (duplicates dropped)."""
    if not ids:
        return ()
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                          param="stop_token_ids")
    for index, token in enumerate(ids):
        if token < 0:
            raise bad_request(f"'stop_token_ids' must hold token ids (0 or more), got {token}",
                              param=f"stop_token_ids[{index}]")
    return tuple(dict.fromkeys(ids))


def min_tokens(value: int | None, max_tokens: int | None, *, constrained: bool = False) -> int:
    """The request's ``min_tokens`` (0 when absent), checked against ``max_tokens``."""
    if value is None or value == 0:
        return 0
    if value < 0:
        raise bad_request(f"'min_tokens' must be 0 or more, got {value}", param="min_tokens")
    if max_tokens is not None and value > max_tokens:
        raise bad_request(f"'min_tokens' ({value}) exceeds the token limit ({max_tokens})", param="min_tokens")
    if constrained:
        raise bad_request("'min_tokens' cannot be combined with an output constraint (response_format, "
                          "json_schema, tool_choice \"required\" or a function): the grammar decides where that "
                          "output ends", code="unsupported_parameter", param="min_tokens")
    return value
