"""Prometheus metrics of KV transfers, on both sides (registered in the engine's registry).

    bandwidth = rate(prefixgate_kv_transfer_bytes_total{side="send"}) / rate(prefixgate_kv_transfer_seconds_sum)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.disagg.api import TransferReport

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.bytes = Counter("prefixgate_kv_transfer_bytes", "KV transfer bytes on the wire", ["side"], registry=r)
        self.blocks = Counter("prefixgate_kv_transfer_blocks", "KV blocks sent / imported", ["side"], registry=r)
        self.seconds = Histogram("prefixgate_kv_transfer_seconds", "Wall time of one transfer (send to ack)",
                                 buckets=_SECONDS, registry=r)
        self.prefill_seconds = Histogram("prefixgate_kv_handoff_prefill_seconds",
                                         "Prefill time of a handed-off request on the prefill engine",
                                         buckets=_SECONDS, registry=r)
        self.bandwidth = Gauge("prefixgate_kv_transfer_last_bandwidth_bytes_per_second",
                               "Bandwidth of the last transfer sent", registry=r)
        self.transfers = Counter("prefixgate_kv_transfers", "Transfers by side and outcome", ["side", "status"],
                                 registry=r)
        self.failures = Counter("prefixgate_kv_transfer_failures",
                                "Chunks rejected or transfers broken, by reason", ["side", "reason"], registry=r)

    def observe_sent(self, report: TransferReport) -> None:
        self.bytes.labels("send").inc(report.bytes_sent)
        self.blocks.labels("send").inc(report.blocks_sent)
        self.seconds.observe(report.seconds)
        if report.bandwidth_bytes_per_s:
            self.bandwidth.set(report.bandwidth_bytes_per_s)
        self.transfers.labels("send", report.status.value).inc()
