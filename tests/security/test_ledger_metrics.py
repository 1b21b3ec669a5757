"""#16.1: the ledger counts what it could not store, and operators see it in /metrics.

A row the database refuses is quarantined and the rows behind it commit (tests/tenancy); the counts
of that are exported by the gateway as ``prefixgate_ledger_rows_total{outcome}``, with retries and
the queue length, from the real tenancy service of a live gateway.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from security_helpers import auth

from gateway.routes.ops import LedgerCollector
from tenancy.ledger import LedgerStats

OUTCOMES = {"committed", "quarantined", "spilled", "replayed", "lost"}


def _ledger_rows(text: str) -> dict[str, float]:
    for family in text_string_to_metric_families(text):
        if family.name == "prefixgate_ledger_rows":
            return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}
    raise AssertionError("prefixgate_ledger_rows is not exported")


class _Counts:
    def __init__(self, stats: LedgerStats) -> None:
        self._stats = stats

    def ledger_stats(self) -> LedgerStats:
        return self._stats


def test_the_collector_exports_every_outcome_as_counted() -> None:
    registry = CollectorRegistry()
    stats = LedgerStats(committed=39, quarantined=1, spilled=2, replayed=2, lost=0, retries=3, queued=5)
    registry.register(LedgerCollector(lambda: _Counts(stats)))
    text = generate_latest(registry).decode()
    assert _ledger_rows(text) == {"committed": 39, "quarantined": 1, "spilled": 2, "replayed": 2, "lost": 0}
    assert "prefixgate_ledger_retries_total 3.0" in text and "prefixgate_ledger_queued_rows 5.0" in text


def test_a_tenancy_without_ledger_counters_exports_nothing() -> None:
    registry = CollectorRegistry()
    registry.register(LedgerCollector(lambda: object()))
    assert "prefixgate_ledger" not in generate_latest(registry).decode()


def test_a_live_gateway_counts_its_committed_rows(gateway) -> None:
    client, keys, app = gateway
    before = _ledger_rows(client.get("/metrics", headers=auth(keys["admin"])).text)
    assert set(before) == OUTCOMES
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "ledger metric", "max_tokens": 1},
                    headers=auth(keys["acme"]))
    assert r.status_code == 200, r.text
    app.state.tenancy.flush()
    after = _ledger_rows(client.get("/metrics", headers=auth(keys["admin"])).text)
    assert after["committed"] >= before["committed"] + 1
    assert after["quarantined"] == before["quarantined"] and after["lost"] == 0
