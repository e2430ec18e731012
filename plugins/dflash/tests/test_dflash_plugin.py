"""The plugin's flags: a draft that does not fit the target, or a draft size it cannot
make, is refused at start-up with one line and exit status 2 (``musegl serve``
before the worker starts, ``musegl generate`` when it loads)."""

from __future__ import annotations

import pytest

from dflash_support import build_reference_draft, save_draft
from musegl_core.errors import ConfigError
from musegl_dflash.checkpoint import read_draft_config
from musegl_dflash.plugin import DFlashOptions, TargetShape, resolve

DEMO = TargetShape(vocab_size=202048, hidden_size=64, num_layers=4)


@pytest.fixture(scope="module")
def demo_draft(tmp_path_factory):
    return save_draft(build_reference_draft(), tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def demo_model():
    from musegl_core.tiny import default_model_path

    return str(default_model_path())


def one_line(message: str) -> bool:
    return "\n" not in message and message.strip() == message


@pytest.mark.parametrize("n, expected", [(None, 15), (0, 15), (1, 1), (15, 15)])
def test_draft_size_defaults_to_the_block_size_minus_one(demo_draft, n, expected):
    assert resolve(DFlashOptions(str(demo_draft), n), read_draft_config(demo_draft), DEMO) == expected


@pytest.mark.parametrize("n", [16, 40, -1])
def test_draft_sizes_the_block_cannot_hold_are_refused(demo_draft, n):
    with pytest.raises(ConfigError, match="--dflash-n-draft must be between 1 and 15") as info:
        resolve(DFlashOptions(str(demo_draft), n), read_draft_config(demo_draft), DEMO)
    assert one_line(str(info.value))


@pytest.mark.parametrize("override, match", [
    (dict(hidden_size=32, head_dim=8), "hidden size 32 does not match the target's 64"),
    (dict(mask_token_id=202048), "mask token 202048 is outside the target's vocabulary"),
    (dict(target_layer_ids=[0, 1, 4]), r"reads target layers \[0, 1, 4\] but the target has 4 layers"),
])
def test_a_draft_that_does_not_fit_the_target_is_refused(tmp_path, override, match):
    path = save_draft(build_reference_draft(**override), tmp_path / "bad")
    with pytest.raises(ConfigError, match=match) as info:
        resolve(DFlashOptions(str(path)), read_draft_config(path), DEMO)
    assert one_line(str(info.value))


def test_a_gguf_draft_for_another_vocabulary_is_refused(tmp_path):
    from musegl_core.testing.reference_models import tiny_tokenizer_data

    path = save_draft(build_reference_draft(mask_token_id=500), tmp_path / "g", gguf=True,
                      tokenizer=tiny_tokenizer_data())
    with pytest.raises(ConfigError, match="made for a vocabulary of 512 tokens; the target has 202048"):
        resolve(DFlashOptions(str(path)), read_draft_config(path), DEMO)


def run_cli(argv, capsys) -> tuple[int, str]:
    from musegl_core.cli.main import main

    code = main(argv)
    return code, capsys.readouterr().err.strip()


def test_serve_exits_2_before_the_worker_starts(demo_draft, demo_model, capsys):
    code, err = run_cli(["serve", demo_model, "--dflash", str(demo_draft), "--dflash-n-draft", "16"], capsys)
    assert code == 2 and one_line(err) and "--dflash-n-draft must be between 1 and 15" in err
    code, err = run_cli(["serve", demo_model, "--dflash-n-draft", "3"], capsys)
    assert code == 2 and "--dflash-n-draft needs --dflash DRAFT" in err
    code, err = run_cli(["serve", demo_model, "--dflash", "/nonexistent/draft"], capsys)
    assert code == 2 and one_line(err) and "no such draft checkpoint" in err


def test_generate_takes_the_flags_and_refuses_the_same(demo_draft, demo_model, capsys):
    import json

    code, err = run_cli(["generate", "--model", demo_model, "--dflash", str(demo_draft), "--dflash-n-draft", "99",
                         "Hello"], capsys)
    assert code == 2 and "--dflash-n-draft must be between 1 and 15" in err
    outputs = []
    for flags in ([], ["--dflash", str(demo_draft), "--dflash-n-draft", "4"]):
        from musegl_core.cli.main import main

        assert main(["generate", "--model", demo_model, "--json", "--max-tokens", "12", *flags, "Hello"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
    assert outputs[0]["speculation"]["drafted_tokens"] == 0 < outputs[1]["speculation"]["drafted_tokens"]


def test_a_bare_target_config_served_dummy_is_checked_without_weights(demo_draft, tiny_hf, tmp_path):
    """``--load-format dummy`` on a directory with only a config.json: the target's shape
    comes from the config alone (the tiny target's 512 tokens cannot hold the draft's mask token)."""
    from musegl_core.plugins.specs import ExecutorOptions
    from musegl_dflash.plugin import check

    (tmp_path / "config.json").write_text((tiny_hf.path / "config.json").read_text())
    options = ExecutorOptions(str(tmp_path), extra={"dflash": str(demo_draft), "load_format": "dummy"})
    with pytest.raises(ConfigError, match="outside the target's vocabulary of 512 tokens"):
        check(options)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):  # without dummy, the weights are opened
        check(ExecutorOptions(str(tmp_path), extra={"dflash": str(demo_draft)}))
