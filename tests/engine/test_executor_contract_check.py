"""An executor object is checked against the contract when its factory returns
it: one line naming every missing member and the contract section, instead of
an AttributeError deep in the engine (issue 25 item 19)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from musegl_core.engine.executor import ExecutorLimits, check_executor, contract_problems
from musegl_core.errors import ConfigError
from musegl_core.testing.example_executor import ExampleExecutor
from tests.support.server import support_plugin_env


def without(*names: str) -> type:
    return type("Partial", (), {k: v for k, v in vars(ExampleExecutor).items()
                                if k not in names and (k == "__init__" or not k.startswith("__"))})


def test_the_complete_example_follows_the_contract():
    assert contract_problems(ExampleExecutor(64)) == []
    check_executor(ExampleExecutor(64), "example")


def test_every_missing_member_is_named_on_one_line():
    executor = without("kv_memory_available", "release_sequence", "limits")(64)
    del executor.limits  # set in __init__: an executor that never sets it
    with pytest.raises(ConfigError) as error:
        check_executor(executor, "old")
    message = str(error.value)
    assert "\n" not in message
    assert "'old' executor" in message and "contract v2" in message
    assert "missing limits, kv_memory_available, release_sequence" in message
    assert 'docs/executor.md section 2, "What the executor object provides"' in message


def test_wrong_members_and_async_steps_without_launch_are_named():
    executor = ExampleExecutor(64)
    executor.info = {"name": "x"}
    executor.block_size = 0
    executor.copy_blocks = "not callable"
    executor.limits = ExecutorLimits(async_steps=True)
    message = str(pytest.raises(ConfigError, check_executor, executor, "odd").value)
    assert "missing copy_blocks" in message
    assert "info is a dict, not a ModelInfo" in message and "block_size is 0, not a positive int" in message
    assert "limits.async_steps is set but launch is missing (docs/executor.md section 4a" in message


def test_serve_refuses_an_executor_of_the_previous_contract_with_one_line(tmp_path):
    from musegl_core.tiny import default_model_path

    with support_plugin_env(tmp_path, "previous-contract", "musegl_previous_contract", {}):
        done = subprocess.run(
            [sys.executable, "-m", "musegl_core.cli.main", "serve", str(default_model_path()), "--port", "0",
             "--plugin", "previous-contract", "--executor", "previous-contract"],
            capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "AttributeError" not in done.stderr and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "does not follow the executor contract" in line]
    assert len(lines) == 1, done.stderr
    assert "missing kv_memory_available, release_sequence (docs/executor.md section 2" in lines[0]
    assert done.stderr.count("worker started") == 1  # a plugin that cannot work is not retried
