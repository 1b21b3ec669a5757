"""KV events over a real ZMQ socket on loopback: an engine's cache manager -> publisher -> subscriber -> index."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq", reason="pip install 'prefixgate[fleet]' (pyzmq)")
pytest.importorskip("msgpack", reason="pip install 'prefixgate[fleet]' (msgpack)")

from engine.block_hashing import prefix_block_hashes  # noqa: E402
from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.kv_events import KVEventBatch, KVEventPublisher, encode_batch  # noqa: E402
from gateway.fleet_index import FleetIndex  # noqa: E402
from gateway.kv_event_subscriber import EventSource, KVEventSubscriber  # noqa: E402
from tests.engine_core.engine_core_fakes import make_request, scope  # noqa: E402
from tests.serverutil import wait_for  # noqa: E402


def _publisher() -> KVEventPublisher:
    return KVEventPublisher("tcp://127.0.0.1:*", 4).start()


def test_stored_and_evicted_blocks_reach_the_gateways_index():
    pub = _publisher()
    index = FleetIndex()
    sub = KVEventSubscriber(index, [EventSource("node:a", pub.endpoint)])
    sub.start()
    try:
        mgr = KVCacheManager(8, 4, events=pub)
        prompt = list(range(50, 63))  # 13 tokens: 3 full blocks
        chain = prefix_block_hashes(b"acme", prompt, 4)
        # PUB/SUB joins asynchronously: publish until the subscription is live, as a node would keep doing
        def one_round(rid: str) -> None:
            req = make_request(rid, prompt, scope("acme"), block_size=4)
            table = mgr.admit(req, mgr.match(req), 4)
            mgr.commit(rid, req.tenant, table, req.block_hashes[:3], 0)
            mgr.free(rid, req.tenant, table)

        n = 0
        while not index.prefix_lengths(chain, ["node:a"])["node:a"] and n < 100:
            n += 1
            mgr.evict_all_cached()
            one_round(f"r{n}")
            time.sleep(0.05)
        assert wait_for(lambda: index.prefix_lengths(chain, ["node:a"]) == {"node:a": 3})
        assert index.prefix_lengths(prefix_block_hashes(b"other", prompt, 4), ["node:a"]) == {"node:a": 0}
        mgr.evict_all_cached()
        assert wait_for(lambda: index.blocks_of("node:a") == 0)
        assert sub.stats["node:a"].gaps == 0 and sub.stats["node:a"].bad_payloads == 0
    finally:
        sub.stop()
        pub.close()


def test_a_gap_in_the_sequence_or_a_cleared_cache_drops_the_node_and_bad_payloads_are_skipped():
    index = FleetIndex()
    sub = KVEventSubscriber(index, [EventSource("node:a", "tcp://127.0.0.1:1"), EventSource("node:b", "x")])
    from engine.kv_events import AllBlocksCleared, BlockStored

    stored = encode_batch(KVEventBatch(1.0, (BlockStored((b"h1", b"h2")),)))
    sub.apply("node:a", 0, stored)
    sub.apply("node:b", 0, stored)
    assert index.blocks_of("node:a") == 2
    sub.apply("node:a", 1, b"\xc1not msgpack")  # skipped, counted; the stream stays in order
    assert sub.stats["node:a"].bad_payloads == 1 and index.blocks_of("node:a") == 2
    sub.apply("node:a", 5, encode_batch(KVEventBatch(2.0, ())))  # 2..4 lost: removals may be missing
    assert sub.stats["node:a"].gaps == 1 and index.blocks_of("node:a") == 0
    assert index.blocks_of("node:b") == 2  # one node's trouble is its own
    sub.apply("node:b", 1, encode_batch(KVEventBatch(3.0, (AllBlocksCleared(),))))
    assert index.blocks_of("node:b") == 0


def test_a_publisher_that_cannot_bind_says_so():
    first = _publisher()
    try:
        with pytest.raises(RuntimeError, match="cannot bind"):
            KVEventPublisher(first.endpoint, 4).start()
    finally:
        first.close()
