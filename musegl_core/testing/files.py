"""Files and folders for tests."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def unwritable_dir(parent: Path) -> Iterator[Path]:
    """A new folder ``parent/locked`` that this user can read but not write (mode 0500), made
    writable again afterwards (so the test's temporary folder can be removed). Skips the test
    when the user writes there all the same (root without the usual restrictions)."""
    import pytest

    locked = Path(parent) / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user that writes anywhere")
        yield locked
    finally:
        locked.chmod(0o700)
