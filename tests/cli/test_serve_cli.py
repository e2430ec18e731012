"""`musegl --help` and `musegl serve --help` in plain words, vLLM's spellings as aliases,
--seed, the start-up line and the throughput line."""

from __future__ import annotations

import logging

from musegl_core.cli import main as cli
from musegl_core.cli.serve import build_parser, prepare, startup_line
from musegl_core.engine.randomness import random_seed, seed_requests
from musegl_core.engine.throughput import ThroughputLog


def test_the_command_list_has_no_markup(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out
    assert "worker     The process that owns the model" in out
    assert cli.summary(":class:`~a.B` and ``x``: y.\nmore") == "a.B and x: y."


def test_serve_help_speaks_plainly():
    text = build_parser().format_help()
    assert "seed's" not in text and "limits (" not in text
    flat = " ".join(text.split())
    assert "--max-request-bytes BYTES largest request accepted: the HTTP body limit (413 beyond it)" in flat
    assert "--max-context TOKENS, --max-model-len TOKENS" in flat
    assert "--template NAME, --chat-template NAME" in flat
    for group in ("limits:", "sessions:", "KV cache:", "logging:"):
        assert f"\n{group}\n" in text


def test_vllm_spellings_mean_the_same():
    config, _, level = prepare(["--max-model-len", "1234", "--chat-template", "muse", "--seed", "7",
                                "--sessions-api", "off", "--max-queued-requests", "0", "--log-level", "error"])
    assert (config.max_context, config.template, config.seed) == (1234, "muse", 7)
    assert config.sessions_api is False and config.max_queued_requests == 0 and level == "error"
    config, _, _ = prepare([])
    assert config.sessions_api is True and config.max_queued_requests == 1024 and config.seed is None


def test_seed_makes_the_drawn_request_seeds_repeat():
    try:
        seed_requests(11)
        first = [random_seed() for _ in range(3)]
        seed_requests(11)
        assert [random_seed() for _ in range(3)] == first
        seed_requests(12)
        assert [random_seed() for _ in range(3)] != first
        assert all(0 <= s < 2**63 for s in first)
    finally:
        seed_requests(None)
    assert random_seed() != random_seed()


def test_the_startup_line_names_executor_tool_parser_and_dialects():
    config, plugins, _ = prepare(["--tool-parser", "atem"])
    line = startup_line(config, plugins)
    assert "executor torch-cpu (plugin cuda)" in line and "tool parser atem" in line
    assert "dialect openai (installed: openai, openrouter)" in line and "template muse" in line
    assert "API surfaces anthropic, chat, completions" in line
    assert "tool parser none" in startup_line(prepare([])[0], plugins)


def test_the_throughput_line_comes_once_per_interval_while_busy(caplog):
    now = [100.0]
    meter = ThroughputLog(10.0, clock=lambda: now[0])
    figures = dict(running=2, queued=5, blocks_used=40, blocks_total=100)
    with caplog.at_level(logging.INFO, logger="musegl.engine"):
        assert not meter.tick(**figures)  # the first step of a busy period starts the measurement
        for _ in range(9):
            now[0] += 1.0
            meter.generated += 20
            meter.prompt += 50
            assert not meter.tick(**figures)
        now[0] += 1.0
        meter.generated += 20
        assert meter.tick(**figures)
        meter.pause()  # idle: the next busy period starts afresh
        now[0] += 500.0
        assert not meter.tick(**figures)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("throughput: 20.0 tokens/s generated, 45.0 prompt tokens/s over 10.0 s; 2 running, "
                    "5 queued; KV blocks 40 of 100 in use")
    assert not ThroughputLog(0).tick(**figures)


def test_dev_install_shows_pip_progress_for_the_long_steps():
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "dev").read_text()
    long_steps = [line for line in script.splitlines()
                  if "pip install" in line and "--upgrade pip" not in line and not line.lstrip().startswith("#")]
    assert len(long_steps) == 4  # for each install (the full one, serve's): torch, then the core and the plugins
    assert not any("--quiet" in line or " -q " in line for line in long_steps)
