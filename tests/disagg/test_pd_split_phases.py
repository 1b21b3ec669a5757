"""benchmarks/pd_engine_nodes.py's split-TTFT parts and routed pair, and pd.py's summaries of them, on made-up
timings (no engine, no GPU)."""

from __future__ import annotations

import pytest

import benchmarks.pd as pd
import benchmarks.pd_engine_nodes as nodes
from engine.disagg.api import HandoffReport, TransferReport, TransferStatus


def phases_of(timings):
    return pd.split_phases(nodes.split_parts(timings))


def timing(lookup: float, handoff: float, prefill: float, transfer: float, first: float):
    report = HandoffReport(prompt_tokens=1024, cached_tokens=0, prefill_s=prefill,
                           transfer=TransferReport(TransferStatus.IMPORTED, 63, 63, 1 << 20, transfer))
    return nodes.SplitTiming(lookup_s=lookup, handoff_s=handoff, report=report, first_token_s=first)


def test_no_split_no_phases():
    assert phases_of([]) == {}


def test_parts_split_the_handoff():
    # the call's time beyond the prefill node's prefill and the transfer is the export and the hops
    phases = phases_of([timing(0.001, 0.5, 0.4, 0.06, 0.02)])
    assert phases["prefill_node_s"] == {"p50": 0.4, "p99": 0.4}
    assert phases["transfer_s"] == {"p50": 0.06, "p99": 0.06}
    assert phases["export_and_calls_s"]["p50"] == pytest.approx(0.04)
    assert phases["first_token_s"]["p50"] == 0.02
    assert phases["lookup_s"]["p99"] == 0.001


def test_quantiles_over_requests():
    # one request stuck behind the prefill node's queue: p99 shows it, p50 does not
    timings = [timing(0.001, 0.3, 0.25, 0.02, 0.01) for _ in range(8)] + [timing(0.001, 1.8, 1.75, 0.02, 0.01)]
    phases = phases_of(timings)
    assert phases["prefill_node_s"] == {"p50": 0.25, "p99": 1.75}
    # a clock slip that makes the parts exceed the call is floored, not reported negative
    assert phases_of([timing(0.0, 0.1, 0.09, 0.02, 0.0)])["export_and_calls_s"]["p50"] == 0.0


class RecordingNode:
    """A node that answers every request with one item and remembers what it served."""

    def __init__(self) -> None:
        self.served: list[str] = []

    async def stream(self, op: str, *args):
        assert op == "generate"
        self.served.append(args[0].request_id)
        yield args[0].request_id


def request(rid: str, ns: bytes, tokens: list[int]):
    from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope

    return GenerateRequest(rid, StaticTenantScope(namespace=ns), SamplingParams(max_tokens=1),
                           prompt_token_ids=tokens)


def test_routed_pair_keeps_a_prefix_on_one_engine_and_leaves_a_busy_one():
    import asyncio

    a, b = RecordingNode(), RecordingNode()
    client = nodes.RoutedPairClient([nodes.RoutedNode("a", a), nodes.RoutedNode("b", b)])
    head = list(range(1000, 1300))  # more than the 256 tokens the route key covers

    async def run(r):
        return [out async for out in client.generate(r)]

    # the same tenant and leading 256 tokens: one engine, whatever follows, and nothing left in flight
    picked = {client.pick(request(f"r{i}", b"t1", head + [i] * 40)).label for i in range(6)}
    assert len(picked) == 1
    for i in range(6):
        assert asyncio.run(run(request(f"r{i}", b"t1", head + [i] * 40))) == [f"r{i}"]
    served = a.served if picked == {"a"} else b.served
    assert len(served) == 6 and all(n.inflight == 0 for n in client.nodes)
    assert {n.label: n.picked for n in client.nodes}[picked.pop()] == 6
    # the gateway's in-flight guard: past 2 x (least + 1) the request leaves its affinity engine
    home = client.pick(request("x", b"t1", head))
    home.inflight = 3
    assert client.pick(request("y", b"t1", head)) is not home
    # without token ids there is nothing to route on
    with pytest.raises(ValueError):
        from engine.protocol import GenerateRequest, StaticTenantScope

        client.pick(GenerateRequest("z", StaticTenantScope(), prompt="text"))


def test_mixed_rounds_reduce_to_medians():
    rounds = [{"wall_s": 6.0, "long_ttft_p50_s": 0.7, "decoder_tpot_p99_s": None, "tag": "x"},
              {"wall_s": 5.0, "long_ttft_p50_s": None, "decoder_tpot_p99_s": None, "tag": "y"},
              {"wall_s": 7.0, "long_ttft_p50_s": 0.3, "decoder_tpot_p99_s": None, "tag": "z"}]
    out = pd.median_of_rounds(rounds)
    assert out["wall_s"] == 6.0
    assert out["long_ttft_p50_s"] == 0.5  # a round without the figure is left out of its median
    assert out["decoder_tpot_p99_s"] is None and "tag" not in out
    assert out["rounds"] == rounds
    assert "rounds" not in pd.median_of_rounds(rounds[:1])
