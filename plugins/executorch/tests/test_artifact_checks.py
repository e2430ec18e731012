"""What ``musegl serve`` refuses about an export before any program loads (fast: the
checks read the manifest only): ``--mmproj`` given to a text-only export and to an
export that already holds its vision encoder; ``--dflash`` given to an export without
a draft, a draft checkpoint given to an export that holds its own, another export's
draft program, a draft program that does not fit its target and a ``--dflash-n-draft``
beyond the exported block; each one line with exit status 2."""

from __future__ import annotations

import pytest

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.cli.main import main
from musegl_core.tiny import tiny_vision_config
from musegl_dflash.checkpoint import DraftConfig
from musegl_executorch.artifact import (ABI, FORMAT, MANIFEST, VISION_INPUTS, DFlashExport, ExportLimits, Manifest,
                                        VisionExport)


def artifact(directory, config, vision, dflash=None, source="") -> None:
    directory.mkdir()
    manifest = Manifest(format=FORMAT, abi=ABI, name="t", config=config, activation_dtype="float32",
                        quantization="none", limits=ExportLimits(1024, 32, 4096, (1,)),
                        methods=("forward_1", "forward_others"), inputs=(), outputs=(), vision=vision,
                        dflash=dflash, source=source)
    (directory / MANIFEST).write_text(manifest.dump())
    for name in ("model.pte", "model.ptd"):
        (directory / name).write_bytes(b"")


@pytest.mark.parametrize("kind", ["text-only", "with-vision"])
def test_mmproj_given_to_an_export_is_one_line_exit_2(tiny_hf, tmp_path, capsys, kind):
    config = load_checkpoint(tiny_hf.path).config
    vision = VisionExport(tiny_vision_config(config), 256, "proj.gguf", VISION_INPUTS) if kind == "with-vision" \
        else None
    artifact(tmp_path / "export", config, vision)
    projector = tmp_path / "mmproj.gguf"
    projector.write_bytes(b"GGUF")
    assert main(["serve", str(tmp_path / "export"), "--mmproj", str(projector), "--max-context", "256"]) == 2
    err = capsys.readouterr().err
    expected = "is a text-only export (no vision encoder)" if vision is None else "already holds its vision encoder"
    assert err.count("\n") == 1 and expected in err, err


def test_an_export_whose_encoder_takes_a_whole_image_mask_is_refused(tiny_hf, tmp_path, capsys):
    """An --mmproj export made before the windowed encoder: its manifest lists no vision inputs."""
    config = load_checkpoint(tiny_hf.path).config
    artifact(tmp_path / "export", config, VisionExport(tiny_vision_config(config), 256, "proj.gguf"))
    assert main(["serve", str(tmp_path / "export"), "--max-context", "256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a whole-image mask" in err and "re-export it" in err, err


def draft_export(config, **changes) -> DFlashExport:
    fields = dict(hidden_size=config.hidden_size, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=16, target_layer_ids=(0, 2), sliding=(True,), sliding_window=16, block_size=8,
                  mask_token_id=500)
    return DFlashExport(DraftConfig(**{**fields, **changes}), max_owners=4, context_keys=16, source="draft-hf")


@pytest.mark.parametrize("case", ["no-draft", "checkpoint-draft", "other-export", "misfit", "n-draft"])
def test_dflash_given_to_an_export_is_checked_before_loading(tiny_hf, tmp_path, capsys, case):
    config = load_checkpoint(tiny_hf.path).config
    served = tmp_path / "export"
    draft = None if case == "no-draft" else draft_export(config, **(
        {"target_layer_ids": (0, 9)} if case == "misfit" else {}))
    artifact(served, config, None, draft, source="target.gguf")
    flag, extra = str(served), []
    if case == "checkpoint-draft":
        flag = str(tmp_path / "draft-hf")
        (tmp_path / "draft-hf").mkdir()
    elif case == "other-export":
        artifact(tmp_path / "other", config, None, draft_export(config), source="another.gguf")
        flag = str(tmp_path / "other")
    elif case == "n-draft":
        extra = ["--dflash-n-draft", "8"]
    assert main(["serve", str(served), "--dflash", flag, *extra, "--max-context", "256"]) == 2
    err = capsys.readouterr().err
    expected = {"no-draft": "was exported without a DFlash draft",
                "checkpoint-draft": f"already holds its DFlash draft (exported from draft-hf); serve it with "
                                    f"--dflash {served}",
                "other-export": "belongs to the export of another.gguf",
                "misfit": "the draft reads target layers [0, 9] but the target has 6 layers",
                "n-draft": "--dflash-n-draft must be between 1 and 7"}[case]
    assert err.count("\n") == 1 and expected in err, err


def test_export_refuses_a_draft_that_does_not_fit_the_target(tiny_gguf, tmp_path, capsys):
    """``musegl export --dflash``: the serve-time checks, before anything is traced."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    config = MuseGlimmerAssistantConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=4,
                                        mask_token_id=500, target_layer_ids=[0, 7])
    MuseGlimmerAssistantModel(config).save_pretrained(tmp_path / "draft")
    capsys.readouterr()
    assert main(["export", str(tiny_gguf), "-o", str(tmp_path / "out"), "--dflash", str(tmp_path / "draft")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reads target layers [0, 7] but the target has 6 layers" in err, err
    assert not (tmp_path / "out").exists()


def test_a_manifest_whose_abi_and_sliding_pages_disagree_is_refused(tiny_hf, tmp_path):
    """A program exported with --sliding-pages names its own ABI (a server that does not know it
    refuses the program instead of misreading its pools); the manifest must say both or neither."""
    import attrs

    from musegl_core.errors import ConfigError
    from musegl_executorch.artifact import SLIDING_ABI, read_manifest

    config = load_checkpoint(tiny_hf.path).config
    artifact(tmp_path / "plain", config, None)
    assert read_manifest(str(tmp_path / "plain")).sliding_pages is False
    for name, abi, sliding, ok in (("paged", SLIDING_ABI, True, True), ("half", SLIDING_ABI, False, False),
                                   ("other", ABI, True, False)):
        artifact(tmp_path / name, config, None)
        manifest = attrs.evolve(read_manifest(str(tmp_path / name)), abi=abi, sliding_pages=sliding)
        (tmp_path / name / MANIFEST).write_text(manifest.dump())
        if ok:
            assert read_manifest(str(tmp_path / name)).sliding_pages
        else:
            with pytest.raises(ConfigError, match="malformed manifest"):
                read_manifest(str(tmp_path / name))
