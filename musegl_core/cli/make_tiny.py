"""Write a deterministic tiny random Muse Glimmer checkpoint (GGUF + tokenizer)."""

from __future__ import annotations

from musegl_core.cli.main import OneLineParser


def main(argv: list[str]) -> int:
    from musegl_core import tiny

    p = OneLineParser(prog="musegl make-tiny", description=__doc__)
    p.add_argument("outdir", help="folder to write model.gguf and tokenizer.json into")
    p.add_argument("--preset", default="tiny", choices=sorted(tiny.PRESETS), help="size preset (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--file-type", default=None, choices=["f32", "f16", "bf16", "q8_0"], help="tensor type of the matrices")
    p.add_argument("--mmproj", action="store_true",
                   help="also write mmproj.gguf, a tiny random vision projector (serve it with --mmproj)")
    args = p.parse_args(argv)
    kwargs = {"preset": args.preset, "seed": args.seed, "progress": True, "mmproj": args.mmproj}
    if args.file_type:
        kwargs["file_type"] = args.file_type
    path = tiny.make_tiny(args.outdir, **kwargs)
    print(path)
    if args.mmproj:
        print(path.parent / "mmproj.gguf")
    return 0
