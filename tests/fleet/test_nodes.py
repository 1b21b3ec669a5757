"""Engine nodes behind a gateway: two real `prefixgate serve --model tiny` nodes on loopback, reached
through the OpenAI-compatible API that vLLM speaks (token-id prompts, ``cache_salt``), driven by the
real openai SDK; a real gateway (own home, real SQLite ledger) in front of them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import GatewaySettings, RouteConfig
from tenancy.service import TenancyService
from tests.fleet.faulty_node import CUT_USAGE, FaultyNode
from tests.gateway.gateway_fakes import LoopbackServer
from tests.serverutil import free_port, serve_tiny, stop

TOKEN = "fleet-node-token"
TOKEN_ENV = "PG_FLEET_NODE_TOKEN"
NODE = {"Authorization": f"Bearer {TOKEN}"}
PROMPT_IDS = list(range(40, 120))  # 80 tokens: 5 full blocks of 16
SALT_A, SALT_B = "aa" * 32, "bb" * 32
MESSAGES = [{"role": "system", "content": "You answer about ExampleCo's products, briefly and politely. " * 4},
            {"role": "user", "content": "What are your opening hours?"}]


NODE_PROCS: list = []  # the nodes' processes, for signals


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    started = []
    try:
        for i in range(2):
            home = tmp_path_factory.mktemp(f"node{i}")
            started.append(serve_tiny(home, "--node-token-env", TOKEN_ENV, env={TOKEN_ENV: TOKEN}))
        NODE_PROCS[:] = [proc for _, proc in started]
        yield [url for url, _ in started]
    finally:
        for _, proc in started:
            stop(proc)


def node_sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=60)


def test_a_node_serves_token_id_prompts_and_keeps_tenants_apart_by_cache_salt(nodes) -> None:
    client = node_sdk(nodes[0])
    assert [m.id for m in client.models.list().data] == ["tiny"]

    def cached(salt: str) -> int:
        r = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=2, temperature=0,
                                      extra_body={"cache_salt": salt})
        assert r.usage.prompt_tokens == len(PROMPT_IDS) and r.usage.completion_tokens == 2
        return r.usage.prompt_tokens_details.cached_tokens

    cached(SALT_A)
    assert cached(SALT_A) >= 64  # the same tenant: its 4+ full blocks come from the cache
    assert cached(SALT_B) == 0  # the same tokens under another tenant's salt: nothing shared


def test_a_node_streams_sse_with_usage_and_token_ids(nodes) -> None:
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, "cache_salt": SALT_A,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    r = httpx.post(f"{nodes[0]}/v1/completions", json=body, headers=NODE, timeout=60, trust_env=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [httpx.Response(200, content=e).json() for e in events[:-1]]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    usage = chunks[-1]["usage"]
    assert len(ids) == usage["completion_tokens"] == 4 and usage["prompt_tokens_details"]["cached_tokens"] >= 64
    # the same stream through the SDK's chat API
    stream = node_sdk(nodes[0]).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, stream=True, stream_options={"include_usage": True},
        extra_body={"cache_salt": SALT_A})
    got = list(stream)
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == 3


def _node_stream(url: str, path: str, prompt: dict, stream_options: dict | None) -> list[dict]:
    """The chunks (before ``[DONE]``) of one streamed node call of 4 tokens with token ids."""
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "cache_salt": SALT_A,
            "stream": True, "return_token_ids": True, **prompt}
    if stream_options is not None:
        body["stream_options"] = stream_options
    r = httpx.post(f"{url}{path}", json=body, headers=NODE, timeout=60, trust_env=False)
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize(("path", "prompt"), [("/v1/completions", {"prompt": PROMPT_IDS}),
                                              ("/v1/chat/completions", {"messages": MESSAGES})])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk_and_only_when_asked(nodes, path, prompt) -> None:
    # the default (what OpenAI clients expect): usage only in the last chunk
    *plain, last = _node_stream(nodes[0], path, prompt, {"include_usage": True})
    assert plain and all("usage" not in c for c in plain) and last["usage"]["completion_tokens"] == 4
    # asked for: every chunk carries the prompt as the prefill counted it (here partly cached by the
    # call above) and the completion tokens up to that chunk
    *deltas, tail = _node_stream(nodes[0], path, prompt, {"include_usage": True, "continuous_usage_stats": True})
    final = tail["usage"]
    assert tail["choices"] == [] and final["completion_tokens"] == 4 and final["prompt_tokens"] > 0
    assert final["prompt_tokens_details"]["cached_tokens"] > 0
    so_far = 0
    for chunk in deltas:
        so_far += len(chunk["choices"][0]["token_ids"])
        usage = chunk["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (final["prompt_tokens"], so_far)
        assert usage["prompt_tokens_details"] == final["prompt_tokens_details"]
        assert usage["total_tokens"] == final["prompt_tokens"] + so_far
    assert deltas and so_far == 4
    for options in (None, {"continuous_usage_stats": True}):  # without include_usage, as vLLM: no usage at all
        assert all("usage" not in c for c in _node_stream(nodes[0], path, prompt, options))


def test_node_errors_are_openai_errors(nodes) -> None:
    client = node_sdk(nodes[0])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=9000, extra_body={"cache_salt": SALT_A})
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=2, n=2)
    assert err.value.code == "invalid_node_request"
    with pytest.raises(openai.BadRequestError) as err:  # the sending gateway's tenant key is hex
        client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=1,
                                  extra_body={"cache_salt": SALT_A, "prefixgate_tenant": "not hex"})
    assert err.value.code == "invalid_node_request"
    ok = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=1,
                                   extra_body={"cache_salt": SALT_A, "prefixgate_tenant": "cd" * 32})
    assert ok.usage.completion_tokens == 1
    # a tenant key (or none) on the same path is the public API, never the node's
    r = httpx.post(f"{nodes[0]}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30, trust_env=False)
    assert r.status_code == 401


@pytest.fixture
def gateway(tmp_path: Path, nodes, monkeypatch):
    """A gateway with its own home in front of the two nodes (plus a dead one), unpriced."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    home = tmp_path / "gw"
    svc = TenancyService.open(home)
    key = svc.create_tenant("acme").api_key
    svc.close()
    dead = f"http://127.0.0.1:{free_port()}"
    route = RouteConfig(model="tiny", nodes=(dead, *nodes), node_names=("dead", "first", "second"),
                        node_token_env=TOKEN_ENV, price="unpriced")
    settings = GatewaySettings(home=home, routes=(route,), node_probe_interval_s=0.3)
    with LoopbackServer(create_app(settings)) as srv:
        yield srv.url, key, home, dead
    for url in nodes:  # leave both nodes serving for the next test
        httpx.post(f"{url}/internal/v1/drain", json={"draining": False}, headers=NODE, timeout=10, trust_env=False)


def _until(check, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10, trust_env=False).json()


def test_through_the_gateway_unpriced_tokens_reach_the_ledger_and_a_dead_node_is_skipped(gateway, nodes) -> None:
    url, key, home, dead = gateway
    _until(lambda: {n["url"]: n["healthy"] for n in _health(url)["nodes"]} == {dead: False, **dict.fromkeys(nodes, True)},
           "the probe sees the dead node down and both nodes up")
    assert _health(url)["status"] == "ok"  # one node of three down: the route still serves
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    used = set()
    for i in range(6):  # different prompts spread over the nodes; none reaches the dead one
        messages = [MESSAGES[0], {"role": "user", "content": f"question {i}"}]
        r = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=2)
        used.add(r.headers["x-prefixgate-backend"])
    assert used and "node:dead" not in used
    again = client.chat.completions.create(model="tiny", messages=[MESSAGES[0], {"role": "user", "content": "question 0"}],
                                           max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    seen = {n["name"]: n["cached_tokens"] for n in _health(url)["nodes"]}
    assert all(seen[b.removeprefix("node:")] == "reported" for b in used) and seen["dead"] == "unknown"
    def rows() -> list[dict]:
        svc = TenancyService.open(home)
        try:
            return svc.report()["rows"]
        finally:
            svc.close()

    # the gateway's ledger writer commits its queue in batches (max delay): wait for the 7th row
    _until(lambda: sum(r["requests"] for r in rows()) == 7, "all 7 rows committed")
    (row,) = rows()
    assert row["requests"] == 7 and row["cached_tokens"] > 0 and row["priced_as"] == "unpriced"
    assert row["cost_usd"] is None and row["saved_usd"] is None  # tokens, no money


def _ledger(home: Path) -> list[tuple[str, int, int]]:
    """(status, prompt_tokens, cached_tokens) of every ledger row, oldest first."""
    with sqlite3.connect(home / "prefixgate.db") as conn:
        return list(conn.execute("SELECT status, prompt_tokens, cached_tokens FROM usage ORDER BY created_at"))


def test_a_stream_the_client_aborts_is_billed_the_prompt_the_node_prefilled(gateway) -> None:
    """Chat through a node route without a gateway tokenizer: the node tokenizes, so only the node's
    usage says how long the prompt was; it sends it in every chunk (continuous usage stats)."""
    url, key, home, _ = gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    messages = [MESSAGES[0], {"role": "user", "content": "Tell me a long story about a stream cut short."}]
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert done.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True})
    next(c for c in stream if c.choices and c.choices[0].delta.content)  # the first tokens, then the client leaves
    stream.close()
    _until(lambda: len(_ledger(home)) == 2, "both ledger rows committed", timeout=30)
    ok, aborted = _ledger(home)
    assert ok == ("ok", done.usage.prompt_tokens, done.usage.prompt_tokens_details.cached_tokens)
    status, prompt, cached = aborted
    assert status == "aborted" and prompt == done.usage.prompt_tokens
    assert 0 < cached <= prompt  # the same prefix again, on the same node: its hit is billed as such


def test_draining_a_node_finishes_its_stream_and_sends_new_requests_elsewhere(gateway, nodes) -> None:
    url, key, _, _ = gateway
    first, second = nodes
    # a long stream on the first node, drained while it runs
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 48, "temperature": 0, "cache_salt": SALT_A,
            "stream": True, "ignore_eos": True}
    done: dict[str, str] = {}

    def long_stream() -> None:
        with httpx.stream("POST", f"{first}/v1/completions", json=body, headers=NODE, timeout=120,
                          trust_env=False) as r:
            done["text"] = r.read().decode()

    t = threading.Thread(target=long_stream)
    t.start()
    _until(lambda: httpx.get(f"{first}/internal/v1/stats", headers=NODE, timeout=10,
                             trust_env=False).json()["running"] >= 1, "the stream is running")
    r = httpx.post(f"{first}/internal/v1/drain", headers=NODE, timeout=10, trust_env=False)
    assert r.json()["draining"] is True
    h = httpx.get(f"{first}/health", timeout=10, trust_env=False)
    assert h.status_code == 503 and h.json()["status"] == "draining"
    refused = httpx.post(f"{first}/v1/completions", json={**body, "stream": False, "max_tokens": 1}, headers=NODE,
                         timeout=30, trust_env=False)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_draining"
    t.join(timeout=120)
    assert done["text"].rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in done["text"]
    # the gateway sends every new request to the second node, draining seen by the probe or by the 503
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    for i in range(5):
        r = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": f"draining {i} " * 10}], max_tokens=1)
        assert r.headers["x-prefixgate-backend"] == "node:second"
    _until(lambda: any(n["draining"] for n in _health(url)["nodes"] if n["url"] == first), "/health says draining")
    httpx.post(f"{first}/internal/v1/drain", json={"draining": False}, headers=NODE, timeout=10, trust_env=False)
    assert httpx.get(f"{first}/health", timeout=10, trust_env=False).status_code == 200


def _running(url: str) -> int:
    stats = httpx.get(f"{url}/internal/v1/stats", headers=NODE, timeout=10, trust_env=False).json()
    return stats["running"] + stats["waiting"]


def test_a_gateway_gone_mid_stream_aborts_the_request_on_the_node(nodes) -> None:
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 400, "ignore_eos": True, "cache_salt": SALT_B,
            "stream": True}
    with httpx.stream("POST", f"{nodes[1]}/v1/completions", json=body, headers=NODE, timeout=60,
                      trust_env=False) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
        assert _running(nodes[1]) == 1
    _until(lambda: _running(nodes[1]) == 0, "the node aborted the request of the closed stream", timeout=30)


def test_sigusr1_drains_a_node(nodes) -> None:
    import signal

    NODE_PROCS[1].send_signal(signal.SIGUSR1)
    try:
        _until(lambda: httpx.get(f"{nodes[1]}/health", timeout=10, trust_env=False).status_code == 503,
               "SIGUSR1 drains the node")
        assert _health(nodes[1])["status"] == "draining"
    finally:
        r = httpx.post(f"{nodes[1]}/internal/v1/drain", json={"draining": False}, headers=NODE, timeout=10,
                       trust_env=False)
        assert r.json() == {"draining": False, "inflight": 0}


# -- nodes that fail: the wrong token, 5xx, hangs; what tenants, /health, /metrics and the log see --------


WRONG_TOKEN = "feedfacecafebeef" + "0123456789abcdef" * 3  # a token the node does not accept
WRONG_ENV = "PG_FLEET_WRONG_NODE_TOKEN"


@contextlib.contextmanager
def _gateway_for(tmp_path: Path, route: RouteConfig, **server):
    """A gateway (own home, one tenant, public /metrics) for ``route``: yields (url, key, app, home)."""
    home = tmp_path / "gw"
    svc = TenancyService.open(home)
    key = svc.create_tenant("acme").api_key
    svc.close()
    settings = GatewaySettings(home=home, routes=(route,), metrics_public=True, **server)
    app = create_app(settings)
    with LoopbackServer(app) as srv:
        yield srv.url, key, app, home


def _sdk(url: str, key: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout)


def _ask(url: str, key: str, i: int = 0, **kw):
    """One chat completion with its raw response (headers)."""
    return _sdk(url, key).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=2, **kw)


def _metric(url: str, name: str, **labels: str) -> float | None:
    """The value of one Prometheus sample of the gateway's /metrics (None: absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    for line in text.splitlines():
        named = line.startswith((name + "{", name + " "))
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def _backends(home: Path) -> list[str]:
    with sqlite3.connect(home / "prefixgate.db") as conn:
        return [b for (b,) in conn.execute("SELECT backend FROM usage ORDER BY created_at")]


def _node_lines(caplog, name: str, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"engine node {name} " in r.getMessage() and what in r.getMessage()]


def test_a_node_refusing_the_gateways_token_is_not_the_tenants_key_failing(nodes, tmp_path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="prefixgate.gateway")
    monkeypatch.setenv(WRONG_ENV, WRONG_TOKEN)
    route = RouteConfig(model="tiny", nodes=(nodes[0],), node_names=("gpu-a",), node_token_env=WRONG_ENV,
                        price="unpriced")
    with _gateway_for(tmp_path, route, node_probe_interval_s=0.2) as (url, key, _, home):
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as err:  # 502: the gateway's fault, not the key's
                if stream:
                    list(_sdk(url, key).chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True))
                else:
                    _ask(url, key)
            body = err.value.body
            assert err.value.status_code == 502 and body["code"] == "upstream_auth_failed"
            assert body["type"] == "server_error" and "gpu-a" in body["message"]
            text = json.dumps(body)
            assert WRONG_TOKEN[:4] not in text and "Incorrect API key" not in text and nodes[0] not in text
        # /health: the node is out, with the reason; the route has no node left
        health = _health(url)
        (node,) = health["nodes"]
        assert node["name"] == "gpu-a" and node["healthy"] is False and "node token" in node["last_error"]
        assert health["status"] == "degraded" and health["routes_down"] == ["tiny"]
        time.sleep(1.0)  # five more probe rounds: still one line
        lines = _node_lines(caplog, "gpu-a", "out of rotation")
        assert len(lines) == 1 and "node token" in lines[0] and WRONG_TOKEN[:4] not in lines[0]
        assert _metric(url, "prefixgate_gateway_node_up", node="node:gpu-a") == 0.0


def test_a_failover_is_credited_to_the_node_that_answered(nodes, tmp_path, monkeypatch) -> None:
    """A broken node (HTTP 500, healthy /health) and a real one, round robin: every request is served
    by the real node, and the header, the ledger rows, the metrics and the in-flight count say so."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    broken = FaultyNode("error")
    with LoopbackServer(broken.app) as bad:
        route = RouteConfig(model="tiny", nodes=(bad.url, nodes[0]), node_names=("broken", "good"),
                            node_token_env=TOKEN_ENV, price="unpriced")
        with _gateway_for(tmp_path, route, routing_policy="round_robin", node_cooldown_failures=100) as (
                url, key, app, home):
            for i in range(4):
                r = _ask(url, key, i)
                assert r.headers["x-prefixgate-backend"] == "node:good"
            assert broken.calls == 2  # round robin sent two of the four there first
            _until(lambda: len(_backends(home)) == 4, "4 ledger rows")
            assert _backends(home) == ["node:good"] * 4
            assert _metric(url, "prefixgate_gateway_requests_total", backend="node:good", outcome="ok") == 4
            assert _metric(url, "prefixgate_gateway_requests_total", backend="node:broken") is None
            assert _metric(url, "prefixgate_gateway_node_failovers_total", node="node:broken",
                           fault="server_error") == 2
            # a long stream that failed over: in flight on the node serving it, not on the broken one
            bad_b, good_b = app.state.router.routes["tiny"].backends
            stream = _sdk(url, key).completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=400,
                                                       stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))
            assert (bad_b.inflight, good_b.inflight) == (0, 1) and broken.calls == 3
            stream.close()
            _until(lambda: good_b.inflight == 0, "the closed stream left the node")
            assert bad_b.inflight == 0


def test_a_node_failing_mid_stream_bills_the_prompt_it_reported(tmp_path) -> None:
    """A node that fails after its prefill ran and its first token went out: the request is not moved
    (its tokens were sent) and its ledger row has the prompt and cache hit the node reported so far."""
    cutting = FaultyNode("cut")
    with LoopbackServer(cutting.app) as srv:
        route = RouteConfig(model="tiny", nodes=(srv.url,), node_names=("cutting",), price="unpriced")
        with _gateway_for(tmp_path, route) as (url, key, _, home):
            stream = _sdk(url, key).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True)
            with pytest.raises(openai.APIError):
                list(stream)
            _until(lambda: len(_ledger(home)) == 1, "the ledger row")
    assert _ledger(home) == [("error", CUT_USAGE["prompt_tokens"], CUT_USAGE["prompt_tokens_details"]["cached_tokens"])]


def test_a_request_moved_off_a_node_gone_away_is_credited_to_the_node_that_served_it(nodes, tmp_path,
                                                                                      monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    leaving = FaultyNode("ok")
    srv = LoopbackServer(leaving.app).__enter__()
    route = RouteConfig(model="tiny", nodes=(srv.url, nodes[0]), node_names=("gone", "good"),
                        node_token_env=TOKEN_ENV, price="unpriced")
    with _gateway_for(tmp_path, route, routing_policy="round_robin", node_probe_interval_s=60) as (url, key, _, home):
        srv.__exit__(None, None, None)  # after the start-up probe: the router still counts on it
        r = _ask(url, key)  # round robin's first pick is the gone node: refused, failed over
        assert r.headers["x-prefixgate-backend"] == "node:good"
        _until(lambda: len(_backends(home)) == 1, "the ledger row")
        assert _backends(home) == ["node:good"]
        assert _metric(url, "prefixgate_gateway_node_failovers_total", node="node:gone", fault="unreachable") == 1


def test_a_node_failing_requests_is_cooled_down_then_tried_again(nodes, tmp_path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="prefixgate.gateway")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    broken = FaultyNode("error")
    with LoopbackServer(broken.app) as bad:
        route = RouteConfig(model="tiny", nodes=(bad.url, nodes[0]), node_names=("broken", "good"),
                            node_token_env=TOKEN_ENV, price="unpriced")
        with _gateway_for(tmp_path, route, routing_policy="round_robin", node_probe_interval_s=0.2,
                          node_cooldown_failures=2, node_cooldown_s=2.0) as (url, key, _, _home):
            i = 0
            while broken.calls < 2:  # every request succeeds: the failures are failed over
                assert _ask(url, key, i).headers["x-prefixgate-backend"] == "node:good"
                i += 1
            node = {n["name"]: n for n in _health(url)["nodes"]}["broken"]
            assert node["healthy"] is False and node["consecutive_failures"] == 2 and node["cooldown_s"] > 0
            assert "server_error" in node["last_failure"] and _health(url)["status"] == "ok"
            for j in range(4):  # cooling down: not asked at all
                _ask(url, key, 100 + j)
            assert broken.calls == 2
            assert _metric(url, "prefixgate_gateway_node_cooldowns_total", node="node:broken") == 1
            assert _metric(url, "prefixgate_gateway_node_up", node="node:broken") == 0
            _until(lambda: len(_node_lines(caplog, "broken", "back in rotation")) == 1, "the cool-down ends")
            assert len(_node_lines(caplog, "broken", "out of rotation")) == 1
            for j in range(2):  # tried again; its one more failure sends it straight back
                assert _ask(url, key, 200 + j).headers["x-prefixgate-backend"] == "node:good"
            assert broken.calls == 3 and {n["name"]: n for n in _health(url)["nodes"]}["broken"]["cooldown_s"] > 0


def test_a_node_that_does_not_answer_in_time_is_failed_over(nodes, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    stuck = FaultyNode("hang")
    with LoopbackServer(stuck.app) as hung:
        route = RouteConfig(model="tiny", nodes=(hung.url, nodes[0]), node_names=("stuck", "good"),
                            node_token_env=TOKEN_ENV, price="unpriced")
        with _gateway_for(tmp_path, route, routing_policy="round_robin", node_read_timeout_s=0.5) as (
                url, key, _, _home):
            for i in range(2):  # the client waits 10 s; the gateway gives the node 0.5 s, then asks another
                r = _sdk(url, key, timeout=10).chat.completions.with_raw_response.create(
                    model="tiny", messages=[{"role": "user", "content": f"q {i}"}], max_tokens=2)
                assert r.headers["x-prefixgate-backend"] == "node:good"
            assert stuck.calls >= 1
            assert _metric(url, "prefixgate_gateway_node_failures_total", node="node:stuck", fault="timeout") >= 1


def test_tenants_see_node_names_never_node_urls_or_what_a_node_said(tmp_path) -> None:
    broken = FaultyNode("error")
    with LoopbackServer(broken.app) as bad:
        dead = f"http://127.0.0.1:{free_port()}"
        route = RouteConfig(model="tiny", nodes=(bad.url,), node_names=("gpu-b",), price="unpriced")
        with _gateway_for(tmp_path, route) as (url, key, _, _home):
            with pytest.raises(openai.InternalServerError) as err:
                _ask(url, key)
            assert err.value.status_code == 502 and err.value.body["code"] == "node_error"
            text = json.dumps(err.value.body)
            assert "gpu-b" in text and "CUDA" not in text and "secret-node-path" not in text and bad.url not in text
    route = RouteConfig(model="tiny", nodes=(dead,), price="unpriced")  # default name: "<model>-1"
    with _gateway_for(tmp_path / "2", route) as (url, key, _, _home):
        with pytest.raises(openai.InternalServerError) as err:
            _ask(url, key)
        assert err.value.status_code == 503 and err.value.body["code"] == "node_unavailable"
        assert "tiny-1" in err.value.body["message"] and "127.0.0.1" not in json.dumps(err.value.body)


def test_a_node_going_down_and_coming_back_is_one_log_line_each_and_a_gauge(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="prefixgate.gateway")
    node = FaultyNode("ok")
    with LoopbackServer(node.app) as srv:
        route = RouteConfig(model="tiny", nodes=(srv.url,), node_names=("flaky",), price="unpriced")
        with _gateway_for(tmp_path, route, node_probe_interval_s=0.1) as (url, key, _, _home):
            assert _ask(url, key).headers["x-prefixgate-backend"] == "node:flaky"
            assert _metric(url, "prefixgate_gateway_node_up", route="tiny", node="node:flaky") == 1
            assert _metric(url, "prefixgate_gateway_routed_requests_total") is not None
            node.health = 503
            _until(lambda: _metric(url, "prefixgate_gateway_node_up", node="node:flaky") == 0, "the probe sees it down")
            time.sleep(0.5)
            assert len(_node_lines(caplog, "flaky", "out of rotation")) == 1
            assert _health(url)["status"] == "degraded"
            node.health = 200
            _until(lambda: _metric(url, "prefixgate_gateway_node_up", node="node:flaky") == 1, "back up")
            time.sleep(0.5)
            assert len(_node_lines(caplog, "flaky", "back in rotation")) == 1
            assert len(_node_lines(caplog, "flaky", "out of rotation")) == 1
            assert _health(url)["status"] == "ok"
