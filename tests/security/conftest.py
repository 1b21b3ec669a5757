"""Security suite fixtures: a real gateway (tiny engine, real tenancy on a temp SQLite home) in process."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from security_helpers import make_home  # noqa: E402  (sets the offline environment on import)


@pytest.fixture(scope="session")
def sec_home(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A home with the tiny model and the tenants of ``TENANT_NAMES`` -> (home, name -> api key)."""
    return make_home(tmp_path_factory.mktemp("sec-home"))


@pytest.fixture(scope="module")
def gateway(sec_home):
    """A live in-process gateway (lifespan run: real engine thread, real tenancy) -> (client, keys, app)."""
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    home, keys = sec_home
    from engine.launch import default_tiny_dir

    settings = GatewaySettings(home=home, model="tiny", model_dir=default_tiny_dir(home), kv_blocks=512)
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, keys, app
