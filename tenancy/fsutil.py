"""Durable file replacement helpers shared by tenancy's key files and its service."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries to disk, so that a rename or link into it survives a crash.

    Best effort: a platform or file system that cannot open or sync a directory is skipped,
    because the file itself was already synced and only the name's durability is at stake.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
