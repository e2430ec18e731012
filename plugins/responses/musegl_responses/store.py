"""The response store: responses created with ``store: true``, bounded.

A :class:`StoredResponse` keeps what ``GET /v1/responses/{id}`` returns (the
response object), its input items (``input_items``), the conversation that
produced it as the core's messages (its own input after the chain it
continued, then its output as one assistant turn, generated reasoning ids
included) and the session its KV lives in, so that a ``previous_response_id``
turn prefills only its new input.

Bounds: an entry lives ``ttl`` seconds from its last use; at most
``max_entries`` entries and ``max_bytes`` bytes (each entry's size is the
JSON of its object and input items plus 4 bytes per stored token id and the
text of its messages); the least recently used entries are evicted first.
An entry bigger than ``max_bytes`` alone is not stored (and the response
says ``store: false``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import attrs


@attrs.define
class StoredResponse:
    id: str
    body: dict  # the response object as served (updated when cancelled)
    input_items: list  # the input items of this response, with ids
    messages: Sequence[Any]  # the whole conversation through this response's output (core Messages)
    instructions: str | None
    session: str | None  # the session whose KV holds ``messages``
    soft: bool = True  # whether that session is soft (a client key's or a chain's) or named by the client
    size: int = 0


def _message_size(message: Any) -> int:
    size = 64
    for value in (message.content, message.reasoning_content):
        if isinstance(value, str):
            size += len(value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, tuple):
            size += sum(len(getattr(part, "text", "") or "") + len(getattr(part, "data", b"") or b"") for part in value)
    for call in message.tool_calls:
        size += len(json.dumps(call.function.arguments, ensure_ascii=False)) + 64
    sealed = message.reasoning_ids
    if sealed is not None:
        size += 4 * len(sealed.ids)
    return size


def entry_size(entry: StoredResponse) -> int:
    own = len(json.dumps(entry.body, ensure_ascii=False)) + len(json.dumps(entry.input_items, ensure_ascii=False))
    return own + sum(_message_size(m) for m in entry.messages)


class ResponseStore:
    """An LRU map of :class:`StoredResponse` with a TTL, an entry cap and a byte cap. Thread-safe:
    requests are planned off the event loop (``musegl_core.http.offload``) while others are stored."""

    def __init__(self, *, ttl: float, max_entries: int, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, tuple[StoredResponse, float]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.RLock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def put(self, entry: StoredResponse) -> bool:
        """Store ``entry`` (replacing one of the same id); False when it cannot fit at all."""
        entry.size = entry_size(entry)
        with self._lock:
            self.delete(entry.id)
            if not self.enabled or entry.size > self.max_bytes:
                return False
            self._entries[entry.id] = (entry, self._clock())
            self.bytes += entry.size
            self._expire()
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, (old, _) = self._entries.popitem(last=False)
                self.bytes -= old.size
            return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (its use renews its lifetime and makes it most recent), or None."""
        with self._lock:
            self._expire()
            found = self._entries.get(response_id)
            if found is None:
                return None
            self._entries[response_id] = (found[0], self._clock())
            self._entries.move_to_end(response_id)
            return found[0]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            found = self._entries.pop(response_id, None)
            if found is None:
                return False
            self.bytes -= found[0].size
            return True

    def _expire(self) -> None:
        with self._lock:
            now = self._clock()
            while self._entries:
                key, (entry, used) = next(iter(self._entries.items()))
                if now - used < self.ttl:
                    return
                del self._entries[key]
                self.bytes -= entry.size
