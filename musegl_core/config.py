"""``musegl serve`` settings: every flag with its range and default.

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
    """The floor of --max-request-bytes: one base64 image of --max-image-bytes plus framing."""
    return 4 * math.ceil(max_image_bytes / 3) + 1024


def flag(default: Any, help: str, group: str, *, kind: str = "str", metavar: str | None = None,
         choices: tuple[str, ...] | None = None, env: str | None = None, name: str | None = None,
         aliases: tuple[str, ...] = ()) -> Any:
    """A :class:`ServeConfig` field that is also a ``musegl serve`` flag.

    The flag is the field name with dashes (``max_context`` -> ``--max-context``)
    unless ``name`` says otherwise; ``aliases`` are further spellings of the
    same flag (vLLM's, where they mean the same);
    ``kind`` is how its text is read (``str``, ``int``, ``float``, ``size`` such
    as ``24GiB``, ``on-off`` for ``on`` or ``off``, ``switch`` for a flag that turns a False default on, or
    ``off-switch`` for ``--no-NAME`` that turns a True default off, ``append``
    for a repeatable flag collected into a tuple); ``env`` names an
    environment variable that supplies the default. The parser of
    :mod:`musegl_core.cli.serve` is built from these, so every setting is
    written out once, here."""
    return attrs.field(default=default, metadata={"flag": {"help": help, "group": group, "kind": kind,
                                                           "metavar": metavar, "choices": choices, "env": env,
                                                           "name": name, "aliases": aliases}})


NET, LIMITS, SESSIONS, KV, PROTO, EXEC, LOGS = (
    "network", "limits", "sessions", "KV cache", "protocol", "execution", "logging")


@attrs.frozen
class ServeConfig:
    """Validated serving settings shared by the front and the worker."""

    model: str | None = None
    host: str = flag("127.0.0.1", "bind address (default %(default)s)", NET)
    port: int = flag(8000, "port (default %(default)s)", NET, kind="int")
    served_model_name: str | None = flag(None, "model id reported by /v1/models (default: a slug of the checkpoint's "
                                         "name); repeat to add aliases; 'musegl' is always accepted too", NET,
                                         kind="append", metavar="NAME")
    #: more ids the model answers to (``--served-model-name`` given again)
    served_model_aliases: tuple[str, ...] = ()
    cors_allow_origins: tuple[str, ...] = flag((), "allow cross-origin requests from ORIGIN (repeatable; '*' for any); "
                                               "default: CORS off", NET, kind="append", metavar="ORIGIN",
                                               name="--cors-allow-origin")
    allowed_hosts: tuple[str, ...] = flag((), "on a loopback bind, also accept requests whose Host header names NAME "
                                          "(repeatable; '*' for any); default: loopback names only, against DNS "
                                          "rebinding", NET, kind="append", metavar="NAME", name="--allowed-host")
    header_timeout: float = flag(10.0, "close a connection whose request line and headers have not all arrived "
                                 "this long after it opened (kept alive: after the next request's first byte; "
                                 "default %(default)s)", NET, kind="float",
                                 metavar="SECONDS")
    idle_timeout: float = flag(30.0, "close a connection that sends nothing for this long while the server waits "
                               "for it: between requests (keep-alive) or in the middle of a body "
                               "(default %(default)s)", NET, kind="float", metavar="SECONDS")
    max_connections: int = flag(1000, "open connections at most; a connection beyond is closed at once "
                                "(default %(default)s)", NET, kind="int")
    shutdown_timeout: float = flag(5.0, "on SIGINT/SIGTERM, how long in-flight requests may still run "
                                   "(default %(default)s)", NET, kind="float", metavar="SECONDS")
    api_key: str | None = flag(None, "require this bearer token on every route but /health (env MUSEGL_API_KEY, "
                               "which keeps it out of the process list)", NET, env="MUSEGL_API_KEY", metavar="KEY")
    max_context: int = flag(8192, "most tokens of one conversation, prompt and completion together; each session "
                            "slot reserves KV for this many (default %(default)s)", LIMITS, kind="int",
                            metavar="TOKENS", aliases=("--max-model-len",))
    max_sessions: int = flag(4, "session slots: named sessions and running anonymous requests each hold one "
                             "(default %(default)s)", SESSIONS, kind="int", metavar="N")
    max_inflight_requests: int = flag(4, "requests that run at once; more wait in the queue (default %(default)s)",
                                      LIMITS, kind="int", metavar="N")
    max_queued_requests: int = flag(1024, "requests that may wait for a running place, a session slot or their "
                                    "session's previous request, holding no KV; beyond: 503 server_busy; 0: no "
                                    "queue (default %(default)s)", LIMITS, kind="int", metavar="N")
    max_decode_sequences: int = flag(4, "sequences decoded together in one step (default %(default)s)", LIMITS,
                                     kind="int", metavar="N")
    max_n: int = flag(8, "most choices ('n') one request may ask for; each is a request of its own "
                      "(default %(default)s)", LIMITS, kind="int", metavar="N")
    max_prefill_chunk: int | None = flag(None, "most prompt positions one forward pass computes (default: the "
                                         "executor's: 2048 on CUDA, where wide chunks run the products near the "
                                         "matrix rate; 512 elsewhere)", LIMITS, kind="int", metavar="TOKENS")
    solo_prefill_chunk: int | None = flag(None, "most prompt positions one forward pass computes when a single "
                                          "request prefills and nothing else runs, at least --max-prefill-chunk "
                                          "(default: the executor's: 32768 on CUDA, or what the memory beside the "
                                          "KV pool holds, where a long prompt's fewer, wider steps reach its first "
                                          "token sooner; elsewhere --max-prefill-chunk)", LIMITS, kind="int",
                                          metavar="TOKENS")
    prefill_stall_factor: float = flag(6.0, "while sequences decode, prefill may stretch a step to at most this "
                                       "many decode-only steps (per request; estimated online; 0: off, always "
                                       "--max-prefill-chunk; default %(default)s)", LIMITS, kind="float",
                                       metavar="FACTOR")
    spec_verify_rows: int | None = flag(
        None, "speculative decoding: most verify rows (each decoding sequence's pending token and its drafts) "
        "one step may carry; each of B decoding sequences gets at most N // B - 1 drafts, none when that is "
        "below 1; 0: no limit (default: the executor's; on CUDA the widest captured decode graph, 128 unless "
        "--forward-sizes says otherwise: a 128-row step costs 19.6 ms against 14.0 ms for one row on an H200, "
        "512 rows 89 ms; no limit on the other executors)",
        LIMITS, kind="int", metavar="N")
    max_image_bytes: int = flag(MAX_IMAGE_BYTES_CAP, "largest image accepted, compressed (1 B .. 20 MiB, "
                                "default 20 MiB)", LIMITS, kind="int", metavar="BYTES")
    max_request_bytes: int = flag(MAX_REQUEST_BYTES_CAP, "largest request accepted: the HTTP body limit (413 "
                                  "beyond it) and the limit of the request's frame to the worker; at most 32 MiB, "
                                  "at least 4*ceil(--max-image-bytes/3)+1024 (default 32 MiB)", LIMITS, kind="int",
                                  metavar="BYTES")
    max_vision_patches: int = flag(4096, "most vision patches one image may become (default %(default)s)", LIMITS,
                                   kind="int", metavar="N")
    prefix_cache_entries: int = flag(0, "prefix snapshots: frozen prompt prefixes any session may reuse, each "
                                     "holding a slot's KV (default %(default)s)", SESSIONS, kind="int", metavar="N")
    evict_idle_sessions: bool = flag(False, "evict the least recently used idle session when slots run out",
                                     SESSIONS, kind="switch")
    session_idle_timeout: float | None = flag(None, "close named sessions idle this long (default: they persist "
                                              "until DELETE /v1/sessions/{id})", SESSIONS, kind="float",
                                              metavar="SECONDS")
    soft_session_idle_timeout: float = flag(600.0, "close soft sessions (named by a client's own conversation key: "
                                            "X-Claude-Code-Session-Id, prompt_cache_key, session-id) idle this long "
                                            "(default %(default)s)", SESSIONS, kind="float", metavar="SECONDS")
    sessions_api: bool = flag(True, "on: serve GET /v1/sessions and DELETE /v1/sessions/{id}, which every client "
                              "(every holder of the API key) may use on every session; off: both answer 404 "
                              "(default on)", SESSIONS, kind="on-off", metavar="on|off")
    prefix_caching: bool = flag(True, "turn off automatic prefix caching (reuse of finished requests' KV blocks)",
                                SESSIONS, kind="off-switch")
    streaming_preflight_timeout: float | None = flag(None, "longest a streamed request may wait (queue and "
                                                     "prefill) before its headers go out; then 503 "
                                                     "preflight_timeout (default: no bound)", LIMITS,
                                                     kind="float", metavar="SECONDS")
    sliding_window_kv: bool = flag(False, "sliding-window layers keep only the K/V their window reaches on the "
                                   "device, where the executor offers it (the torch executor on the CPU, without "
                                   "a speculator): about 3x the sessions of a long history; a rewind past the "
                                   "window recomputes the prompt (docs/engine.md)", KV, kind="switch")
    kv_offload_dir: str | None = flag(None, "the disk tier: a directory for KV blocks below the host tier, kept "
                                      "across restarts of the worker and the server, one subdirectory per model and "
                                      "KV format; needs --kv-offload-disk (default: no disk tier)", KV, metavar="PATH")
    kv_offload_disk: int | None = flag(None, "bytes the disk tier may fill under --kv-offload-dir, e.g. 100GiB; the "
                                       "least recently used blocks go first (docs/engine.md \"The disk tier\")", KV,
                                       kind="size", metavar="SIZE")
    kv_blocks: int | None = flag(None, "KV pool size in blocks (default: sized from memory, see --kv-cache-memory)",
                                 KV, kind="int", metavar="N")
    kv_cache_memory: int | None = flag(None, "memory for the KV cache, e.g. 24GiB; the pool fills it (default: what "
                                       "the limits need, checked against --kv-cache-fraction of the free memory)",
                                       KV, kind="size", metavar="SIZE")
    kv_offload_memory: int | None = flag(None, "host RAM for the KV host tier, e.g. 16GiB (pinned on CUDA): idle "
                                         "sessions', snapshots' and the prefix cache's KV blocks move there when the "
                                         "device pool runs short and come back when used, instead of being "
                                         "recomputed; 0: off (default: what every session slot and snapshot fills "
                                         "at --max-context, at most 8 GiB and a quarter of the available RAM; "
                                         "docs/engine.md)", KV, kind="size-or-0", metavar="SIZE")
    kv_cache_fraction: float = flag(0.9, "share of the memory free after loading that the KV cache may use "
                                    "(default %(default)s)", KV, kind="float", metavar="F")
    kv_cache_dtype: str = flag("auto", "how K and V are stored: auto (the activation dtype) or fp8 (float8 e4m3 "
                               "with fixed per-head scales: half of bf16's bytes a position; the torch executors "
                               "only, docs/engine.md) (default %(default)s)", KV, choices=("auto", "fp8"),
                               metavar="auto|fp8")
    constrained_reasoning_tokens: int = flag(
        1024, "under an output constraint (response_format json, tool_choice required/named), the reasoning "
        "message may take at most this many tokens before the constrained part must begin; 0: no reasoning "
        "(default %(default)s)", PROTO, kind="int", metavar="N")
    grammar_threads: int | None = flag(
        None, "threads that compute grammar masks while the forward pass runs (overlapped with it); 0: on the "
        "engine thread between steps (default: 0 when the executor computes on the CPU, whose cores the "
        "threads would take from the forward; 2 otherwise)", PROTO, kind="int", metavar="N")
    tool_parser: str | None = flag(None, "tool-call parser (e.g. atem, from musegl-atem)", PROTO, metavar="NAME")
    api_dialect: str = flag("openai", "API dialect: openai (default) or a plugin's (openrouter)", PROTO,
                            metavar="NAME")
    template: str = flag("muse", "chat template, by name (a plugin's; default %(default)s); Jinja templates are "
                         "not supported", PROTO, metavar="NAME", aliases=("--chat-template",))
    seed: int | None = flag(None, "seed of the per-request seeds drawn for requests that give no 'seed': the same "
                            "requests, sent one at a time, sample the same tokens after a restart (default: "
                            "random)", PROTO, kind="int", metavar="N")
    executor: str | None = flag(None, "executor to use (default: the best one for this machine)", EXEC,
                                metavar="NAME")
    mmproj: str | None = flag(None, "vision projector GGUF (llama.cpp's mmproj-*.gguf) for a GGUF MODEL; without "
                              "it a GGUF model is text-only", EXEC, metavar="MMPROJ")
    device: str | None = flag(None, "device for the executor (cpu, cuda:0, ...)", EXEC)
    dtype: str | None = flag(None, "activation dtype", EXEC, choices=("float32", "float16", "bfloat16"))
    throughput_log_interval: float = flag(10.0, "while requests run, the worker logs a throughput line this often "
                                          "(0: never; default %(default)s)", LOGS, kind="float", metavar="SECONDS")
    trace_steps: str | None = flag(None, "append a JSON line per engine step and per request stage (received, "
                                   "prepared, admitted, first token, finished) to FILE, to see where latency goes "
                                   "(docs/metrics.md; default: off)", LOGS, metavar="FILE")
    plugins: tuple[str, ...] | None = None
    demo: bool = False
    extra: dict[str, Any] = attrs.field(factory=dict)

    @classmethod
    def flag_fields(cls) -> list[attrs.Attribute]:
        """The fields that are ``musegl serve`` flags, in declaration order."""
        return [f for f in attrs.fields(cls) if "flag" in f.metadata]

    def validate(self) -> "ServeConfig":
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        def int_range(flag: str, value: int, lo: int, hi: int = INT32_MAX) -> None:
            need(lo <= value <= hi, f"{flag} must be between {lo} and {hi}, got {value}")

        int_range("--max-context", self.max_context, 2)
        int_range("--max-sessions", self.max_sessions, 1)
        int_range("--max-inflight-requests", self.max_inflight_requests, 1)
        int_range("--max-queued-requests", self.max_queued_requests, 0, 1 << 20)
        if self.seed is not None:
            need(0 <= self.seed < 2**64, f"--seed must be between 0 and {2**64 - 1}, got {self.seed}")
        t = self.throughput_log_interval
        need(math.isfinite(t) and t >= 0, f"--throughput-log-interval must be 0 or a positive number of seconds, got {t}")
        int_range("--max-decode-sequences", self.max_decode_sequences, 1)
        if self.max_prefill_chunk is not None:
            int_range("--max-prefill-chunk", self.max_prefill_chunk, 1)
        if self.solo_prefill_chunk is not None:
            int_range("--solo-prefill-chunk", self.solo_prefill_chunk, 1)
        int_range("--max-n", self.max_n, 1, 128)
        if self.spec_verify_rows is not None:
            need(0 <= self.spec_verify_rows <= INT32_MAX,
                 f"--spec-verify-rows must be 0 (no limit) or a number of rows up to {INT32_MAX}, "
                 f"got {self.spec_verify_rows}")
        int_range("--constrained-reasoning-tokens", self.constrained_reasoning_tokens, 0)
        if self.grammar_threads is not None:
            int_range("--grammar-threads", self.grammar_threads, 0, 64)
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
        if self.session_idle_timeout is not None:
            t = self.session_idle_timeout
            need(
                math.isfinite(t) and t > 0,
                f"--session-idle-timeout must be a positive number of seconds, got {t}",
            )
        t = self.soft_session_idle_timeout
        need(math.isfinite(t) and t > 0, f"--soft-session-idle-timeout must be a positive number of seconds, got {t}")
        int_range("--port", self.port, 0, 65535)
        need(bool(self.host.strip()), "--host must not be empty")
        for name, t in (("--header-timeout", self.header_timeout), ("--idle-timeout", self.idle_timeout)):
            need(math.isfinite(t) and t > 0, f"{name} must be a positive number of seconds, got {t}")
        int_range("--max-connections", self.max_connections, 1)
        for host in self.allowed_hosts:
            need(bool(host.strip()), "--allowed-host must not be empty")
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
        if self.kv_cache_memory is not None:
            need(self.kv_cache_memory > 0, "--kv-cache-memory must be positive")
        self._validate_disk_tier(need)
        f = self.kv_cache_fraction
        need(math.isfinite(f) and 0 < f <= 1, f"--kv-cache-fraction must be in (0, 1], got {f}")
        need(self.kv_cache_dtype in ("auto", "fp8"), f"--kv-cache-dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        f = self.prefill_stall_factor
        need(math.isfinite(f) and (f == 0 or f >= 1),
             f"--prefill-stall-factor must be 0 (off) or at least 1, got {f}")
        return self

    def _validate_disk_tier(self, need) -> None:
        """``--kv-offload-dir`` and ``--kv-offload-disk`` go together; the directory must be writable."""
        if self.kv_offload_dir is None and self.kv_offload_disk is None:
            return
        need(self.kv_offload_dir is not None, "--kv-offload-disk needs --kv-offload-dir PATH (where the disk tier "
             "keeps its blocks)")
        need(self.kv_offload_disk is not None, "--kv-offload-dir needs --kv-offload-disk SIZE (how much of the disk "
             "the tier may fill, e.g. 100GiB)")
        need(self.kv_offload_disk > 0, "--kv-offload-disk must be positive")
        need(bool(self.kv_offload_dir.strip()), "--kv-offload-dir must not be empty")
        from pathlib import Path

        from musegl_core.engine.kv_disk import DiskTierError, check_dir

        try:
            check_dir(Path(self.kv_offload_dir).expanduser())
        except DiskTierError as exc:
            raise ConfigError(str(exc)) from None
