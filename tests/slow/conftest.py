"""Slow suite (``pytest -m slow``): shares the security suite's environment and helpers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))

import pytest  # noqa: E402
from security_helpers import make_home  # noqa: E402  (sets the offline environment on import)


@pytest.fixture(scope="session")
def slow_home(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    return make_home(tmp_path_factory.mktemp("slow-home"))
