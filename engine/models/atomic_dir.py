"""Write a checkpoint directory atomically: readers see the old one or the new one, never half.

Both offline builders (the tiny random model, the converted SmolLM2) write into a sibling temp
directory and rename it into place; a failure anywhere removes the temp directory and leaves what
was there untouched.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(out_dir: Path) -> Iterator[Path]:
    """Yield an empty sibling temp directory; on a clean exit it replaces ``out_dir``."""
    out_dir = Path(out_dir).expanduser().resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        trash = None
        if out_dir.exists():  # renamed aside first: a rename onto a non-empty directory fails
            trash = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, trash)
        os.rename(tmp, out_dir)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
