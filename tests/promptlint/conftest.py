"""Shared setup for the promptlint tests: offline environment, a CLI runner, repository paths."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from promptlint.tokens import ensure_tiktoken_cache
from tests.promptlint.promptlint_paths import REPO

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ensure_tiktoken_cache()



@dataclass
class Run:
    code: int
    out: str
    err: str


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Run ``promptlint`` in-process with the repository root as working directory."""
    from promptlint.cli import main

    def run(*argv: str, cwd: Path = REPO) -> Run:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse usage errors
            code = exc.code if isinstance(exc.code, int) else 2
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run
