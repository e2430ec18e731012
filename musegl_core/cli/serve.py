"""Start the HTTP server and its model worker."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from musegl_core.cli.main import OneLineParser
from musegl_core.config import ServeConfig
from musegl_core.errors import ConfigError


def _int(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def build_parser(plugins=None) -> OneLineParser:
    d = ServeConfig()
    p = OneLineParser(prog="musegl serve", description="Serve a Muse Glimmer checkpoint over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", help="GGUF file or Hugging Face directory; omitted: the built-in random-weight demo")
    p.add_argument("--model", dest="model_opt", metavar="PATH", help="same as the positional MODEL")
    p.add_argument("--plugin", action="append", dest="plugins", metavar="NAME",
                   help="load only this plugin (repeatable); default: every installed plugin")
    net = p.add_argument_group("network")
    net.add_argument("--host", default=d.host, help=f"bind address (default {d.host})")
    net.add_argument("--port", type=_int, default=d.port, help=f"port (default {d.port})")
    net.add_argument("--api-key", default=os.environ.get("MUSEGL_API_KEY"), help="require this bearer token (env MUSEGL_API_KEY)")
    net.add_argument("--served-model-name", action="append", metavar="NAME",
                     help="model id reported by /v1/models (default: a slug of the checkpoint's name); "
                          "repeat to add aliases; 'musegl' is always accepted too")
    net.add_argument("--cors-allow-origin", action="append", metavar="ORIGIN",
                     help="allow cross-origin requests from ORIGIN (repeatable; '*' for any); default: CORS off")
    net.add_argument("--shutdown-timeout", type=_float, default=d.shutdown_timeout, metavar="SECONDS",
                     help=f"on SIGINT/SIGTERM, how long in-flight requests may still run (default {d.shutdown_timeout:g})")
    lim = p.add_argument_group("limits (the seed's serving limits)")
    lim.add_argument("--max-context", type=_int, default=d.max_context, help=f"context budget per session in tokens (default {d.max_context})")
    lim.add_argument("--max-sessions", type=_int, default=d.max_sessions, help=f"session slots (default {d.max_sessions})")
    lim.add_argument("--max-inflight-requests", type=_int, default=d.max_inflight_requests, help=f"admitted requests (default {d.max_inflight_requests})")
    lim.add_argument("--max-decode-sequences", type=_int, default=d.max_decode_sequences, help=f"decode batch width (default {d.max_decode_sequences})")
    lim.add_argument("--max-prefill-chunk", type=_int, default=d.max_prefill_chunk, help=f"prompt positions per forward (default {d.max_prefill_chunk})")
    lim.add_argument("--max-image-bytes", type=_int, default=d.max_image_bytes, help="compressed image size limit (1 B .. 20 MiB, default 20 MiB)")
    lim.add_argument("--max-request-bytes", type=_int, default=d.max_request_bytes, help="worker request frame limit (<= 32 MiB, default 32 MiB)")
    lim.add_argument("--max-vision-patches", type=_int, default=d.max_vision_patches, help=f"vision patch cap (default {d.max_vision_patches})")
    lim.add_argument("--prefix-cache-entries", type=_int, default=d.prefix_cache_entries, help="prefix snapshots (default 0)")
    lim.add_argument("--evict-idle-sessions", action="store_true", help="evict the least recently used idle session when slots run out")
    lim.add_argument("--streaming-preflight-timeout", type=_float, default=None, metavar="SECONDS", help="bound the wait before streaming headers")
    lim.add_argument("--kv-blocks", type=_int, default=None, help="KV pool size in blocks (default: enough for every admitted request at --max-context)")
    proto = p.add_argument_group("protocol")
    proto.add_argument("--tool-parser", default=None, metavar="NAME", help="tool-call parser (e.g. atem, from musegl-atem)")
    proto.add_argument("--api-dialect", default=d.api_dialect, metavar="NAME", help="API dialect: openai (default) or a plugin's (openrouter)")
    proto.add_argument("--template", default=d.template, metavar="NAME", help="chat template (default muse)")
    exe = p.add_argument_group("execution")
    exe.add_argument("--executor", default=None, metavar="NAME", help="executor to use (default: the best one for this machine)")
    exe.add_argument("--device", default=None, help="device for the executor (cpu, cuda:0, ...)")
    exe.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="activation dtype")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    if plugins is not None:
        plugins.add_serve_options(p)
    return p


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServeConfig:
    if args.model and args.model_opt and args.model != args.model_opt:
        raise ConfigError("give the model once (positional MODEL or --model)")
    known = {a.dest for a in build_parser()._actions}
    extra = {k: v for k, v in vars(args).items() if k not in known}
    names = list(dict.fromkeys(args.served_model_name or ()))  # the served id, then its aliases
    return ServeConfig(
        model=args.model or args.model_opt,
        host=args.host,
        port=args.port,
        served_model_name=names[0] if names else None,
        served_model_aliases=tuple(names[1:]),
        shutdown_timeout=args.shutdown_timeout,
        cors_allow_origins=tuple(args.cors_allow_origin or ()),
        max_context=args.max_context,
        max_sessions=args.max_sessions,
        max_inflight_requests=args.max_inflight_requests,
        max_decode_sequences=args.max_decode_sequences,
        max_prefill_chunk=args.max_prefill_chunk,
        max_image_bytes=args.max_image_bytes,
        max_request_bytes=args.max_request_bytes,
        max_vision_patches=args.max_vision_patches,
        prefix_cache_entries=args.prefix_cache_entries,
        evict_idle_sessions=args.evict_idle_sessions,
        streaming_preflight_timeout=args.streaming_preflight_timeout,
        tool_parser=args.tool_parser,
        api_dialect=args.api_dialect,
        template=args.template,
        executor=args.executor,
        device=args.device,
        dtype=args.dtype,
        kv_blocks=args.kv_blocks,
        api_key=args.api_key,
        plugins=tuple(args.plugins) if args.plugins else None,
        extra=extra,
    ).validate()


def prepare(argv: list[str]):
    """Parse and validate everything; returns (config, plugins). No model is loaded."""
    from musegl_core.plugins.manager import PluginManager

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugin", action="append", dest="plugins")
    known, _ = pre.parse_known_args(argv)
    plugins = PluginManager(only=known.plugins)
    parser = build_parser(plugins)
    args = parser.parse_args(argv)
    config = config_from_args(args, parser)
    plugins.get("dialects", config.api_dialect)
    plugins.get("templates", config.template)
    if config.tool_parser:
        plugins.get("tool_parsers", config.tool_parser)
    plugins.choose_executor(config.executor)
    if config.model and not os.path.exists(config.model):
        raise ConfigError(f"model path {config.model!r} does not exist")
    return config, plugins, args.log_level


def main(argv: list[str]) -> int:
    import attrs

    from musegl_core.http.server import bind

    config, plugins, log_level = prepare(argv)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    log = logging.getLogger("musegl")
    sock = bind(config.host, config.port)  # a port in use ends here, before anything is announced
    host, port = sock.getsockname()[:2]
    config = attrs.evolve(config, port=port)
    if config.model is None:
        from musegl_core.tiny import default_model_path

        path = default_model_path(progress=True)
        config = attrs.evolve(config, model=str(path), demo=True)
        log.warning("no model given: serving the built-in RANDOM-WEIGHT DEMO checkpoint %s (its output is noise)", path)

    from musegl_core.http.app import create_app
    from musegl_core.http.server import serve
    from musegl_core.worker.client import WorkerClient

    worker = WorkerClient(config)
    app = create_app(config, plugins, worker)
    shown = f"[{host}]" if ":" in host else host
    log.info("listening on http://%s:%d (model loads in the worker; /health turns 200 when ready)", shown, port)
    serve(app, sock, shutdown_timeout=config.shutdown_timeout, on_shutdown=app.state["front"].begin_shutdown,
          log_level=log_level)
    return 0
