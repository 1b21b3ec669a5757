"""The light install for real: a fresh venv, `pip install <checkout>`, then promptlint lints the examples.

Slow (a venv and a pip run, ~10-30 s on a loaded 2-core box) and needs pip to reach a package index
(PyPI or the machine's local mirror). Prints the time and size it measured: docs/promptlint.md and
README.md state the figures of one such run.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "transformers", "litellm", "fastapi", "safetensors")

pytestmark = pytest.mark.slow


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _tiktoken_cache() -> str:
    """litellm's bundled encodings (this test venv has litellm; the light venv must not need network)."""
    spec = importlib.util.find_spec("litellm")
    assert spec is not None and spec.submodule_search_locations
    return str(Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers")


def test_a_fresh_venv_gets_a_working_promptlint_without_heavy_packages(tmp_path):
    # Install from a copy: building in the checkout would leave build/ and *.egg-info behind.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "tests", "benchmarks", "__pycache__", ".*_cache", ".hypothesis"))
    bare, venv = tmp_path / "bare", tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(bare)], check=True, timeout=300)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    start = time.monotonic()
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", str(src)], capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    assert res.returncode == 0, res.stderr[-3000:]
    added_mb = (_size(venv) - _size(bare)) / 2**20
    print(f"\nlight install: {seconds:.1f} s, +{added_mb:.0f} MB over an empty venv ({_size(venv) / 2**20:.0f} MB)")
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format", "freeze"], capture_output=True, text=True,
                            check=True, timeout=300).stdout.lower()
    names = {line.split("==")[0] for line in listed.splitlines()}
    assert not names & set(HEAVY), names & set(HEAVY)
    assert added_mb < 100  # the full stack is ~2.8 GB
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": _tiktoken_cache()}
    env.pop("PYTHONPATH", None)
    lint = subprocess.run([str(venv / "bin" / "promptlint"), "check", "prompts", "--format", "json"],
                          cwd=REPO / "examples", env=env, capture_output=True, text=True, timeout=300)
    assert lint.returncode == 1 and '"findings"' in lint.stdout, lint.stderr  # the examples hold findings on purpose
    gate = subprocess.run([str(venv / "bin" / "prefixgate"), "--help"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert gate.returncode == 2 and "prefixgate[all]" in gate.stderr and "Traceback" not in gate.stderr
