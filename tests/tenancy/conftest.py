"""Shared fixtures: a TenancyService on a fresh home directory, nothing on the network but loopback.

The service-level tests run twice: on the embedded SQLite store and on a real PostgreSQL server
(``tests/fleetutil``; skipped with the reason when PostgreSQL or psycopg is not installed).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tenancy.service import TenancyService  # noqa: E402
from tests.fleetutil import postgres_server, redis_server, redis_session_server  # noqa: E402, F401 - fixtures


@pytest.fixture(autouse=True)
def _no_kek_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests choose their KEK source explicitly; an operator's env must not leak in."""
    monkeypatch.delenv("PREFIXGATE_KEK", raising=False)
    monkeypatch.delenv("PREFIXGATE_KEK_FILE", raising=False)
    monkeypatch.delenv("PREFIXGATE_REFERENCE_MODEL", raising=False)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> str | None:
    """None (the SQLite file under the home) or the URL of a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("postgres_server").new_database()


@pytest.fixture
def open_service(database_url: str | None) -> Callable[..., TenancyService]:
    """``TenancyService.open`` on this test's store: a second call is another gateway on the same state."""
    return functools.partial(TenancyService.open, database_url=database_url)


@pytest.fixture
def svc(home: Path, open_service: Callable[..., TenancyService]) -> Iterator[TenancyService]:
    s = open_service(home, auth_cache_ttl_s=0.2)
    yield s
    s.close()

