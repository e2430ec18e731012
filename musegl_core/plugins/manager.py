"""Discovering, loading and querying plugins.

Plugins are found through the ``musegl`` entry-point group. The core's own
defaults (the ``openai`` dialect, the ``muse`` template) are registered as the
built-in plugin ``core`` through the very same hooks, so a third-party plugin
is never a second-class citizen.

Hooks are called through pluggy's hook callers, one plugin at a time (so a
duplicate name can say which two plugins provide it). A hook implementation
that matches no hook specification (a misspelled hook) is a start-up error
(``check_pending``). A manager made for one process (``process="front"`` or
``"worker"``) refuses to call the hooks that process does not call
(:data:`~musegl_core.plugins.hookspecs.CALLED_IN`).
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
from typing import Any, Iterable, Sequence

import attrs
import pluggy

from musegl_core.errors import ConfigError
from musegl_core.plugins import hookspecs

ENTRY_POINT_GROUP = "musegl"
BUILTIN_MODULES = ("musegl_core.builtin",)

_KINDS = {
    "executors": "musegl_executors",
    "speculators": "musegl_speculators",
    "tool_parsers": "musegl_tool_parsers",
    "dialects": "musegl_dialects",
    "api_surfaces": "musegl_api_surfaces",
    "templates": "musegl_templates",
    "commands": "musegl_commands",
}


@attrs.frozen
class PluginInfo:
    name: str
    distribution: str | None
    version: str | None
    provides: dict[str, tuple[str, ...]]


def installed_entry_points() -> list[md.EntryPoint]:
    return sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


class PluginManager:
    """A pluggy manager holding the built-in plugin plus the selected installed ones."""

    def __init__(self, only: Sequence[str] | None = None, extra: Iterable[tuple[str, Any]] = (),
                 process: str | None = None):
        if process not in (None, hookspecs.FRONT, hookspecs.WORKER):
            raise ValueError(f"process must be {hookspecs.FRONT!r}, {hookspecs.WORKER!r} or None, got {process!r}")
        self.process = process
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._dists: dict[str, tuple[str | None, str | None]] = {}
        for module_name in BUILTIN_MODULES:
            self.pm.register(importlib.import_module(module_name), name="core")
            self._dists["core"] = ("musegl", _version("musegl"))
        available = {ep.name: ep for ep in installed_entry_points()}
        wanted = list(available) if only is None else list(dict.fromkeys(only))
        missing = [n for n in wanted if n not in available and n != "core"]
        if missing:
            known = ", ".join(sorted(available)) or "none"
            raise ConfigError(
                f"plugin {missing[0]!r} is not installed (installed plugins: {known}); "
                f"install the musegl-{missing[0]} distribution"
            )
        for name in wanted:
            if name == "core":
                continue
            ep = available[name]
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must say who it is
                raise ConfigError(f"plugin {name!r} failed to import: {exc}") from exc
            self.pm.register(plugin, name=name)
            dist = ep.dist
            self._dists[name] = (dist.name if dist else None, dist.version if dist else None)
        for name, plugin in extra:
            self.pm.register(plugin, name=name)
            self._dists[name] = (None, None)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise ConfigError(f"plugin {self.pm.get_name(exc.plugin)!r}: {exc}; the hooks are "
                              f"{', '.join(hookspecs.CALLED_IN)}") from None

    # -- calling hooks ---------------------------------------------------------------
    def _call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """``(plugin name, result)`` of every plugin implementing ``hook_name``, in
        registration order, each called through its own pluggy hook caller."""
        if self.process is not None and self.process not in hookspecs.CALLED_IN[hook_name]:
            raise RuntimeError(f"hook {hook_name} is not called in the {self.process} process "
                               f"(musegl_core.plugins.hookspecs.CALLED_IN)")
        implementing = {impl.plugin_name for impl in getattr(self.pm.hook, hook_name).get_hookimpls()}
        plugins = self.pm.list_name_plugin()
        results = []
        for name, plugin in plugins:
            if name not in implementing:
                continue
            caller = self.pm.subset_hook_caller(hook_name, remove_plugins=[p for n, p in plugins if n != name])
            returned = caller(**kwargs)  # pluggy leaves out a None result
            results.append((name, returned[0] if returned else None))
        return results

    # -- queries -------------------------------------------------------------------
    def kinds(self) -> list[str]:
        """The hook kinds this manager's process calls (every kind without a process)."""
        return [kind for kind, hook in _KINDS.items()
                if self.process is None or self.process in hookspecs.CALLED_IN[hook]]

    def _collect(self, kind: str) -> dict[str, tuple[str, Any]]:
        found: dict[str, tuple[str, Any]] = {}
        for plugin_name, specs in self._call_each(_KINDS[kind]):
            for spec in specs or ():
                if spec.name in found:
                    other = found[spec.name][0]
                    raise ConfigError(
                        f"{kind[:-1].replace('_', ' ')} {spec.name!r} is provided by both "
                        f"plugin {other!r} and plugin {plugin_name!r}"
                    )
                found[spec.name] = (plugin_name, spec)
        return found

    def provided(self, kind: str) -> dict[str, tuple[str, Any]]:
        """``{spec name: (plugin name, spec)}`` of one hook kind."""
        return self._collect(kind)

    def specs(self, kind: str) -> dict[str, Any]:
        return {name: spec for name, (_, spec) in self._collect(kind).items()}

    def get(self, kind: str, name: str) -> Any:
        found = self._collect(kind)
        if name not in found:
            label = kind[:-1].replace("_", " ")
            known = ", ".join(sorted(found)) or "none"
            raise ConfigError(
                f"no {label} named {name!r} (available: {known}); "
                f"is the plugin that provides it (musegl-{name}) installed and loaded?"
            )
        return found[name][1]

    def choose_executor(self, name: str | None = None, model: str | None = None) -> Any:
        """The named executor; else an available one that claims ``model`` (an
        exported program only its executor runs); else the best available one."""
        if name:
            spec = self.get("executors", name)
            if not spec.available():
                reason = spec.unavailable_reason() if spec.unavailable_reason is not None else None
                raise ConfigError(f"executor {name!r} cannot run on this machine" + (f": {reason}" if reason else ""))
            return spec
        candidates = [s for s in self.specs("executors").values() if s.available()]
        if model is not None:
            claiming = [s for s in candidates if s.claims is not None and s.claims(model)]
            if claiming:
                return max(claiming, key=lambda s: (s.priority, s.name))
        if not candidates:
            raise ConfigError(
                "no executor plugin can run on this machine; install one "
                "(pip install -e plugins/cuda for the torch executor)"
            )
        return max(candidates, key=lambda s: (s.priority, s.name))

    def create_speculator(self, executor: Any, options: Any) -> Any:
        """The speculator a loaded plugin enables for these options (its own flag
        set), or None. Two enabled at once is a configuration error."""
        created = []
        for name, spec in sorted(self.specs("speculators").items()):
            speculator = spec.create(executor, options)
            if speculator is not None:
                created.append((name, speculator))
        if len(created) > 1:
            raise ConfigError(f"only one speculator can be enabled, got {', '.join(n for n, _ in created)}")
        return created[0][1] if created else None

    def add_serve_options(self, parser, kinds: tuple[str, ...] | None = None) -> None:
        """Each plugin's ``musegl_serve_options`` with an argument group of its own; with
        ``kinds``, only those of plugins that provide one of these kinds (``musegl generate``
        runs executors and speculators, not API surfaces: the Responses store's flags mean
        nothing there)."""
        implementing = {impl.plugin_name for impl in self.pm.hook.musegl_serve_options.get_hookimpls()}
        plugins = self.pm.list_name_plugin()
        if self.process is not None and self.process not in hookspecs.CALLED_IN["musegl_serve_options"]:
            raise RuntimeError(f"hook musegl_serve_options is not called in the {self.process} process")
        providers = None
        if kinds is not None:
            providers = {plugin for kind in kinds for plugin, _ in self._collect(kind).values()}
        for name, _plugin in plugins:
            if name in implementing and (providers is None or name in providers):
                caller = self.pm.subset_hook_caller("musegl_serve_options",
                                                    remove_plugins=[p for n, p in plugins if n != name])
                caller(group=parser.add_argument_group(f"plugin {name}"))

    def describe(self) -> list[PluginInfo]:
        provides: dict[str, dict[str, list[str]]] = {}
        for kind in self.kinds():
            for spec_name, (plugin, _) in self._collect(kind).items():
                provides.setdefault(plugin, {}).setdefault(kind, []).append(spec_name)
        out = []
        for name, _ in self.pm.list_name_plugin():
            dist, version = self._dists.get(name, (None, None))
            kinds = {k: tuple(sorted(v)) for k, v in provides.get(name, {}).items()}
            out.append(PluginInfo(name, dist, version, kinds))
        return sorted(out, key=lambda p: (p.name != "core", p.name))


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
