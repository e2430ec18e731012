"""Loading what serves a model: its tokenizer, the chosen executor and the
speculator a plugin enables, with a progress bar. The worker loads them at
start-up (:mod:`musegl_core.worker.main`); ``musegl generate`` loads them
in-process the same way.
"""

from __future__ import annotations

import os

from musegl_core.config import ServeConfig
from musegl_core.engine.executor import check_executor
from musegl_core.errors import ConfigError

__all__ = ["load", "check_speculator"]


def load(config: ServeConfig, max_context: int | None | bool = True):
    """Load tokenizer, executor and speculator (if a plugin enables one) for
    ``config``, with a progress bar. ``max_context`` is what the executor is
    told of the context budget: ``True`` means ``config.max_context``, None no
    fixed budget (``musegl generate`` sizes its own)."""
    from musegl_core.engine.kv_dtype import check_kv_cache_dtype
    from musegl_core.plugins.manager import PluginManager
    from musegl_core.plugins.specs import ExecutorOptions
    from musegl_core.progress import loading_progress
    from musegl_core.model_tokenizer import load_tokenizer

    plugins = PluginManager(only=config.plugins, process="worker")  # executors and speculators only
    spec = plugins.choose_executor(config.executor, config.model)
    check_kv_cache_dtype(config.kv_cache_dtype, spec)
    tokenizer = load_tokenizer(config.model)
    with loading_progress(f"loading {os.path.basename(config.model)} ({spec.name})") as progress:
        options = ExecutorOptions(
            model=config.model,
            device=config.device,
            dtype=config.dtype,
            demo=config.demo,
            mmproj=config.mmproj,
            max_context=config.max_context if max_context is True else max_context,
            kv_cache_dtype=config.kv_cache_dtype,
            progress=progress,
            extra=dict(config.extra),
        )
        executor = spec.create(options)
        check_executor(executor, spec.name)  # one line naming what is missing, not an AttributeError later
        speculator = plugins.create_speculator(executor, options)
    check_speculator(executor, speculator)
    return tokenizer, executor, speculator


def check_speculator(executor, speculator) -> None:
    """Refuse, at load, a speculator that reads hidden states from an executor that returns none."""
    if speculator is not None and tuple(speculator.taps) and not executor.info.hidden_states:
        raise ConfigError(f"the {executor.info.backend} executor returns no hidden states, which the "
                          f"speculator needs (layers {list(speculator.taps)}); serve without it")
