"""``musegl serve`` settings: the seed's limits with their ranges and defaults.

Everything here is validated before any model loads; a bad value raises
:class:`~musegl_core.errors.ConfigError` with a one-line reason (exit status 2).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from musegl_core.errors import ConfigError

MIB = 1 << 20
INT32_MAX = 2**31 - 1
MAX_IMAGE_BYTES_CAP = 20 * MIB
MAX_REQUEST_BYTES_CAP = 32 * MIB


def min_request_bytes(max_image_bytes: int) -> int:
    """The seed's floor for --max-request-bytes: one base64 image plus framing."""
    return 4 * math.ceil(max_image_bytes / 3) + 1024


@attrs.frozen
class ServeConfig:
    """Validated serving settings shared by the front and the worker."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    #: more ids the model answers to (``--served-model-name`` given again)
    served_model_aliases: tuple[str, ...] = ()
    max_context: int = 8192
    max_sessions: int = 4
    max_inflight_requests: int = 4
    max_decode_sequences: int = 4
    max_prefill_chunk: int = 512
    max_image_bytes: int = MAX_IMAGE_BYTES_CAP
    max_request_bytes: int = MAX_REQUEST_BYTES_CAP
    max_vision_patches: int = 4096
    prefix_cache_entries: int = 0
    evict_idle_sessions: bool = False
    streaming_preflight_timeout: float | None = None
    tool_parser: str | None = None
    api_dialect: str = "openai"
    template: str = "muse"
    executor: str | None = None
    device: str | None = None
    dtype: str | None = None
    kv_blocks: int | None = None
    api_key: str | None = None
    plugins: tuple[str, ...] | None = None
    demo: bool = False
    #: seconds in-flight requests get to finish once shutdown starts
    shutdown_timeout: float = 5.0
    #: origins allowed by CORS (``--cors-allow-origin``); empty: CORS is off
    cors_allow_origins: tuple[str, ...] = ()
    extra: dict[str, Any] = attrs.field(factory=dict)

    def validate(self) -> "ServeConfig":
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        def int_range(flag: str, value: int, lo: int, hi: int = INT32_MAX) -> None:
            need(lo <= value <= hi, f"{flag} must be between {lo} and {hi}, got {value}")

        int_range("--max-context", self.max_context, 2)
        int_range("--max-sessions", self.max_sessions, 1)
        int_range("--max-inflight-requests", self.max_inflight_requests, 1)
        int_range("--max-decode-sequences", self.max_decode_sequences, 1)
        int_range("--max-prefill-chunk", self.max_prefill_chunk, 1)
        int_range("--max-image-bytes", self.max_image_bytes, 1, MAX_IMAGE_BYTES_CAP)
        int_range("--max-request-bytes", self.max_request_bytes, 1, MAX_REQUEST_BYTES_CAP)
        floor = min_request_bytes(self.max_image_bytes)
        need(
            self.max_request_bytes >= floor,
            f"--max-request-bytes must be at least 4*ceil(max_image_bytes/3)+1024 = {floor} "
            f"for --max-image-bytes {self.max_image_bytes}; lower both together",
        )
        int_range("--max-vision-patches", self.max_vision_patches, 4)
        int_range("--prefix-cache-entries", self.prefix_cache_entries, 0)
        if self.streaming_preflight_timeout is not None:
            t = self.streaming_preflight_timeout
            need(
                math.isfinite(t) and t > 0,
                f"--streaming-preflight-timeout must be a positive number of seconds, got {t}",
            )
        int_range("--port", self.port, 0, 65535)
        need(bool(self.host.strip()), "--host must not be empty")
        need(
            math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0,
            f"--shutdown-timeout must be a non-negative number of seconds, got {self.shutdown_timeout}",
        )
        for name in (self.served_model_name, *self.served_model_aliases):
            need(
                name is None or (bool(name) and not any(c.isspace() for c in name)),
                f"--served-model-name must be non-empty and contain no whitespace, got {name!r}",
            )
        for origin in self.cors_allow_origins:
            need(bool(origin.strip()), "--cors-allow-origin must not be empty")
        if self.kv_blocks is not None:
            int_range("--kv-blocks", self.kv_blocks, 1)
        return self
