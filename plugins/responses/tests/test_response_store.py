"""The response store's bounds (TTL, LRU, entry and byte caps) and its serve flags."""

from __future__ import annotations

import argparse

import pytest

from musegl_core.chat.messages import Message
from musegl_core.errors import ConfigError
from musegl_responses.settings import ResponsesSettings, add_options
from musegl_responses.store import ResponseStore, StoredResponse


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def entry(name: str, text: str = "x") -> StoredResponse:
    return StoredResponse(id=name, body={"id": name}, input_items=[], messages=[Message(role="user", content=text)],
                          instructions=None, session=None)


def test_entries_expire_after_the_ttl_from_their_last_use():
    clock = Clock()
    store = ResponseStore(ttl=10, max_entries=10, max_bytes=1 << 20, clock=clock)
    store.put(entry("a"))
    store.put(entry("b"))
    clock.now = 8
    assert store.get("a") is not None  # a use renews a
    clock.now = 12
    assert store.get("b") is None and store.get("a") is not None
    clock.now = 30
    assert store.get("a") is None and len(store) == 0 and store.bytes == 0


def test_the_least_recently_used_entry_goes_first_at_the_entry_cap():
    store = ResponseStore(ttl=100, max_entries=2, max_bytes=1 << 20, clock=Clock())
    store.put(entry("a"))
    store.put(entry("b"))
    store.get("a")
    store.put(entry("c"))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None


def test_the_byte_cap_evicts_and_an_entry_too_big_alone_is_not_stored():
    one = entry("a", "y" * 1000)
    size = ResponseStore(ttl=1, max_entries=1, max_bytes=1 << 20).put(one) and one.size
    store = ResponseStore(ttl=100, max_entries=100, max_bytes=2 * size + 10, clock=Clock())
    for name in ("a", "b", "c"):
        assert store.put(entry(name, "y" * 1000))
    assert store.get("a") is None and store.bytes <= 2 * size + 10
    assert not store.put(entry("huge", "y" * 10_000)) and store.get("huge") is None
    assert ResponseStore(ttl=1, max_entries=0, max_bytes=100).put(entry("z")) is False  # store off


def test_the_serve_flags_reach_the_settings_and_bad_values_are_config_errors():
    parser = argparse.ArgumentParser()
    add_options(parser.add_argument_group("plugin responses"))
    args = parser.parse_args(["--responses-store-ttl", "60", "--responses-store-entries", "5",
                              "--responses-store-bytes", "1000", "--responses-keepalive", "2"])
    assert ResponsesSettings.from_extra(vars(args)) == ResponsesSettings(60.0, 5, 1000, 2.0)
    assert ResponsesSettings.from_extra({}) == ResponsesSettings()
    with pytest.raises(ConfigError, match="ttl"):
        ResponsesSettings.from_extra({"responses_store_ttl": 0})
