"""The NVMe tier behind the real gateway: spilled KV stays per tenant, encrypted, and damaged
spill files are misses with a metric, never served.

The engine gets few HBM blocks so a prompt is evicted (and demoted, encrypted with the tenant's
data key, to files under ``nvme_dir``) by a handful of later prompts.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from security_helpers import auth, random_prompt

KV_BLOCKS = 48


@pytest.fixture(scope="module")
def tier_gateway(sec_home, tmp_path_factory):
    from engine.launch import default_tiny_dir
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    home, keys = sec_home
    nvme = tmp_path_factory.mktemp("nvme")
    settings = GatewaySettings(home=home, model="tiny", model_dir=default_tiny_dir(home), kv_blocks=KV_BLOCKS,
                               nvme_dir=nvme, nvme_bytes=64 * 2**20)
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, keys, app, nvme


def _send(client, key: str, prompt: str) -> dict:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
                    headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _metric(app, name: str, **labels: str) -> float:
    total = 0.0
    for family in app.state.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _segments(nvme: Path) -> list[Path]:
    return sorted(nvme.rglob("*.seg"))


def _evict(client, key: str, rng, app) -> None:
    """Push everything out of HBM with fresh prompts of ``key``, then let the demotions land."""
    for _ in range(6):
        _send(client, key, random_prompt(rng, 160))
    time.sleep(0.5)  # demotion runs on the tier thread pool


def test_spilled_prefix_serves_only_its_tenant(tier_gateway) -> None:
    client, keys, app, nvme = tier_gateway
    rng = random.Random(5)
    secret = "tier-isolation. " + random_prompt(rng, 160)
    first = _send(client, keys["acme"], secret)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    _evict(client, keys["acme"], rng, app)
    assert _segments(nvme), "nothing was spilled to the NVMe tier: the test would prove nothing"
    for seg in _segments(nvme):  # ciphertext on disk: no run of prompt text survives
        assert b"tier-isolation" not in seg.read_bytes()
    beta_hits_before = _metric(app, "prefixgate_tier_hits_total", tenant="beta")
    assert _send(client, keys["beta"], secret)["prompt_tokens_details"]["cached_tokens"] == 0
    assert _metric(app, "prefixgate_tier_hits_total", tenant="beta") == beta_hits_before
    restores = _metric(app, "prefixgate_tier_restores_total")
    again = _send(client, keys["acme"], secret)
    assert again["prompt_tokens_details"]["cached_tokens"] >= 16
    assert _metric(app, "prefixgate_tier_restores_total") > restores


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_spill_files_are_counted_misses(tier_gateway, damage: str) -> None:
    client, keys, app, nvme = tier_gateway
    rng = random.Random(17 if damage == "flip" else 18)
    secret = f"tier-damage-{damage}. " + random_prompt(rng, 160)
    _send(client, keys["acme"], secret)
    _evict(client, keys["acme"], rng, app)
    segs = _segments(nvme)
    assert segs
    for seg in segs:
        data = bytearray(seg.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
            seg.write_bytes(bytes(data))
        else:
            seg.write_bytes(bytes(data[: len(data) // 3]))
    failures = _metric(app, "prefixgate_tier_auth_failures_total")
    usage = _send(client, keys["acme"], secret)  # served, correctly computed, from scratch
    assert usage["prompt_tokens_details"]["cached_tokens"] < 16
    assert _metric(app, "prefixgate_tier_auth_failures_total") > failures
    # and serving goes on
    _send(client, keys["beta"], random_prompt(rng, 40))
