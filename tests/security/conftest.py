"""Security suite fixtures: a real gateway (tiny engine, real tenancy on a temp SQLite home) in process.

The environment is set before anything imports litellm/tiktoken, so nothing touches the network.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
try:
    import importlib.util

    _spec = importlib.util.find_spec("litellm")
    if _spec and _spec.origin:
        os.environ.setdefault(
            "TIKTOKEN_CACHE_DIR", str(Path(_spec.origin).parent / "litellm_core_utils" / "tokenizers")
        )
except ImportError:  # pragma: no cover
    pass

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from security_helpers import TENANT_NAMES, make_home  # noqa: E402


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
