"""Where a benchmark's figures came from: the commit of the tree that produced them.

Shared by the benchmark scripts that record ``git_commit`` in their JSON (one definition, so a
dirty tree is marked the same way everywhere).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_commit(root: Path = ROOT) -> str:
    """HEAD of ``root``'s checkout, ``-dirty`` when the work tree differs; ``unknown`` without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root).returncode != 0
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
