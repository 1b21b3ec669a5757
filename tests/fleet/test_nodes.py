"""Engine nodes behind a gateway: two real `prefixgate serve --model tiny` nodes on loopback, reached
through the OpenAI-compatible API that vLLM speaks (token-id prompts, ``cache_salt``), driven by the
real openai SDK; a real gateway (own home, real SQLite ledger) in front of them.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import GatewaySettings, RouteConfig
from tenancy.service import TenancyService
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
    route = RouteConfig(model="tiny", nodes=(dead, *nodes), node_token_env=TOKEN_ENV, price="unpriced")
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
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    used = set()
    for i in range(6):  # different prompts spread over the nodes; none reaches the dead one
        messages = [MESSAGES[0], {"role": "user", "content": f"question {i}"}]
        r = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=2)
        used.add(r.headers["x-prefixgate-backend"])
    assert used and f"node:{dead}" not in used
    again = client.chat.completions.create(model="tiny", messages=[MESSAGES[0], {"role": "user", "content": "question 0"}],
                                           max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    seen = {n["url"]: n["cached_tokens"] for n in _health(url)["nodes"]}
    assert all(seen[b.removeprefix("node:")] == "reported" for b in used) and seen[dead] == "unknown"
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
        assert r.headers["x-prefixgate-backend"] == f"node:{second}"
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
