"""The isolation table's "used / quota" per tier against a real ``prefixgate serve`` (tiny model,
24 HBM blocks, a DRAM tier, real tenancy with a DRAM block quota): the panel's current use of each
tier is the engine's ``prefixgate_kv_tenant_blocks`` gauge for the tenant's metrics label (admin
view) or the engine's count for the tenant's own key (a tenant's own row), and a tenant's DRAM use
stays within its quota.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tenancy.service import TenancyService
from tests.gateway.test_dashboard import metric
from tests.serverutil import scrape, serve_tiny, stop

# Two names sharing their first 32 characters: one metrics label (tenancy.namespace.metrics_label).
VICTIM, ATTACKER = "megacorp-production-eu-west-1-aaa-victim", "megacorp-production-eu-west-1-aaa-attacker"
SYSTEM = "You are the support assistant of ExampleCo. Answer briefly and only about our products. " * 3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("tier-use-home")
    with TenancyService.open(home) as svc:
        keys = {"acme": svc.create_tenant("acme", kv_blocks_dram=5).api_key,
                "beta": svc.create_tenant("beta").api_key, "ops": svc.create_tenant("ops", admin=True).api_key,
                **{name: svc.create_tenant(name).api_key for name in (VICTIM, ATTACKER)}}
        svc.flush()
    url, proc = serve_tiny(home, "--kv-blocks", "24", "--dram-bytes", "32MiB", timeout=300)
    try:
        yield url, keys
    finally:
        stop(proc)


def test_current_use_per_tier_is_the_engine_gauge(served):
    url, keys = served
    acme = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["acme"], max_retries=0, timeout=60)
    for i in range(10):  # distinct prefixes: HBM evicts into DRAM, where acme's quota caps it at 5 blocks
        acme.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "system", "content": f"Variant {i}. " + SYSTEM}, {"role": "user", "content": "hi"}])
    time.sleep(1.0)  # demotions finish on the tier's workers; the next request's step publishes them
    acme.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "ok"}])
    data = httpx.get(f"{url}/dashboard/data", headers={"Authorization": f"Bearer {keys['ops']}"},
                     trust_env=False, timeout=30).json()
    text = scrape(url)
    rows = {r["tenant"]: r for r in data["isolation"]}
    used = rows["acme"]["kv_blocks_used"]
    for tier in ("hbm", "dram", "nvme"):
        assert used[tier] == metric(text, "prefixgate_kv_tenant_blocks", tenant="acme", tier=tier), tier
    assert 0 < used["dram"] <= rows["acme"]["quotas"]["kv_blocks_dram"] == 5
    assert used["hbm"] == 0 and used["nvme"] == 0  # idle engine, no NVMe tier
    assert rows["ops"]["kv_blocks_used"] == {"hbm": 0, "dram": 0, "nvme": 0}
    # a tenant key sees its own row with the same figures
    own = httpx.get(f"{url}/dashboard/data", headers={"Authorization": f"Bearer {keys['acme']}"},
                    trust_env=False, timeout=30).json()
    assert [r["kv_blocks_used"] for r in own["isolation"]] == [used]


def _own_isolation_row(url: str, key: str) -> dict:
    data = httpx.get(f"{url}/dashboard/data", headers={"Authorization": f"Bearer {key}"}, trust_env=False,
                     timeout=30).json()
    (row,) = data["isolation"]
    return row


def test_a_tenant_sharing_another_ones_label_sees_only_its_own_blocks(served):
    """Audit finding 3: the attacker, whose name shares its first 32 characters with the victim's,
    read the victim's blocks per tier in its own row. Its row now counts its tenant key's blocks."""
    url, keys = served
    victim = openai.OpenAI(base_url=f"{url}/v1", api_key=keys[VICTIM], max_retries=0, timeout=60)
    for i in range(8):  # distinct prefixes: HBM evicts them into DRAM
        victim.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "system", "content": f"Victim {i}. " + SYSTEM}, {"role": "user", "content": "hi"}])
    time.sleep(1.0)  # demotions finish on the tier's workers
    victim.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "ok"}])
    own = _own_isolation_row(url, keys[VICTIM])["kv_blocks_used"]
    assert own["dram"] > 0, own  # the victim holds blocks the attacker must not see
    attacker = _own_isolation_row(url, keys[ATTACKER])
    assert attacker["tenant"] == ATTACKER and attacker["kv_blocks_used"] == {"hbm": 0, "dram": 0, "nvme": 0}


def test_prefixes_computed_most_are_engine_block_hashes_never_text(served):
    url, keys = served
    acme = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["acme"], max_retries=0, timeout=60)
    for _ in range(2):
        acme.chat.completions.create(model="tiny", max_tokens=1, messages=[
            {"role": "system", "content": "Recomputed. " + SYSTEM}, {"role": "user", "content": "hi"}])
    data = httpx.get(f"{url}/dashboard/data", headers={"Authorization": f"Bearer {keys['ops']}"},
                     trust_env=False, timeout=30).json()
    rows = data["cache"]["computed_prefixes"]
    assert rows and {r["tenant"] for r in rows} == {"acme"}
    assert all(re.fullmatch(r"[0-9a-f]{12}", r["hash"]) and r["count"] >= 1 for r in rows)
    assert [r["count"] for r in rows] == sorted((r["count"] for r in rows), reverse=True)
    assert "ExampleCo" not in str(rows)
    own = httpx.get(f"{url}/dashboard/data", headers={"Authorization": f"Bearer {keys['acme']}"},
                    trust_env=False, timeout=30).json()
    assert own["cache"]["computed_prefixes"] == rows
    other = httpx.get(f"{url}/dashboard/data", headers={"Authorization": f"Bearer {keys['beta']}"},
                      trust_env=False, timeout=30).json()
    assert other["cache"]["computed_prefixes"] == []  # another tenant's hashes are not shown
