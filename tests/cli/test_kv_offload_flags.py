"""``--kv-offload-dir`` and ``--kv-offload-disk``: parsed like the other SIZE flags, validated before loading."""

from __future__ import annotations

import pytest

from musegl_core.config import ServeConfig
from musegl_core.errors import ConfigError
from musegl_core.testing.files import unwritable_dir


def parse(*argv: str) -> ServeConfig:
    from musegl_core.cli.serve import build_parser, config_from_args

    parser = build_parser()
    return config_from_args(parser.parse_args(list(argv)), parser).validate()


def test_the_disk_tier_flags_parse_sizes(tmp_path):
    config = parse("--kv-offload-dir", str(tmp_path / "kv"), "--kv-offload-disk", "1.5GiB")
    assert (config.kv_offload_dir, config.kv_offload_disk) == (str(tmp_path / "kv"), 3 << 29)
    assert parse().kv_offload_dir is None and parse().kv_offload_disk is None


def test_a_bad_size_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse("--kv-offload-dir", str(tmp_path), "--kv-offload-disk", "lots")
    assert "expected a size such as 512MiB or 24GiB, got 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize("fields, message", [
    (dict(kv_offload_disk=1 << 30), "--kv-offload-disk needs --kv-offload-dir PATH"),
    (dict(kv_offload_dir="DIR"), "--kv-offload-dir needs --kv-offload-disk SIZE"),
    (dict(kv_offload_dir="DIR", kv_offload_disk=0), "--kv-offload-disk must be positive"),
    (dict(kv_offload_dir="DIR/file", kv_offload_disk=1 << 30), "is not a directory"),
])
def test_the_disk_tier_flags_are_checked_together(tmp_path, fields, message):
    (tmp_path / "file").write_text("x")
    fields = {k: v.replace("DIR", str(tmp_path)) if isinstance(v, str) else v for k, v in fields.items()}
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**fields).validate()


def test_an_unwritable_directory_is_refused(tmp_path):
    with unwritable_dir(tmp_path) as locked, pytest.raises(ConfigError, match="is not writable"):
        ServeConfig(kv_offload_dir=str(locked), kv_offload_disk=1 << 30).validate()
