"""The surface's ``musegl serve`` flags and their validated values."""

from __future__ import annotations

import argparse
from typing import Any, Mapping

import attrs

from musegl_core.errors import ConfigError


@attrs.frozen
class ResponsesSettings:
    """``store_ttl`` seconds a stored response is kept; ``store_entries`` and
    ``store_bytes`` bound the store (least recently used evicted first);
    ``keepalive`` seconds between ``response.in_progress`` repeats while a
    prompt is prefilled."""

    store_ttl: float = 3600.0
    store_entries: int = 1000
    store_bytes: int = 256 << 20
    keepalive: float = 15.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> "ResponsesSettings":
        values = {
            "store_ttl": extra.get("responses_store_ttl"),
            "store_entries": extra.get("responses_store_entries"),
            "store_bytes": extra.get("responses_store_bytes"),
            "keepalive": extra.get("responses_keepalive"),
        }
        settings = cls(**{k: v for k, v in values.items() if v is not None})
        if settings.store_ttl <= 0:
            raise ConfigError("--responses-store-ttl must be positive")
        if settings.store_entries < 0 or settings.store_bytes < 0:
            raise ConfigError("--responses-store-entries and --responses-store-bytes must be 0 (no store) or positive")
        if settings.keepalive <= 0:
            raise ConfigError("--responses-keepalive must be positive")
        return settings


def add_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--responses-store-ttl", metavar="SECONDS", type=float, default=None,
                       help="how long a stored response (store: true) is kept (default 3600)")
    group.add_argument("--responses-store-entries", metavar="N", type=int, default=None,
                       help="most stored responses; the least recently used goes first (default 1000, 0: no store)")
    group.add_argument("--responses-store-bytes", metavar="BYTES", type=int, default=None,
                       help="most bytes of stored responses, input and output (default 256 MiB)")
    group.add_argument("--responses-keepalive", metavar="SECONDS", type=float, default=None,
                       help="seconds between response.in_progress events while a long prompt is prefilled (default 15)")
