"""Two real engine processes on loopback (tiny model): a prefill node and a decode node.

Driven through the gateway's own split client (``DisaggEngineClient``, real HTTP and real KV
sockets). Pinned: greedy output of a split request equals a single engine's; cached tokens are the
tokens no engine computed; a chunk corrupted in flight is rejected and recomputed; a prefill node
killed mid-transfer leaves no leaked block on the decode node.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engine.disagg.request_wire import request_to_wire
from engine.launch import ensure_tiny_model
from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope
from gateway.disagg_client import DisaggEngineClient, DisaggMetrics, Placement, SplitPolicy
from tests.serverutil import serve_tiny, stop

TOKEN = "pd-test-node-token"
ENV = {"PD_NODE_TOKEN": TOKEN}
HEADERS = {"authorization": f"Bearer {TOKEN}"}
PROMPT = [int(t) for t in range(1000, 1000 + 150)]  # 150 tokens = 9 full blocks of 16 + 6


class Nodes(NamedTuple):
    prefill_url: str
    decode_url: str
    procs: list  # [prefill, decode]: a test that restarts a node puts its new process here
    homes: list[Path]


NODE_FLAGS = ("--node-token-env", "PD_NODE_TOKEN")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    homes = [tmp_path_factory.mktemp(n) for n in ("prefill", "decode")]
    ensure_tiny_model(homes[0])
    shutil.copytree(homes[0] / "models", homes[1] / "models")
    procs = []
    with ThreadPoolExecutor(2) as pool:  # the two model loads overlap
        futures = [pool.submit(serve_tiny, home, "--role", role, *NODE_FLAGS, env=ENV)
                   for home, role in zip(homes, ("prefill", "decode"))]
        started = [f.result() for f in futures if f.exception() is None]
        procs = [proc for _, proc in started]
    try:
        if len(started) != 2:
            raise RuntimeError(f"a node did not start: {[f.exception() for f in futures]}")
        (prefill_url, _), (decode_url, _) = started
        yield Nodes(prefill_url, decode_url, procs, homes)
    finally:
        for p in procs:
            stop(p)


def req(rid: str, ns: bytes, prompt=PROMPT, max_tokens: int = 12) -> GenerateRequest:
    return GenerateRequest(rid, StaticTenantScope(namespace=ns), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                                ignore_eos=True),
                           prompt_token_ids=prompt)


async def collect(client, gr: GenerateRequest) -> tuple[list[int], int]:
    ids, cached = [], 0
    async for out in client.generate(gr):
        ids += out.new_token_ids
        cached = out.cached_tokens
    return ids, cached


def split_client(prefill_url: str, decode_url: str, min_tokens: int = 32) -> DisaggEngineClient:
    return DisaggEngineClient(decode_url, [prefill_url], TOKEN, policy=SplitPolicy(min_split_tokens=min_tokens),
                              metrics=DisaggMetrics(CollectorRegistry()))


def integrity(url: str) -> dict:
    r = httpx.get(f"{url}/internal/v1/kv/integrity", headers=HEADERS, timeout=30, trust_env=False)
    r.raise_for_status()
    return r.json()


def lookup(url: str, gr: GenerateRequest) -> int:
    r = httpx.post(f"{url}/internal/v1/kv/lookup", json=request_to_wire(gr), headers=HEADERS, timeout=30,
                   trust_env=False)
    r.raise_for_status()
    return r.json()["cached_tokens"]


def test_split_output_equals_single_engine_and_cached_tokens_are_true(nodes):
    prefill_url, decode_url, *_ = nodes
    from gateway.remote import RemoteEngineClient

    async def run():
        client = split_client(prefill_url, decode_url)
        single = RemoteEngineClient(prefill_url, TOKEN)  # a single engine: tenant B, nothing cached
        try:
            split_ids, split_cached = await collect(client, req("s1", b"tenant-a"))
            assert client.last_placement == (Placement.SPLIT, "long_uncached_prompt")
            ref_ids, ref_cached = await collect(single, req("r1", b"tenant-b"))
            again_ids, again_cached = await collect(client, req("s2", b"tenant-a"))
            return split_ids, split_cached, ref_ids, ref_cached, again_ids, again_cached, client.last_placement
        finally:
            await client.aclose()
            await single.aclose()

    split_ids, split_cached, ref_ids, ref_cached, again_ids, again_cached, placement = asyncio.run(run())
    assert split_ids == ref_ids and len(split_ids) == 12
    assert split_cached == 0 == ref_cached  # the prefill node computed every token: nothing was free
    # the transferred blocks are the tenant's cache on the decode node now: colocated, 9 blocks hit
    assert placement == (Placement.COLOCATED, "cached_on_decode")
    assert again_ids == ref_ids and again_cached == 144
    assert integrity(decode_url)["ok"] and integrity(decode_url)["kv_blocks_used"] == 0
    assert integrity(prefill_url)["ok"]


def test_gateway_routes_split_and_the_openai_sdk_sees_single_engine_output(nodes, tmp_path, monkeypatch):
    """The real gateway (real tenancy, config with prefill_nodes) in front of the two nodes."""
    import sys

    import openai

    from gateway.app import create_app
    from gateway.ports import open_tenancy
    from gateway.settings import GatewaySettings, RouteConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
    from gateway_fakes import LoopbackServer

    prefill_url, decode_url, *_ = nodes
    monkeypatch.setenv("PD_NODE_TOKEN", TOKEN)
    svc = open_tenancy(tmp_path)
    key, other = svc.create_tenant("acme").api_key, svc.create_tenant("beta").api_key
    svc.flush()
    svc.close()
    route = RouteConfig(model="tiny", nodes=(decode_url,), prefill_nodes=(prefill_url,),
                        node_token_env="PD_NODE_TOKEN", split_min_tokens=32)
    messages = [{"role": "system", "content": "You are a careful assistant for the acme store. " * 6},
                {"role": "user", "content": "What do you sell?"}]
    single = RouteConfig(model="tiny-single", nodes=(prefill_url,), node_token_env="PD_NODE_TOKEN")  # one engine
    settings = GatewaySettings(home=tmp_path, routes=(route, single), metrics_token="pd-metrics")
    with LoopbackServer(create_app(settings)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
        # the same canonical request, another tenant (nothing cached), one engine doing everything
        ref = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=other, max_retries=0).chat.completions.create(
            model="tiny-single", messages=messages, max_tokens=10, temperature=0)
        metrics = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer pd-metrics"}, trust_env=False).text

    assert first.choices[0].message.content == ref.choices[0].message.content == second.choices[0].message.content
    assert ref.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # the prefill node computed the prompt
    prompt = first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16  # moved blocks: a hit
    assert 'prefixgate_pd_decisions_total{placement="split",reason="long_uncached_prompt"} 1.0' in metrics
    assert 'prefixgate_pd_decisions_total{placement="colocated",reason="cached_on_decode"} 1.0' in metrics


def test_a_node_serves_a_chat_request_sent_to_its_own_api(nodes):
    """A prefill or decode node is a whole gateway: a chat request sent straight to it is tokenized by
    its engine (the node's engine once had no ``tokenize``: a 400 naming the missing attribute), and its
    /detokenize and /v1/cache answer as a plain server's do."""
    from gateway.ports import open_tenancy

    for url, home in zip(nodes[:2], nodes.homes):
        svc = open_tenancy(home)
        key = svc.create_tenant(f"direct-{home.name}").api_key
        svc.flush()
        svc.close()
        resp = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, trust_env=False,
                          timeout=60, json={"model": "tiny", "max_tokens": 4, "temperature": 0,
                                            "messages": [{"role": "user", "content": "What do you sell?"}]})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        # and the rest of an engine's API: token ids back to text, the tenant's cache (the node's engine once
        # answered both with "not supported"); the chat above left its prompt's full blocks in the cache
        back = httpx.post(f"{url}/detokenize", headers={"authorization": f"Bearer {key}"}, trust_env=False,
                          timeout=60, json={"model": "tiny", "tokens": [72, 105]})
        assert back.status_code == 200, back.text
        assert isinstance(back.json()["prompt"], str) and back.json()["prompt"]
        cache = httpx.get(f"{url}/v1/cache", headers={"authorization": f"Bearer {key}"}, trust_env=False, timeout=60)
        assert cache.status_code == 200, cache.text
        assert cache.json()["tokens"]["hbm"] > 0 and cache.json()["tenant"] == f"direct-{home.name}"


def test_health_lists_a_split_routes_prefill_nodes_and_the_split_skips_a_down_one(nodes, tmp_path, monkeypatch):
    import sys

    import openai

    from gateway.app import create_app
    from gateway.ports import open_tenancy
    from gateway.settings import GatewaySettings, RouteConfig
    from tests.serverutil import free_port, wait_for

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
    from gateway_fakes import LoopbackServer

    prefill_url, decode_url, *_ = nodes
    dead = f"http://127.0.0.1:{free_port()}"  # listed first: without its probe it would be picked first
    monkeypatch.setenv("PD_NODE_TOKEN", TOKEN)
    svc = open_tenancy(tmp_path)
    key = svc.create_tenant("hp").api_key
    svc.flush()
    svc.close()
    route = RouteConfig(model="tiny", nodes=(decode_url,), prefill_nodes=(dead, prefill_url),
                        node_token_env="PD_NODE_TOKEN", split_min_tokens=32)
    settings = GatewaySettings(home=tmp_path, routes=(route,), node_probe_interval_s=0.2, metrics_token="pd-metrics")
    with LoopbackServer(create_app(settings)) as srv:
        def prefills() -> list[dict]:
            body = httpx.get(f"{srv.url}/health", timeout=10, trust_env=False).json()
            return body["nodes"][0].get("prefill_nodes") or []

        assert wait_for(lambda: all(p["healthy"] is not None for p in prefills()), timeout=20)
        status = {p["url"]: p["healthy"] for p in prefills()}
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
        client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": "You answer questions about the health of prefill nodes. " * 6},
            {"role": "user", "content": "Which one is up?"}])
        metrics = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer pd-metrics"},
                            trust_env=False).text
    assert status == {dead: False, prefill_url: True}
    assert 'prefixgate_pd_decisions_total{placement="split",reason="long_uncached_prompt"} 1.0' in metrics
    assert "prefixgate_pd_failures_total{" not in metrics  # the down prefill node was not tried


def test_blocks_the_decode_node_holds_are_named_not_sent(nodes):
    prefill_url, decode_url, *_ = nodes
    head = [int(t) for t in range(7000, 7000 + 144)]  # 9 blocks
    prompt = head + [int(t) for t in range(8000, 8000 + 150)]  # 294 tokens: 18 full cacheable blocks
    from gateway.remote import RemoteEngineClient

    async def warm_decode_then_single():
        decode, single = RemoteEngineClient(decode_url, TOKEN), RemoteEngineClient(prefill_url, TOKEN)
        try:
            await collect(decode, req("h1", b"tenant-h", head + [5], max_tokens=1))  # the decode node holds `head`
            return await collect(single, req("h-ref", b"tenant-h-ref", prompt))
        finally:
            await decode.aclose()
            await single.aclose()

    ref_ids, _ = asyncio.run(warm_decode_then_single())
    gr = req("h2", b"tenant-h", prompt)
    assert lookup(decode_url, gr) == 144
    r = httpx.post(f"{prefill_url}/internal/v1/kv/prefill", headers=HEADERS, timeout=120, trust_env=False,
                   json={"request": request_to_wire(gr), "address": receiver_of(decode_url), "skip_tokens": 144})
    transfer = r.json()["transfer"]
    assert transfer["status"] == "imported" and transfer["blocks_sent"] == 9 == transfer["blocks_imported"]
    assert lookup(decode_url, gr) == 288

    async def decode_it():
        decode = RemoteEngineClient(decode_url, TOKEN)
        try:
            return await collect(decode, gr)
        finally:
            await decode.aclose()

    ids, cached = asyncio.run(decode_it())
    assert ids == ref_ids and cached == 288
    assert integrity(decode_url)["ok"]


class CorruptingProxy:
    """TCP relay prefill -> decode receiver that flips one byte at ``flip_at`` (or, with
    ``stall_at``, stops forwarding there so that the sender can be killed mid-transfer)."""

    def __init__(self, target: str, flip_at: int | None = None, stall_at: int | None = None) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.flip_at, self.stall_at = flip_at, stall_at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.stalled = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        src, _ = self.listener.accept()
        dst = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(dst, src, None, None), daemon=True).start()
        self._pipe(src, dst, self.flip_at, self.stall_at)

    def _pipe(self, a: socket.socket, b: socket.socket, flip_at, stall_at) -> None:
        seen = 0
        try:
            while data := a.recv(65536):
                buf = bytearray(data)
                if flip_at is not None and seen <= flip_at < seen + len(buf):
                    buf[flip_at - seen] ^= 0xFF
                if stall_at is not None and seen + len(buf) > stall_at:
                    b.sendall(buf[: stall_at - seen])
                    self.stalled.set()
                    a.recv(1 << 20)  # wait for the sender to die (EOF or reset)
                    break
                b.sendall(buf)
                seen += len(buf)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def receiver_of(decode_url: str) -> str:
    r = httpx.get(f"{decode_url}/internal/v1/kv/receiver", headers=HEADERS, timeout=10, trust_env=False)
    return r.json()["address"]


def test_corrupted_chunk_is_rejected_and_recomputed(nodes):
    prefill_url, decode_url, *_ = nodes
    prompt = [int(t) for t in range(3000, 3000 + 150)]
    gr = req("c1", b"tenant-c", prompt)
    # tiny model chunks of 16 blocks: the whole 9-block prompt is one chunk; flip a byte deep in its payload
    proxy = CorruptingProxy(receiver_of(decode_url), flip_at=200_000)
    r = httpx.post(f"{prefill_url}/internal/v1/kv/prefill", headers=HEADERS, timeout=120, trust_env=False,
                   json={"request": request_to_wire(gr), "address": proxy.address})
    assert r.status_code == 200, r.text
    transfer = r.json()["transfer"]
    assert transfer["status"] == "rejected" and transfer["reason"] == "bad_mac"
    assert transfer["blocks_imported"] == 0
    assert lookup(decode_url, gr) == 0  # a miss, never data

    from gateway.remote import RemoteEngineClient

    async def run():
        decode, single = RemoteEngineClient(decode_url, TOKEN), RemoteEngineClient(prefill_url, TOKEN)
        try:
            return await collect(decode, gr), await collect(single, req("c2", b"tenant-d", prompt))
        finally:
            await decode.aclose()
            await single.aclose()

    (ids, cached), (ref_ids, _) = asyncio.run(run())
    assert ids == ref_ids and cached == 0  # recomputed on the decode node, same greedy tokens
    assert integrity(decode_url)["ok"]


def test_every_streamed_output_carries_the_prompt_so_an_early_end_is_billed_for_it(nodes):
    """A node reports usage only in its last chunk; the ledger bills an aborted or failed stream by
    its last output, which must then say what was prefilled (the lookup counted it)."""
    prefill_url, decode_url, *_ = nodes
    prompt = [int(t) for t in range(14000, 14000 + 150)]

    async def run():
        client = split_client(prefill_url, decode_url)
        try:
            outs = [[out async for out in client.generate(req(rid, b"tenant-bill", prompt))] for rid in ("b1", "b2")]
            return outs, client.last_placement
        finally:
            await client.aclose()

    (split, again), placement = asyncio.run(run())
    assert placement == (Placement.COLOCATED, "cached_on_decode")
    assert all((o.prompt_tokens, o.cached_tokens) == (150, 0) for o in split)  # cold: the prefill node computed it
    assert all(o.prompt_tokens == 150 for o in again)
    assert [o.cached_tokens for o in again[:-1]] == [144] * (len(again) - 1) and again[-1].cached_tokens == 144


class DeadReceiverClient(DisaggEngineClient):
    """The decode node's real lookup, naming a receiver nobody listens at (a stale address)."""

    async def lookup(self, request):
        look = await super().lookup(request)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        return dataclasses.replace(look, receiver=dead)


def test_a_failed_transfer_is_not_measured_as_a_transfer(nodes):
    prefill_url, decode_url, *_ = nodes
    registry = CollectorRegistry()
    gr = req("fail1", b"tenant-fail", [int(t) for t in range(13000, 13000 + 150)])

    async def run():
        client = DeadReceiverClient(decode_url, [prefill_url], TOKEN, policy=SplitPolicy(min_split_tokens=32),
                                    metrics=DisaggMetrics(registry))
        try:
            return await collect(client, gr)
        finally:
            await client.aclose()

    ids, _ = asyncio.run(run())
    assert len(ids) == 12  # the decode node computed the prompt itself
    value = registry.get_sample_value
    assert value("prefixgate_pd_failures_total", {"reason": "transfer_failed"}) == 1
    assert value("prefixgate_pd_ttft_part_seconds_count", {"part": "prefill"}) == 1  # the prefill did run
    assert not value("prefixgate_pd_ttft_part_seconds_count", {"part": "transfer"})
    assert not value("prefixgate_pd_transfer_bandwidth_bytes_per_second_count")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_idle_connections_without_the_token_neither_block_a_split_nor_cost_memory(nodes):
    """The audit's attack: connections that send a frame prefix claiming a full 256-block chunk, then nothing."""
    import struct

    prefill_url, decode_url, procs, _ = nodes
    stats = httpx.get(f"{decode_url}/internal/v1/stats", headers=HEADERS, timeout=10, trust_env=False).json()
    max_chunk = 256 * int(stats["kv_bytes_per_token"] * stats["block_size"])
    host, port = receiver_of(decode_url).rsplit(":", 1)
    rss_before = rss_bytes(procs[1].pid)
    idle = []
    for _ in range(24):  # more than the receiver's 16 transfer slots
        s = socket.create_connection((host, int(port)))
        s.sendall(struct.pack(">4sBBIQ", b"PGKV", 1, 1, 2, max_chunk) + b"{}")
        idle.append(s)
    gr = req("dos1", b"tenant-dos", [int(t) for t in range(11000, 11000 + 150)])
    try:
        time.sleep(0.5)  # every connection accepted and read (the old receiver allocated its claim here)
        grown = rss_bytes(procs[1].pid) - rss_before
        placement, registry = split_once(decode_url, prefill_url, gr)
    finally:
        for s in idle:
            s.close()
    assert grown < 4 * max_chunk, f"{grown} bytes more for {len(idle)} idle connections"
    assert placement == (Placement.SPLIT, "long_uncached_prompt")
    assert_imported(decode_url, registry, gr)  # the transfer got through


def split_once(decode_url: str, prefill_url: str, gr) -> tuple[tuple[Placement, str] | None, CollectorRegistry]:
    """One request through a fresh split client: where it was placed, and the client's metrics."""
    registry = CollectorRegistry()

    async def run():
        client = DisaggEngineClient(decode_url, [prefill_url], TOKEN, policy=SplitPolicy(min_split_tokens=32),
                                    metrics=DisaggMetrics(registry))
        try:
            await collect(client, gr)
            return client.last_placement
        finally:
            await client.aclose()

    return asyncio.run(run()), registry


def assert_imported(decode_url: str, registry: CollectorRegistry, gr) -> None:
    """No transfer failed, the decode node holds the prompt's 144 full-block tokens, its pool is sound."""
    assert registry.get_sample_value("prefixgate_pd_failures_total", {"reason": "transfer_failed"}) is None
    assert lookup(decode_url, gr) == 144
    assert integrity(decode_url)["ok"]


def restart_decode(nodes: Nodes, *flags: str) -> None:
    """Stop the decode node and start it again on the same HTTP address (its KV port: any free one)."""
    stop(nodes.procs[1])
    _, proc = serve_tiny(nodes.homes[1], "--role", "decode", *NODE_FLAGS, *flags, env=ENV,
                         port=urlsplit(nodes.decode_url).port)
    nodes.procs[1] = proc


def test_a_decode_node_restarted_on_another_kv_port_gets_the_next_split(nodes):
    prefill_url, decode_url, *_ = nodes
    registry = CollectorRegistry()
    client = DisaggEngineClient(decode_url, [prefill_url], TOKEN, policy=SplitPolicy(min_split_tokens=32),
                                metrics=DisaggMetrics(registry))
    before = receiver_of(decode_url)
    after_gr = req("rs2", b"tenant-rs", [int(t) for t in range(9000, 9000 + 150)])

    async def run():
        try:
            await collect(client, req("rs1", b"tenant-rs", [int(t) for t in range(8500, 8500 + 150)]))
            restart_decode(nodes)  # blocks this loop: nothing else runs on it
            assert receiver_of(decode_url) != before  # a fresh free port, as after any restart with --kv-port 0
            return await collect(client, after_gr), client.last_placement
        finally:
            await client.aclose()

    _, placement = asyncio.run(run())
    assert placement == (Placement.SPLIT, "long_uncached_prompt")
    assert_imported(decode_url, registry, after_gr)  # the blocks reached the new process


def test_a_decode_node_advertises_its_kv_advertise_host(nodes):
    prefill_url, decode_url, *_ = nodes
    restart_decode(nodes, "--kv-advertise-host", "localhost")  # bound to 127.0.0.1, reached by name
    assert receiver_of(decode_url).startswith("localhost:")
    gr = req("adv1", b"tenant-adv", [int(t) for t in range(12000, 12000 + 150)])
    placement, registry = split_once(decode_url, prefill_url, gr)
    assert placement == (Placement.SPLIT, "long_uncached_prompt")
    assert_imported(decode_url, registry, gr)


def test_prefill_killed_mid_transfer_leaks_nothing(nodes, tmp_path):  # last: it kills the module's prefill node
    prefill_url, decode_url, procs, _ = nodes
    prompt = [int(t) for t in range(5000, 5000 + 600)]  # 37 blocks: 3 chunks, the stall is in the second
    gr = req("k1", b"tenant-k", prompt)
    stats = httpx.get(f"{decode_url}/internal/v1/stats", headers=HEADERS, timeout=10, trust_env=False).json()
    block_bytes = int(stats["kv_bytes_per_token"] * stats["block_size"])
    proxy = CorruptingProxy(receiver_of(decode_url), stall_at=int(16 * block_bytes * 1.5))  # mid chunk 2
    done = threading.Event()

    def call():
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{prefill_url}/internal/v1/kv/prefill", headers=HEADERS, timeout=120, trust_env=False,
                       json={"request": request_to_wire(gr), "address": proxy.address})
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert proxy.stalled.wait(120)
    procs[0].kill()  # the prefill process dies with a chunk half sent
    procs[0].wait()
    assert done.wait(30)

    async def run():
        client = split_client(prefill_url, decode_url)  # the dead prefill node: falls back to recompute
        try:
            return await collect(client, req("k2", b"tenant-k", prompt))
        finally:
            await client.aclose()

    ids, cached = asyncio.run(run())
    assert len(ids) == 12
    check = integrity(decode_url)
    assert check["ok"], check["error"]
    assert check["kv_blocks_used"] == 0
    # the first, verified chunk (16 blocks) stayed: a true hit for the fallback request
    assert cached == 256
