"""The router's view of the fleet: the engine's block chain, the fleet index, the policies (no sockets)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.block_hashing import prefix_block_hashes
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from gateway.fleet_index import FleetIndex
from gateway.remote import NodeFault
from gateway.routing import Backend, BackendKind, Route, Router, prompt_token_ids
from gateway.routing_policy import RoutingPolicy, kv_aware_choice, within_load_bound
from tests.engine_core.engine_core_fakes import make_request, scope


class RecordingEvents:
    """A real BlockEventObserver that keeps what it is told (the publisher's seam, minus the socket)."""

    def __init__(self) -> None:
        self.stored: list[bytes] = []
        self.removed: list[bytes] = []

    def blocks_stored(self, hashes, parent) -> None:
        self.stored += list(hashes)

    def blocks_removed(self, hashes) -> None:
        self.removed += list(hashes)

    def close(self) -> None:
        pass


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Node:
    label: str
    inflight: int = 0


def test_the_gateway_chain_is_the_chain_the_engine_commits_and_evicts():
    events = RecordingEvents()
    mgr = KVCacheManager(8, 4, events=events)
    tenant = scope("acme")
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks of 4
    req = make_request("r1", prompt, tenant, block_size=4)
    table = mgr.admit(req, mgr.match(req), 4)
    assert isinstance(table, list)
    mgr.commit("r1", tenant, table, req.block_hashes[:3], 0)
    mgr.free("r1", tenant, table)
    # what the router computes for the same tokens and namespace, with the engine's own cut
    assert events.stored == prefix_block_hashes(b"acme", prompt, 4) == list(req.block_hashes[:3])
    # another tenant's identical prompt names other blocks
    assert set(prefix_block_hashes(b"other", prompt, 4)).isdisjoint(events.stored)
    # a duplicate commit (same hash computed twice) is not a second store
    again = make_request("r2", prompt, tenant, block_size=4)
    t2 = mgr.admit(again, mgr.match(again), 4)
    assert mgr.match(again).num_blocks == 3 and len(events.stored) == 3
    mgr.free("r2", tenant, t2)
    # evicting the cached blocks reports each removal, tails first
    assert mgr.evict_all_cached() == 3
    assert sorted(events.removed) == sorted(events.stored)
    assert events.removed[0] == events.stored[-1]


def test_the_router_cuts_where_the_engine_matches():
    ids = list(range(32))
    assert len(prefix_block_hashes(b"n", ids, 16)) == 1  # the last token is always computed
    assert len(prefix_block_hashes(b"n", ids + [1], 16)) == 2
    assert len(prefix_block_hashes(b"n", list(range(1000)), 16, max_blocks=5)) == 5
    assert prompt_token_ids({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_token_ids({"prompt": [[4, 5], [6]]}) == [4, 5]
    assert prompt_token_ids({"prompt": "text"}) is None
    assert prompt_token_ids({"messages": [{"role": "user", "content": "x"}]}) is None


def test_index_longest_prefix_per_node_and_removals():
    idx = FleetIndex()
    a = [b"h%d" % i for i in range(6)]
    idx.stored("n1", a[:4])
    idx.stored("n2", a[:2])
    assert idx.prefix_lengths(a, ["n1", "n2", "n3"]) == {"n1": 4, "n2": 2, "n3": 0}
    idx.removed("n1", [a[3]])
    assert idx.prefix_lengths(a, ["n1"]) == {"n1": 3}
    idx.removed("n1", [a[0]])  # a hole at the root: nothing after it counts
    assert idx.prefix_lengths(a, ["n1", "n2"]) == {"n1": 0, "n2": 2}
    assert idx.blocks_of("n1") == 2 and idx.blocks_of("n2") == 2


def test_a_node_holding_nothing_matches_nothing_on_a_freshly_booted_host():
    """time.monotonic() counts from boot: within the TTL of it, the cut-off is below any default
    stamp, and a node with no entry was once counted as holding every block another node held."""
    idx = FleetIndex(ttl_s=900.0, clock=lambda: 12.0)  # 12 s after boot
    a = [b"h%d" % i for i in range(4)]
    idx.stored("n1", a)
    assert idx.prefix_lengths(a, ["n1", "n2"]) == {"n1": 4, "n2": 0}


def test_index_is_bounded_oldest_stored_first():
    idx = FleetIndex(max_blocks=3)
    idx.stored("n1", [b"a", b"b", b"c"])
    idx.stored("n1", [b"a"])  # refreshed: now the youngest
    idx.stored("n2", [b"d"])
    assert len(idx) == 3 and idx.forgotten == 1
    assert idx.prefix_lengths([b"b"], ["n1"]) == {"n1": 0}  # b was the oldest
    assert idx.prefix_lengths([b"a"], ["n1"]) == {"n1": 1}
    assert idx.blocks_of("n1") == 2


def test_index_entries_expire_unless_stored_again():
    clock = FakeClock()
    idx = FleetIndex(ttl_s=60.0, clock=clock)
    idx.stored("n1", [b"a", b"b"])
    clock.now += 59.0
    assert idx.prefix_lengths([b"a", b"b"], ["n1"]) == {"n1": 2}
    idx.stored("n1", [b"a"])
    clock.now += 2.0
    assert idx.prefix_lengths([b"a", b"b"], ["n1"]) == {"n1": 1}  # b's removal may have been lost


def test_dropping_a_node_forgets_only_its_entries():
    idx = FleetIndex()
    idx.stored("n1", [b"a", b"b"])
    idx.stored("n2", [b"a"])
    assert idx.drop_node("n1") == 2
    assert idx.prefix_lengths([b"a", b"b"], ["n1", "n2"]) == {"n1": 0, "n2": 1}
    assert len(idx) == 1 and idx.drop_node("n1") == 0


def test_load_bound_admits_about_one_plus_epsilon_times_the_mean():
    nodes = [Node("a", 6), Node("b", 2), Node("c", 2), Node("d", 2)]
    # 12 in flight on 4 nodes: cap = ceil(1.25 * 13 / 4) = 5, so the node at 6 is out
    assert [n.label for n in within_load_bound(nodes, 0.25)] == ["b", "c", "d"]
    idle = [Node("a"), Node("b")]
    assert within_load_bound(idle, 0.0) == idle  # someone always qualifies


def test_kv_aware_takes_the_longest_prefix_within_the_bound_else_least_loaded():
    idx = FleetIndex()
    chain = [b"c%d" % i for i in range(8)]
    idx.stored("a", chain[:6])
    idx.stored("b", chain[:3])
    nodes = [Node("a", 1), Node("b", 1), Node("c", 0)]
    assert kv_aware_choice(b"k", chain, nodes, idx, 0.25) == (nodes[0], 6)
    nodes[0].inflight = 4  # over the bound: the next-longest holder within it
    assert kv_aware_choice(b"k", chain, nodes, idx, 0.25) == (nodes[1], 3)
    node, held = kv_aware_choice(b"k", [b"x"], nodes, idx, 0.25)  # nobody holds it: least loaded
    assert (node.label, held) == ("c", 0)


def _pool(n):
    from tests.gateway.gateway_fakes import FakeEngine

    return [Backend(f"node:http://10.0.0.{i}:8000", BackendKind.NODE, FakeEngine(), "") for i in range(n)]


def test_router_policies_on_a_pool():
    backends = _pool(3)
    body = {"prompt": list(range(200))}
    rr = Router([Route("m", backends)], policy=RoutingPolicy.ROUND_ROBIN)
    assert [rr.resolve("m", None, b"t", body).label for _ in range(4)] == [b.label for b in backends + backends[:1]]
    ll = Router([Route("m", backends)], policy=RoutingPolicy.LEAST_LOADED)
    backends[0].inflight, backends[1].inflight = 3, 1
    assert ll.resolve("m", None, b"t", body) is backends[2]
    backends[0].inflight = backends[2].inflight = 1  # all tied: they rotate, whatever the prompt
    assert len({ll.resolve("m", None, b"t", body).label for _ in range(3)}) == 3
    backends[0].inflight = backends[1].inflight = 0
    kv = Router([Route("m", backends)], policy=RoutingPolicy.KV_AWARE)
    chain = kv.route_key(b"t", body).chain
    assert len(chain) == 12  # 199 cacheable tokens / 16
    kv.index.stored(backends[1].label, chain[:5])
    assert kv.resolve("m", None, b"t", body) is backends[1] and kv.routed_prefix_blocks == 5
    assert kv.resolve("m", None, b"u", body) is not None  # another namespace: a different chain
    assert kv.route_key(b"u", body).chain[0] != chain[0]
    # a node that failed is marked down and its entries dropped
    kv.record_failure("m", backends[1], NodeFault.UNREACHABLE, "refused")
    assert kv.failover("m", backends[1]) is not None
    assert kv.index.blocks_of(backends[1].label) == 0 and kv.resolve("m", None, b"t", body) is not backends[1]


@pytest.mark.parametrize("batch", [
    KVEventBatch(1.5, (BlockStored((b"\x01" * 32, b"\x02" * 32), None, (), 16, None, "hbm"),
                       BlockRemoved((b"\x01" * 32,), "hbm"), AllBlocksCleared())),
    KVEventBatch(2.0, (BlockStored((7, 8), 6, (1, 2, 3), 16, None, "GPU"),), data_parallel_rank=1),
])
def test_event_batches_round_trip_in_vllms_layout(batch):
    msgpack = pytest.importorskip("msgpack", reason="pip install 'prefixgate[fleet]' (msgpack)")
    from engine.kv_events import decode_batch, encode_batch

    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    wire = msgpack.unpackb(payload)
    assert wire[1][0]["type"] == "BlockStored" and "lora_name" in wire[1][0]  # vLLM 0.32's tagged map


def test_undecodable_payloads_are_refused_and_unknown_event_kinds_skipped():
    msgpack = pytest.importorskip("msgpack", reason="pip install 'prefixgate[fleet]' (msgpack)")
    from engine.kv_events import KVEventDecodeError, decode_batch

    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [["BlockStored", "x", None, [], 16]]]),
                msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [b"h"]}]]), msgpack.packb([1.0, [7]])):
        with pytest.raises(KVEventDecodeError):
            decode_batch(bad)
    # older vLLM: tagged arrays; newer fields and unknown kinds are ignored
    older = msgpack.packb([1.0, [["BlockStored", [b"h"], None, [], 16, None, "GPU"], ["Future", 1]]])
    assert decode_batch(older).events == (BlockStored((b"h",), None, (), 16, None, "GPU"),)
    newer = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU", "locality": "LOCAL"},
                                 {"type": "Future"}], None])
    assert decode_batch(newer).events == (BlockRemoved((3,), "CPU"),)


def test_route_config_wants_one_event_endpoint_per_node_and_routes_without_events_have_no_subscriber():
    from pydantic import ValidationError

    from gateway.app import build_router
    from gateway.settings import GatewaySettings, RouteConfig

    with pytest.raises(ValidationError, match="one endpoint per node"):
        RouteConfig(model="m", nodes=("http://a", "http://b"), kv_events=("tcp://a:1",))
    plain = build_router(GatewaySettings(routes=(RouteConfig(model="m", nodes=("http://a", "http://b")),)))
    assert plain.events is None and plain.policy is RoutingPolicy.PREFIX_HASH
    pytest.importorskip("zmq", reason="pip install 'prefixgate[fleet]' (pyzmq)")
    pytest.importorskip("msgpack", reason="pip install 'prefixgate[fleet]' (msgpack)")
    fed = build_router(GatewaySettings(routing_policy="kv_aware", routes=(
        RouteConfig(model="m", nodes=("http://a", "http://b"), kv_events=("tcp://a:1", "tcp://b:1")),)))
    assert fed.policy is RoutingPolicy.KV_AWARE
    assert [s.node for s in fed.events.sources] == ["node:m-1", "node:m-2"]  # the default node names


def test_kv_event_endpoints_must_be_zmq_addresses():
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    with pytest.raises(ValidationError, match="ZMQ addresses"):
        GatewaySettings(kv_events_endpoint="http://127.0.0.1:5557")


def test_a_node_marked_down_by_the_health_probe_loses_its_index_entries():
    backends = _pool(2)
    router = Router([Route("m", backends)], policy=RoutingPolicy.KV_AWARE)
    router.index.stored(backends[0].label, [b"a", b"b"])
    router.index.stored(backends[1].label, [b"a"])
    router.mark_down(backends[0], 4.0)
    assert not backends[0].up and router.index.blocks_of(backends[0].label) == 0
    assert router.index.blocks_of(backends[1].label) == 1


def test_a_pool_tokenizer_must_be_a_tokenizer_directory_of_a_node_pool(tmp_path, tiny_model_dir):
    from pydantic import ValidationError

    from gateway.app import build_router
    from gateway.settings import GatewaySettings, RouteConfig

    with pytest.raises(ValidationError, match="no tokenizer at"):
        RouteConfig(model="m", nodes=("http://127.0.0.1:1",), tokenizer=str(tmp_path))
    with pytest.raises(ValidationError, match="is for node pools"):
        RouteConfig(model="m", provider="openai/gpt-4o-mini", tokenizer=str(tiny_model_dir))
    route = RouteConfig(model="m", nodes=("http://127.0.0.1:1", "http://127.0.0.1:2"), tokenizer=str(tiny_model_dir))
    router = build_router(GatewaySettings(routes=(route,)))
    pool = router.routes["m"].backends
    assert all(b.tokenizes_here and not b.honours_retention for b in pool)
    # the pool's representative until the ids are known; then a pick on their chain
    assert router.resolve("m", None, b"ns", {"messages": [{"role": "user", "content": "hi"}]}) is pool[0]
    picked = router.resolve("m", None, b"ns", {"messages": []}, token_ids=list(range(40)))
    assert picked in pool
