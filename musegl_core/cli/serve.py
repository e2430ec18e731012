"""Start the HTTP server and its model worker."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from musegl_core.cli.main import OneLineParser
from musegl_core.config import LOGS, ServeConfig
from musegl_core.errors import ConfigError
from musegl_core.logs import LEVELS


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


def _size(text: str) -> int:
    from musegl_core.engine.kv_sizing import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_or_zero(text: str) -> int:
    """A size, or 0 (off)."""
    return 0 if text.strip() in ("0", "off") else _size(text)


def _on_off(text: str) -> bool:
    if text in ("on", "off"):
        return text == "on"
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


KINDS = {"str": None, "int": _int, "float": _float, "size": _size, "size-or-0": _size_or_zero,
         "on-off": _on_off}


#: Which checkpoint formats each executor keeps as stored (see README, "Weights as stored").
STORED_FORMATS = (
    "Weights kept as stored (not converted at load): torch-cpu: f32, f16, bf16, GGUF Q8_0, Q4_0, Q4_K, Q5_K, "
    "Q6_K (a whole Q4_K_M file) and mlx-lm's 4-bit groups of 64, other GGUF types and MLX layouts decoded to "
    "float32; mlx: f16, bf16, GGUF Q8_0, Q4_0, Q4_1, Q4_K, Q5_K (exact) and Q6_K (as 6-bit groups of 32, its "
    "nearest form at the file's size), mlx-lm's quantized safetensors (affine, any bits/group); "
    "cuda: every weight converted to --dtype at load. At start-up serve prints the weights' bytes on the device "
    "and the KV room left, and refuses a model that does not fit with the flags that would help.")


def build_parser(plugins=None) -> OneLineParser:
    """The ``musegl serve`` parser: one flag per :meth:`ServeConfig.flag_fields` field."""
    p = OneLineParser(prog="musegl serve", description="Serve a Muse Glimmer checkpoint over an OpenAI-compatible HTTP API.",
                      epilog=STORED_FORMATS)
    p.add_argument("model", nargs="?", help="GGUF file, Hugging Face directory, or an ExecuTorch export (.pte or its directory, musegl export); omitted: the built-in random-weight demo")
    p.add_argument("--model", dest="model_opt", metavar="PATH", help="same as the positional MODEL")
    p.add_argument("--plugin", action="append", dest="plugins", metavar="NAME",
                   help="load only this plugin (repeatable); default: every installed plugin")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for field in ServeConfig.flag_fields():
        spec = field.metadata["flag"]
        group = groups.get(spec["group"]) or groups.setdefault(spec["group"], p.add_argument_group(spec["group"]))
        names = (spec["name"] or "--" + field.name.replace("_", "-"), *spec["aliases"])
        default = os.environ.get(spec["env"], field.default) if spec["env"] else field.default
        if spec["kind"] == "switch":
            group.add_argument(*names, action="store_true", default=default, help=spec["help"])
        elif spec["kind"] == "append":
            group.add_argument(*names, dest=field.name, action="append", default=None, metavar=spec["metavar"],
                               help=spec["help"])
        elif spec["kind"] == "off-switch":
            group.add_argument("--no-" + field.name.replace("_", "-"), dest=field.name, action="store_false",
                               default=default, help=spec["help"])
        else:
            group.add_argument(*names, dest=field.name, type=KINDS[spec["kind"]], default=default,
                               metavar=spec["metavar"], choices=spec["choices"], help=spec["help"])
    groups[LOGS].add_argument("--log-level", default="info", choices=LEVELS,
                              help="the least severe log lines shown, in the front and the worker "
                              "(default %(default)s)")
    if plugins is not None:
        plugins.add_serve_options(p)
    return p


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServeConfig:
    if args.model and args.model_opt and args.model != args.model_opt:
        raise ConfigError("give the model once (positional MODEL or --model)")
    known = {a.dest for a in build_parser()._actions}
    extra = {k: v for k, v in vars(args).items() if k not in known}
    values = {field.name: getattr(args, field.name) for field in ServeConfig.flag_fields()}
    for field in ServeConfig.flag_fields():
        if field.metadata["flag"]["kind"] == "append":
            values[field.name] = tuple(dict.fromkeys(values[field.name] or ()))
    names = values.pop("served_model_name")  # the first is the served id, the rest its aliases
    return ServeConfig(
        model=args.model or args.model_opt,
        plugins=tuple(args.plugins) if args.plugins else None,
        extra=extra,
        served_model_name=names[0] if names else None,
        served_model_aliases=names[1:],
        **values,
    ).validate()


def prepare(argv: list[str]):
    """Parse and validate everything; returns (config, plugins). No model is loaded."""
    from musegl_core.plugins.manager import PluginManager

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugin", action="append", dest="plugins")
    known, _ = pre.parse_known_args(argv)
    plugins = PluginManager(only=known.plugins, process="front")
    parser = build_parser(plugins)
    args = parser.parse_args(argv)
    config = config_from_args(args, parser)
    plugins.get("dialects", config.api_dialect)
    check_template(config.template, plugins)
    if config.tool_parser:
        plugins.get("tool_parsers", config.tool_parser)
    spec = plugins.choose_executor(config.executor, config.model)
    if config.model and not os.path.exists(config.model):
        raise ConfigError(f"model path {config.model!r} does not exist")
    if config.mmproj and not os.path.isfile(config.mmproj):
        raise ConfigError(f"--mmproj {config.mmproj!r} is not a file")
    from musegl_core.engine.kv_dtype import check_kv_cache_dtype

    check_kv_cache_dtype(config.kv_cache_dtype, spec)
    from musegl_core.engine.sliding_pages import check_sliding_pages

    check_sliding_pages(config.sliding_window_kv, spec)
    if config.model:
        if spec.check is not None:  # the executor checks the model itself (its own formats, --load-format)
            from musegl_core.plugins.specs import ExecutorOptions

            spec.check(ExecutorOptions(model=config.model, device=config.device, dtype=config.dtype,
                                       mmproj=config.mmproj, max_context=config.max_context,
                                       kv_cache_dtype=config.kv_cache_dtype, extra=dict(config.extra)))
        else:
            from musegl_core.servable import check_servable

            check_servable(config.model)
        check_speculators(config, plugins)  # a draft that does not fit, before the port is bound
    return config, plugins, args.log_level


def key_on_command_line(argv: list[str]) -> str | None:
    """A warning when ``--api-key`` was given as an argument: every user of the machine reads it
    in the process list (``ps``); ``MUSEGL_API_KEY`` keeps it out."""
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in argv):
        return ("--api-key on the command line is visible to every user of this machine in the process list "
                "(ps, /proc/PID/cmdline); set the environment variable MUSEGL_API_KEY instead")
    return None


def startup_line(config: ServeConfig, plugins) -> str:
    """What this server runs, in one line (logged at start-up): the model, the executor,
    the tool parser, the API surfaces, the dialect, the template and the speculator plugins."""
    executor = plugins.choose_executor(config.executor, config.model)
    owners = {name: plugin for name, (plugin, _spec) in plugins.provided("executors").items()}

    def names(kind: str) -> str:
        return ", ".join(sorted(plugins.specs(kind))) or "none"

    parser = config.tool_parser or "none (tool calls are refused; --tool-parser atem enables them)"
    return (f"serving {config.model}{' (demo)' if config.demo else ''}: executor {executor.name} "
            f"(plugin {owners.get(executor.name, '?')}); tool parser {parser}; API surfaces {names('api_surfaces')}; "
            f"dialect {config.api_dialect} "
            f"(installed: {names('dialects')}); template {config.template}; speculator plugins {names('speculators')}")


def check_template(name: str, plugins) -> None:
    """``--template`` / ``--chat-template`` names a registered template. vLLM's
    ``--chat-template`` takes a Jinja file or text, which musegl cannot run (its
    templates are code, the Muse Glimmer format is rendered by ``muse``): refused
    with a line that says so rather than "no template named ...jinja"."""
    known = plugins.specs("templates")
    if name in known:
        return
    if any(c in name for c in "/\\{%") or name.endswith((".jinja", ".j2", ".jinja2")) or os.path.exists(name):
        raise ConfigError(f"--template/--chat-template takes the name of a registered template "
                          f"({', '.join(sorted(known)) or 'none'}), not a Jinja template file or text: musegl "
                          f"renders the Muse Glimmer format with its own template code; got {name!r}")
    plugins.get("templates", name)  # the usual "no template named ..." line


def check_kv_memory(config: ServeConfig, plugins) -> None:
    """Refuse a ``--kv-cache-memory`` that cannot hold the limits, before loading
    (when the executor can tell its KV layout from the config alone)."""
    if config.kv_cache_memory is None or config.kv_blocks is not None:
        return
    from musegl_core.engine.kv_sizing import check_fits
    from musegl_core.plugins.specs import ExecutorOptions

    spec = plugins.choose_executor(config.executor, config.model)
    if spec.kv_layout is None:
        return  # the worker checks once the executor is loaded
    per_block, block_size = spec.kv_layout(ExecutorOptions(model=config.model, device=config.device,
                                                           dtype=config.dtype, max_context=config.max_context,
                                                           kv_cache_dtype=config.kv_cache_dtype,
                                                           extra=dict(config.extra)))
    check_fits(bytes_per_block=per_block, block_size=block_size, budget=config.kv_cache_memory,
               source="--kv-cache-memory", max_sessions=config.max_sessions, max_context=config.max_context,
               snapshots=config.prefix_cache_entries)


def check_speculators(config: ServeConfig, plugins) -> None:
    """Let speculator plugins refuse their flags (a draft that does not fit the
    target) before the worker starts, from the checkpoints' configs alone."""
    from musegl_core.plugins.specs import ExecutorOptions

    options = ExecutorOptions(model=config.model, device=config.device, dtype=config.dtype, demo=config.demo,
                              kv_cache_dtype=config.kv_cache_dtype, extra=dict(config.extra))
    for spec in plugins.specs("speculators").values():
        if spec.check is not None:
            spec.check(options)


def main(argv: list[str]) -> int:
    import attrs

    from musegl_core.allocator import fix_mmap_threshold
    from musegl_core.http.server import bind

    from musegl_core.logs import configure
    from musegl_core.progress import show_progress

    fix_mmap_threshold()  # large request bodies go back to the OS once answered
    config, plugins, log_level = prepare(argv)
    configure(log_level, "front")
    show_progress(log_level in ("debug", "info"))
    log = logging.getLogger("musegl.serve")
    exposed = key_on_command_line(argv)
    if exposed:
        log.warning("%s", exposed)
    sock = bind(config.host, config.port)  # a port in use ends here, before anything is announced
    host, port = sock.getsockname()[:2]
    config = attrs.evolve(config, port=port)
    if config.model is None:
        from musegl_core.tiny import default_model_path, demo_mmproj_path

        path = default_model_path(progress=True)
        config = attrs.evolve(config, model=str(path), demo=True, mmproj=config.mmproj or demo_mmproj_path(path))
        log.warning("no model given: serving the built-in RANDOM-WEIGHT DEMO checkpoint %s (its output is noise)", path)
    check_kv_memory(config, plugins)  # before loading: a --kv-cache-memory that cannot hold the limits
    from musegl_core.engine.fit import check_serve_fit

    check_serve_fit(config, plugins, log)  # before loading: the weights and the KV at the limits fit the device
    if config.demo:  # a given model was checked in prepare()
        check_speculators(config, plugins)

    from musegl_core.http.app import create_app
    from musegl_core.http.server import GracefulServer
    from musegl_core.worker.client import WorkerClient

    worker = WorkerClient(config, log_level=log_level)
    app = create_app(config, plugins, worker)
    shown = f"[{host}]" if ":" in host else host
    log.info("%s", startup_line(config, plugins))
    log.info("listening on http://%s:%d (model loads in the worker; /health turns 200 when ready)", shown, port)
    server = GracefulServer.create(app, shutdown_timeout=config.shutdown_timeout,
                                   on_shutdown=app.state["front"].begin_shutdown, log_level=log_level,
                                   serve_config=config)
    # A worker that cannot load the model, or keeps dying, stops the server (exit status 1).
    worker.on_fatal = lambda _reason: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    if worker.fatal:
        print(f"musegl serve: error: {worker.fatal}", file=sys.stderr)
        return 1
    return 0
