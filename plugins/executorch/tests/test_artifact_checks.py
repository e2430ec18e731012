"""What ``musegl serve`` refuses about an export before any program loads (fast: the
checks read the manifest only): ``--mmproj`` given to a text-only export and to an
export that already holds its vision encoder, each one line with exit status 2."""

from __future__ import annotations

import pytest

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.cli.main import main
from musegl_core.tiny import tiny_vision_config
from musegl_executorch.artifact import ABI, FORMAT, MANIFEST, ExportLimits, Manifest, VisionExport


def artifact(directory, config, vision) -> None:
    directory.mkdir()
    manifest = Manifest(format=FORMAT, abi=ABI, name="t", config=config, activation_dtype="float32",
                        quantization="none", limits=ExportLimits(1024, 32, 4096, (1,)),
                        methods=("forward_1", "forward_others"), inputs=(), outputs=(), vision=vision)
    (directory / MANIFEST).write_text(manifest.dump())
    for name in ("model.pte", "model.ptd"):
        (directory / name).write_bytes(b"")


@pytest.mark.parametrize("kind", ["text-only", "with-vision"])
def test_mmproj_given_to_an_export_is_one_line_exit_2(tiny_hf, tmp_path, capsys, kind):
    config = load_checkpoint(tiny_hf.path).config
    vision = VisionExport(tiny_vision_config(config), 256, "proj.gguf") if kind == "with-vision" else None
    artifact(tmp_path / "export", config, vision)
    projector = tmp_path / "mmproj.gguf"
    projector.write_bytes(b"GGUF")
    assert main(["serve", str(tmp_path / "export"), "--mmproj", str(projector), "--max-context", "256"]) == 2
    err = capsys.readouterr().err
    expected = "is a text-only export (no vision encoder)" if vision is None else "already holds its vision encoder"
    assert err.count("\n") == 1 and expected in err, err
