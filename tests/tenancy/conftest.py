"""Shared fixtures: a TenancyService on a fresh home directory, nothing on the network."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tenancy.service import TenancyService  # noqa: E402


@pytest.fixture(autouse=True)
def _no_kek_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests choose their KEK source explicitly; an operator's env must not leak in."""
    monkeypatch.delenv("PREFIXGATE_KEK", raising=False)
    monkeypatch.delenv("PREFIXGATE_KEK_FILE", raising=False)
    monkeypatch.delenv("PREFIXGATE_REFERENCE_MODEL", raising=False)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def svc(home: Path) -> Iterator[TenancyService]:
    s = TenancyService.open(home, auth_cache_ttl_s=0.2)
    yield s
    s.close()
