"""Prometheus metrics of the tiers, registered on a registry the caller passes (never the global).

Counts are in blocks (the prefix-cache unit) unless the name says bytes. Labels: ``tier`` is
"dram" or "nvme"; ``tenant`` is the scope's bounded ``metrics_label``; ``reason`` is one of
the fixed words below.

    prefixgate_tier_bytes_used{tier}                     gauge   bytes held (ciphertext)
    prefixgate_tier_capacity_bytes{tier}                 gauge
    prefixgate_tier_hits_total{tier,tenant}              counter blocks a lookup found in the tier
    prefixgate_tier_restores_total{tier,tenant}          counter blocks restored (decrypted, handed to HBM)
    prefixgate_tier_restore_bytes_total{tier,tenant}     counter ciphertext bytes read by restores
    prefixgate_tier_restore_seconds{tier}                histogram one segment: read + decrypt
    prefixgate_tier_demotions_total{tier,tenant}         counter blocks written into the tier
    prefixgate_tier_demoted_bytes_total{tier}            counter
    prefixgate_tier_demotions_skipped_total{tier,reason} counter blocks not written: no_cipher, cost,
                                                                 too_large, quota, io_error, present
    prefixgate_tier_drops_total{tier,reason}             counter blocks deleted from the tier: evicted
                                                                 (not demoted further), ttl, auth_failure,
                                                                 tenant_deleted
    prefixgate_tier_auth_failures_total{tier,tenant}     counter segments whose tag failed (tampered,
                                                                 truncated, another tenant's or key's)
    prefixgate_tier_nvme_damage_total{kind}              counter what the NVMe tier's start-up found
                                                                 wrong below the engine and set aside:
                                                                 index_reset (index.sqlite moved aside),
                                                                 bad_rows, junk_entries (each a miss)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_P = "prefixgate_tier_"


class TierMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.bytes_used = Gauge(_P + "bytes_used", "Bytes held in the tier (ciphertext)", ["tier"],
                                registry=registry)
        self.capacity = Gauge(_P + "capacity_bytes", "Configured tier capacity", ["tier"], registry=registry)
        self.hits = Counter(_P + "hits", "Blocks a prefix lookup found in the tier", ["tier", "tenant"],
                            registry=registry)
        self.restores = Counter(_P + "restores", "Blocks restored from the tier into HBM", ["tier", "tenant"],
                                registry=registry)
        self.restore_bytes = Counter(_P + "restore_bytes", "Ciphertext bytes read by restores",
                                     ["tier", "tenant"], registry=registry)
        self.restore_seconds = Histogram(
            _P + "restore_seconds", "Read + decrypt time of one segment", ["tier"], registry=registry,
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0))
        self.demotions = Counter(_P + "demotions", "Blocks written into the tier", ["tier", "tenant"],
                                 registry=registry)
        self.demoted_bytes = Counter(_P + "demoted_bytes", "Ciphertext bytes written into the tier", ["tier"],
                                     registry=registry)
        self.skipped = Counter(_P + "demotions_skipped", "Blocks not written into the tier, by reason",
                               ["tier", "reason"], registry=registry)
        self.drops = Counter(_P + "drops", "Blocks deleted from the tier, by reason", ["tier", "reason"],
                             registry=registry)
        self.auth_failures = Counter(_P + "auth_failures", "Segments whose authentication tag failed",
                                     ["tier", "tenant"], registry=registry)
        self.nvme_damage = Counter(_P + "nvme_damage", "Damage the NVMe tier's start-up found and set aside",
                                   ["kind"], registry=registry)
