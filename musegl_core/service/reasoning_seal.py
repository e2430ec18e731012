"""Sealed reasoning: a token that gives the server back the exact ids it generated.

Agent clients echo the previous turn's reasoning with the next request
(Anthropic's thinking block ``signature``, a Responses reasoning item's
``encrypted_content``). The text alone tokenizes differently from what the
model produced, so the session's KV would stop matching at the previous
assistant turn. A seal carries the generated ids of the reasoning messages
themselves, authenticated with HMAC-SHA256 under a secret the server draws
at start-up:

* :meth:`ReasoningSeal.seal` writes the token (URL-safe base64 of a version
  byte, a 128-bit MAC, a flag and the zlib-packed ids);
* :meth:`ReasoningSeal.open` returns the :class:`SealedReasoning` for a token
  it made (and only those: any other string, a token of another server
  process, a truncated or edited one gives None, and the caller renders the
  echoed text as plain reasoning instead; never an error);
* :func:`reasoning_block` finds, in one choice's generated ids, the span of
  the reasoning messages a surface just closed and checks that it decodes to
  exactly the text the client saw.

The prompt then renders a verified block as those ids
(:attr:`musegl_core.chat.messages.Message.reasoning_ids`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct
import zlib
from typing import Any, Sequence

import attrs

from musegl_core.chat.channels import parse_output

VERSION = 1
MAC_BYTES = 16
MAX_IDS = 1 << 20  # a seal never opens into more ids than this (zlib bombs)
_LABEL = b"musegl reasoning seal v1\0"


@attrs.frozen
class SealedReasoning:
    """Generated ids of one or more consecutive reasoning messages.

    ``opens_turn``: the span starts right after the generation prompt
    (``<|start|>assistant``), so the prompt writes that header before the
    ids; otherwise the ids begin with their own ``<|start|>``."""

    ids: tuple[int, ...]
    opens_turn: bool


class ReasoningSeal:
    """HMAC seals of reasoning ids under one server secret (see the module docstring)."""

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ValueError("a seal secret has at least 16 bytes")
        self._secret = secret

    @classmethod
    def random(cls) -> "ReasoningSeal":
        """A seal with a fresh 256-bit secret (one per server process)."""
        return cls(os.urandom(32))

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._secret, _LABEL + body, hashlib.sha256).digest()[:MAC_BYTES]

    def seal(self, reasoning: SealedReasoning) -> str:
        """The token for ``reasoning``."""
        body = bytes([int(reasoning.opens_turn)]) + struct.pack(f"<{len(reasoning.ids)}I", *reasoning.ids)
        packed = bytes([VERSION]) + self._mac(body) + bytes([body[0]]) + zlib.compress(body[1:], 6)
        return base64.urlsafe_b64encode(packed).decode().rstrip("=")

    def open(self, token: Any) -> SealedReasoning | None:
        """The reasoning ``token`` seals, or None when this server did not make it."""
        if not isinstance(token, str) or not token or len(token) > 8 * MAX_IDS:
            return None
        try:
            packed = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (binascii.Error, ValueError):
            return None
        if len(packed) < 2 + MAC_BYTES or packed[0] != VERSION or packed[1 + MAC_BYTES] not in (0, 1):
            return None
        mac, flag, compressed = packed[1:1 + MAC_BYTES], packed[1 + MAC_BYTES], packed[2 + MAC_BYTES:]
        try:
            inflater = zlib.decompressobj()
            raw = inflater.decompress(compressed, 4 * MAX_IDS + 1)
        except zlib.error:
            return None
        if len(raw) > 4 * MAX_IDS or len(raw) % 4 or not inflater.eof or inflater.unconsumed_tail:
            return None
        body = bytes([flag]) + raw
        if not hmac.compare_digest(mac, self._mac(body)):
            return None
        ids = struct.unpack(f"<{len(raw) // 4}I", raw)
        return SealedReasoning(tuple(ids), bool(flag)) if ids else None


def message_spans(ids: Sequence[int], channels: Sequence[str], terminators: frozenset[int]) -> list[tuple[int, int, str]]:
    """``(start, end, channel)`` of every message of a generation that has
    ended so far: message ``k`` runs from after the ``k-1``-th structural
    terminator id through the ``k``-th; ``channels`` are the channel parser's
    (``message_starts``) in order."""
    spans, start = [], 0
    for index, token in enumerate(ids):
        if token in terminators:
            if len(spans) < len(channels):
                spans.append((start, index + 1, channels[len(spans)]))
            start = index + 1
    return spans


def reasoning_block(
    ids: Sequence[int],
    channels: Sequence[str],
    *,
    sealed_through: int,
    text: str,
    tokenizer: Any,
) -> tuple[SealedReasoning, int] | None:
    """The ids of the reasoning messages a client just saw as one block, and
    the id index where they end (the next block's ``sealed_through``).

    ``ids`` are one choice's generated ids so far, ``channels`` the channel of
    each message (the channel parser's ``message_starts``), ``sealed_through``
    the id index where earlier blocks ended, ``text`` the block's reasoning as
    sent. The span is every ended reasoning message from ``sealed_through`` on
    (non-reasoning messages before the first are skipped); it is returned only
    if it decodes to reasoning equal to ``text`` (a structure the split cannot
    follow, such as a terminator id inside a tool-call value, fails the check
    and gives None: the block is then not sealed; so does a reasoning message
    the output cut before its terminator)."""
    if tokenizer is None:
        return None
    terminators = frozenset((tokenizer.eom_id, tokenizer.eot_id))
    span: tuple[int, int] | None = None
    for start, end, channel in message_spans(ids, channels, terminators):
        if end <= sealed_through:
            continue
        if channel == "reasoning":
            span = (span[0] if span is not None else start, end)
        elif span is not None:
            break
    if span is None:
        return None
    piece = tuple(ids[span[0]:span[1]])
    decoded = tokenizer.decode(list(piece))
    if parse_output(decoded, tools_active=False).reasoning != (text or None):
        return None
    return SealedReasoning(piece, opens_turn=span[0] == 0), span[1]
