"""A test-only executor plugin written against the previous executor contract:
the example executor without ``kv_memory_available`` and ``release_sequence``
(what a third-party executor written for contract v1 lacks). Installed by
:func:`tests.support.server.support_plugin_env` for one test; the worker must
refuse it at load with one line naming both members (issue 25 item 19)."""

from __future__ import annotations

from musegl_core.testing.example_executor import ExampleExecutor

from musegl_core.plugins import hookimpl
from musegl_core.plugins.specs import ExecutorSpec

DROPPED = ("kv_memory_available", "release_sequence")

PreviousContractExecutor = type(
    "PreviousContractExecutor", (),
    {name: value for name, value in vars(ExampleExecutor).items()
     if name not in DROPPED and (name == "__init__" or not name.startswith("__"))},
)


def _create(options):
    from musegl_core.tokenizer import MuseTokenizer

    return PreviousContractExecutor(MuseTokenizer.load(options.model).vocab_size)


@hookimpl
def musegl_executors():
    return [ExecutorSpec("previous-contract", "an executor written for contract v1 (tests only)", _create,
                         lambda: True, -100)]
