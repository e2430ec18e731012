"""Build a plugin's C source once per machine and load it with ctypes.

Plugins that need a few native functions (the torch-cpu executor's
stored-weight kernels, the MLX plugin's BLAS shim) ship the C source as
package data and build it at first use with the system C compiler
(``$CC``, else ``cc``, else ``gcc``). The library lands in the musegl cache
(``$MUSEGL_CACHE_DIR``, default the user cache dir) under ``kernels/``, named
by a hash of the source, the flags and the compiler, so an edited source or a
new compiler builds a new file and concurrent builders never see half a file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence


class BuildError(Exception):
    """The library cannot be built or loaded here; ``str()`` is one line saying why."""


def compiler() -> str | None:
    """The C compiler to use, or None when the machine has none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def cache_dir() -> Path:
    from musegl_core.tiny import cache_root

    return cache_root() / "kernels"


def build(source: Path, flags: Sequence[str], what: str) -> Path:
    """The shared library built from ``source`` with ``flags`` (``-shared -fPIC`` are
    added), built now unless the cache has it. ``what`` names it in errors."""
    cc = compiler()
    if cc is None:
        raise BuildError(f"no C compiler (cc/gcc) to build {what}")
    try:
        text = source.read_bytes()
    except OSError as exc:
        raise BuildError(f"the source of {what} ({source.name}) is not installed ({exc.strerror})") from exc
    flags = (*flags, "-shared", "-fPIC")
    key = hashlib.sha256(text + " ".join(flags).encode() + cc.encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([cc, *flags, "-o", str(out), str(source)], capture_output=True, text=True)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout or "").strip().splitlines()
            raise BuildError(f"building {what} failed: {lines[-1] if lines else f'exit {done.returncode}'}")
        os.replace(out, target)  # atomic: concurrent builders each publish a whole file
    return target
