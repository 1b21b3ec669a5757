"""Where a benchmark's figures came from: the commit of the tree that produced them.

Shared by the benchmark scripts that record ``git_commit`` in their JSON (one definition, so a
dirty tree is marked the same way everywhere). On the GPU machines the tree arrives without its
``.git``: ``PREFIXGATE_COMMIT`` names the commit there, and wins wherever it is set.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_commit(root: Path = ROOT) -> str:
    """``$PREFIXGATE_COMMIT`` if set, else HEAD of ``root``'s checkout, ``-dirty`` when the work
    tree differs; ``unknown`` without git."""
    if os.environ.get("PREFIXGATE_COMMIT"):
        return os.environ["PREFIXGATE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root).returncode != 0
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
