"""`musegl serve` validates the seed's limits before any model loads (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

from musegl_core.config import ServeConfig, min_request_bytes
from musegl_core.errors import ConfigError

BAD = [
    (["--max-context", "1"], "--max-context must be between 2"),
    (["--max-context", "2147483648"], "--max-context must be between 2"),
    (["--max-context", "abc"], "expected an integer"),
    (["--max-sessions", "0"], "--max-sessions"),
    (["--max-inflight-requests", "0"], "--max-inflight-requests"),
    (["--max-inflight-requests", "2147483648"], "--max-inflight-requests"),
    (["--max-decode-sequences", "0"], "--max-decode-sequences"),
    (["--max-prefill-chunk", "0"], "--max-prefill-chunk"),
    (["--solo-prefill-chunk", "0"], "--solo-prefill-chunk"),
    (["--prefill-stall-factor", "0.5"], "--prefill-stall-factor must be 0 (off) or at least 1"),
    (["--prefill-stall-factor", "nan"], "--prefill-stall-factor"),
    (["--max-image-bytes", "0"], "--max-image-bytes"),
    (["--max-image-bytes", str(20 * 2**20 + 1)], "--max-image-bytes"),
    (["--max-request-bytes", str(32 * 2**20 + 1)], "--max-request-bytes"),
    (["--max-request-bytes", "100000"], "4*ceil(max_image_bytes/3)+1024"),
    (["--max-vision-patches", "3"], "--max-vision-patches"),
    (["--prefix-cache-entries", "-1"], "--prefix-cache-entries"),
    (["--streaming-preflight-timeout", "0"], "--streaming-preflight-timeout"),
    (["--streaming-preflight-timeout", "nan"], "--streaming-preflight-timeout"),
    (["--port", "70000"], "--port"),
    (["--tool-parser", "nosuch"], "no tool parser named 'nosuch'"),
    (["--api-dialect", "nosuch"], "no dialect named 'nosuch'"),
    (["--plugin", "nosuch"], "plugin 'nosuch' is not installed"),
    (["/definitely/not/here.gguf"], "does not exist"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout"),
    (["--served-model-name", "has space"], "--served-model-name"),
    (["--served-model-name", "ok", "--served-model-name", ""], "--served-model-name"),
    (["--cors-allow-origin", " "], "--cors-allow-origin"),
    (["--max-queued-requests", "-1"], "--max-queued-requests must be between 0"),
    (["--sessions-api", "maybe"], "expected on or off"),
    (["--seed", "-1"], "--seed must be between 0"),
    (["--throughput-log-interval", "-1"], "--throughput-log-interval"),
    (["--chat-template", "template.jinja"], "not a Jinja template file or text"),
    (["--max-model-len", "1"], "--max-context must be between 2"),
    (["--spec-verify-rows", "-1"], "--spec-verify-rows must be 0 (no limit) or a number of rows"),
]


@pytest.mark.parametrize("argv,reason", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_serve_values_exit_2_with_one_line(argv, reason):
    proc = subprocess.run(
        [sys.executable, "-m", "musegl_core.cli.main", "serve", *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert reason in lines[0]


def test_the_verify_rows_budget_reaches_the_engine():
    from musegl_core.cli.serve import build_parser, config_from_args
    from musegl_core.engine.engine import EngineConfig

    assert EngineConfig.from_serve(ServeConfig().validate()).spec_verify_rows is None  # the executor's
    parser = build_parser()
    for flag, value in (("64", 64), ("0", 0)):
        config = config_from_args(parser.parse_args(["--spec-verify-rows", flag]), parser).validate()
        assert EngineConfig.from_serve(config).spec_verify_rows == value


def test_request_bytes_floor_follows_image_bytes():
    assert min_request_bytes(3) == 4 + 1024
    small = ServeConfig(max_image_bytes=3000, max_request_bytes=min_request_bytes(3000)).validate()
    assert small.max_request_bytes == 5024


def test_defaults_are_the_seeds():
    c = ServeConfig().validate()
    assert (c.max_sessions, c.max_inflight_requests, c.max_decode_sequences) == (4, 4, 4)
    assert c.max_image_bytes == 20 * 2**20 and c.max_request_bytes == 32 * 2**20
    assert c.max_vision_patches == 4096 and c.prefix_cache_entries == 0
    assert c.host == "127.0.0.1"
    assert c.shutdown_timeout == 5.0 and c.cors_allow_origins == ()


def test_served_model_names_first_is_the_id_the_rest_aliases():
    from musegl_core.cli.serve import build_parser, config_from_args

    parser = build_parser()
    args = parser.parse_args(["--served-model-name", "a", "--served-model-name", "b", "--served-model-name", "a",
                              "--cors-allow-origin", "https://x", "--cors-allow-origin", "*"])
    config = config_from_args(args, parser)
    assert (config.served_model_name, config.served_model_aliases) == ("a", ("b",))
    assert config.cors_allow_origins == ("https://x", "*")


def test_kv_cache_dtype_flag_and_the_executors_that_refuse_it():
    from musegl_core.cli.serve import build_parser, config_from_args
    from musegl_core.engine.kv_dtype import check_kv_cache_dtype
    from musegl_core.plugins.specs import ExecutorSpec

    parser = build_parser()
    assert ServeConfig().validate().kv_cache_dtype == "auto"
    assert config_from_args(parser.parse_args(["--kv-cache-dtype", "fp8"]), parser).validate().kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be auto or fp8"):
        ServeConfig(kv_cache_dtype="fp16").validate()
    plain = ExecutorSpec(name="plain", description="", create=lambda options: None)
    check_kv_cache_dtype("auto", plain)
    with pytest.raises(ConfigError) as refused:
        check_kv_cache_dtype("fp8", plain)
    assert "the plain executor keeps K/V in its activation dtype only" in str(refused.value)
    assert "\n" not in str(refused.value)
    check_kv_cache_dtype("fp8", attrs.evolve(plain, kv_cache_dtypes=("auto", "fp8")))
