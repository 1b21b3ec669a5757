"""Fleet tests: real `prefixgate serve` processes on one real PostgreSQL and one real Redis (loopback)."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.fleetutil import postgres_server, redis_server, redis_session_server  # noqa: E402, F401 - fixtures
