"""Plugin system: hook specifications, discovery and selection."""

from musegl_core.plugins.hookspecs import hookimpl

__all__ = ["hookimpl"]
