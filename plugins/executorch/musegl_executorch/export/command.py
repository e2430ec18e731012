"""``musegl export MODEL -o OUTDIR``: the checkpoint as an ExecuTorch program with
the off-graph KV ABI (``model.pte`` + ``model.ptd`` + ``musegl-export.json`` +
the tokenizer files)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from musegl_core.errors import ConfigError

DEFAULT_FORWARD_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_MAX_PREFILL_CHUNK = 512
DEFAULT_MAX_CELLS = 65536
DEFAULT_VISION_PATCHES = 1024
DEFAULT_DRAFT_OWNERS = 8
DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = {"none": "none", "int8": "int8-weight-only"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a GGUF file or a Hugging Face directory")
    parser.add_argument("-o", "--output-dir", required=True, metavar="OUTDIR",
                        help="where model.pte, model.ptd, musegl-export.json and the tokenizer go")
    parser.add_argument("--forward-sizes", default=",".join(map(str, DEFAULT_FORWARD_SIZES)), metavar="N,N,...",
                        help="decode widths exported as static methods forward_{N} (default %(default)s; "
                             "'none': only forward_others)")
    parser.add_argument("--max-prefill-chunk", type=int, default=DEFAULT_MAX_PREFILL_CHUNK, metavar="N",
                        help="most positions one forward_others call processes (default %(default)s); longer "
                             "chunks run as several calls")
    parser.add_argument("--activation-dtype", choices=DTYPES, default="float32",
                        help="dtype of activations, weights and the KV pool (default %(default)s)")
    parser.add_argument("--quantize", choices=tuple(QUANTIZATIONS), default="none",
                        help="int8: weight-only int8 linear layers (symmetric, per output channel)")
    parser.add_argument("--max-cells", type=int, default=DEFAULT_MAX_CELLS, metavar="N",
                        help="most KV pool cells (blocks x 16 positions) the program accepts (default %(default)s)")
    parser.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                        help="ignored: the program takes the checkpoint's native context (a value warns)")
    parser.add_argument("--mmproj", default=None, metavar="PROJECTOR",
                        help="vision projector GGUF (llama.cpp's mmproj-*.gguf) of a GGUF MODEL: the program gains "
                             "vision_encoder, embed_text and forward_from_embeddings (a Hugging Face MODEL with "
                             "vision weights gets them without it)")
    parser.add_argument("--max-vision-patches", type=int, default=DEFAULT_VISION_PATCHES, metavar="N",
                        help="most ViT patches one image may have, the vision encoder's capacity (default "
                             "%(default)s; the server clips its --max-vision-patches to it)")
    parser.add_argument("--dflash", default=None, metavar="DRAFT",
                        help="a DFlash draft (Hugging Face directory or DFlash GGUF) of MODEL: the token methods also "
                             "return the draft's tapped layers and the program gains draft_context and draft_block "
                             "(serve it with musegl serve OUTDIR --dflash OUTDIR)")
    parser.add_argument("--max-draft-owners", type=int, default=DEFAULT_DRAFT_OWNERS, metavar="N",
                        help="most blocks one draft_block call drafts (default %(default)s; more decoding sequences "
                             "run as several calls)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="processes that export and lower the methods side by side (default: 2 when this "
                             "process may use two cores or more, else 1); each holds its own copies of the "
                             "weights while it lowers")
    parser.add_argument("--sliding-pages", action="store_true",
                        help="export for --sliding-window-kv: K/V pools of layer groups, so sliding layers keep "
                             "only their window (docs/executorch.md); such a program also serves without it")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export in OUTDIR")


def parse_sizes(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise ConfigError(f"--forward-sizes must be comma-separated integers or 'none', got {text!r}") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > 4096:
        raise ConfigError(f"--forward-sizes must list widths between 1 and 4096, got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    sizes = parse_sizes(args.forward_sizes)
    if args.max_prefill_chunk < 1:
        raise ConfigError(f"--max-prefill-chunk must be at least 1, got {args.max_prefill_chunk}")
    if args.max_cells < 16:
        raise ConfigError(f"--max-cells must be at least 16 (one block), got {args.max_cells}")
    if args.max_seq_len is not None:  # said before the checkpoint loads
        print(f"musegl export: warning: --max-seq-len {args.max_seq_len} is ignored; the export uses the "
              f"checkpoint's native context", file=sys.stderr, flush=True)
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"-o {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise ConfigError(f"-o {out}: the directory is not empty (give --overwrite to replace an export)")
    if not os.path.exists(args.model):
        raise ConfigError(f"model path {args.model!r} does not exist")
    if args.mmproj is not None and not os.path.isfile(args.mmproj):
        raise ConfigError(f"--mmproj {args.mmproj!r} is not a file")
    if args.max_vision_patches < 4 or args.max_vision_patches % 4:
        raise ConfigError(f"--max-vision-patches must be a positive multiple of 4, got {args.max_vision_patches}")
    if args.dflash is not None and not os.path.exists(args.dflash):
        raise ConfigError(f"--dflash {args.dflash!r} does not exist")
    if args.max_draft_owners < 1:
        raise ConfigError(f"--max-draft-owners must be at least 1, got {args.max_draft_owners}")
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {args.jobs}")

    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.servable import one_line
    from musegl_core.checkpoint.vision import load_vision
    from musegl_core.tokenizer import MuseTokenizer

    try:
        checkpoint = load_checkpoint(args.model)
        tokenizer = MuseTokenizer.load(args.model)
    except Exception as exc:
        raise ConfigError(f"cannot export {args.model!r}: {one_line(exc)}") from None
    try:
        vision = load_vision(args.model, args.mmproj, checkpoint.config.hidden_size)
    except Exception as exc:
        checkpoint.close()
        raise ConfigError(f"cannot export the vision projector {args.mmproj or args.model!r}: {one_line(exc)}") from None
    config = checkpoint.config
    check_exportable(config, sizes, args.max_prefill_chunk, args.max_cells)
    if args.dflash is not None:
        check_draft(args.dflash, config)

    from musegl_executorch.export.build import build_artifact
    from musegl_executorch.export.workers import default_jobs

    jobs = args.jobs or default_jobs()
    started, cpu = time.perf_counter(), _cpu_seconds()
    print(f"exporting {os.path.basename(os.path.normpath(args.model))} ({jobs} process{'es' if jobs > 1 else ''})",
          file=sys.stderr, flush=True)
    with method_bars() as progress:
        try:
            manifest = build_artifact(checkpoint, tokenizer, out, forward_sizes=sizes,
                                      max_prefill_chunk=args.max_prefill_chunk, max_cells=args.max_cells,
                                      activation_dtype=args.activation_dtype,
                                      quantization=QUANTIZATIONS[args.quantize], method_progress=progress,
                                      vision_weights=vision, vision_patches=args.max_vision_patches,
                                      vision_source=str(args.mmproj or args.model) if vision else "",
                                      draft_path=args.dflash, draft_owners=args.max_draft_owners, jobs=jobs,
                                      sliding_pages=args.sliding_pages)
        finally:
            checkpoint.close()
            if vision is not None:
                vision.close()
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    sizes_on_disk = {name: (out / name).stat().st_size for name in (manifest.program, manifest.data)}
    print(json.dumps({"output_dir": str(out), "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "bytes": sizes_on_disk,
                      "methods": list(manifest.methods), "native_context": manifest.limits.native_context,
                      "vision_patches": manifest.vision.max_patches if manifest.vision else None,
                      "dflash_block": manifest.dflash.max_block if manifest.dflash else None}))
    return 0


def _cpu_seconds() -> float:
    """CPU time of this process and of its ended children (the lowering workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@contextlib.contextmanager
def method_bars() -> Iterator[Callable[[str, int, int, str], None]]:
    """A rich progress bar per method on stderr, in the order the methods first report;
    yields ``progress(method, done, total, what)`` (callable from any thread)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from musegl_executorch.export.workers import WAITING

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[what]}", style="dim"), TimeElapsedColumn(),
                  console=Console(file=sys.stderr), transient=False) as bar:
        tasks: dict[str, int] = {}
        lock = threading.Lock()

        def update(method: str, done: int, total: int, what: str = "") -> None:
            with lock:
                if method not in tasks:
                    tasks[method] = bar.add_task(method, total=total, what=what, start=False)
                task = tasks[method]
                if what != WAITING:
                    bar.start_task(task)  # the clock runs from the method's first step
                bar.update(task, completed=done, total=total, what=what)

        yield update


def check_exportable(config, sizes: tuple[int, ...], max_prefill_chunk: int, max_cells: int) -> None:
    """One line for a configuration the off-graph program cannot express."""
    native = config.max_position_embeddings
    if not isinstance(native, int) or native < 2:
        raise ConfigError(f"the checkpoint declares no usable native context (max_position_embeddings={native!r})")
    if config.num_heads % config.num_kv_heads:
        raise ConfigError(f"{config.num_heads} attention heads are not a multiple of {config.num_kv_heads} KV heads")
    if config.head_dim % 2:
        raise ConfigError(f"head_dim {config.head_dim} is odd; RoPE needs an even head size")
    if config.sliding_window < 1:
        raise ConfigError(f"sliding_window {config.sliding_window} must be positive")
    if max_prefill_chunk > native:
        raise ConfigError(f"--max-prefill-chunk {max_prefill_chunk} exceeds the native context {native}")
    if sizes and sizes[-1] * 16 > max_cells:
        raise ConfigError(f"--forward-sizes up to {sizes[-1]} need at least {sizes[-1] * 16} --max-cells")


def check_draft(path: str, config) -> None:
    """One line for a DFlash draft that does not fit the target (the serve-time checks)."""
    from musegl_dflash.checkpoint import read_draft_config
    from musegl_dflash.plugin import DFlashOptions, TargetShape, resolve

    try:
        draft = read_draft_config(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--dflash {path}: {exc}") from None
    resolve(DFlashOptions(draft=path), draft, TargetShape(config.vocab_size, config.hidden_size, config.num_layers))
