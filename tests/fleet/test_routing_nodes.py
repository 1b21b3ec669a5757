"""kv_aware routing over real engine nodes on loopback: two `prefixgate serve --model tiny` processes
publish their KV events, a gateway (real tenancy, real uvicorn) subscribes and routes on them."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest

zmq = pytest.importorskip("zmq", reason="pip install 'prefixgate[fleet]' (pyzmq)")
msgpack = pytest.importorskip("msgpack", reason="pip install 'prefixgate[fleet]' (msgpack)")

from engine.block_hashing import prefix_block_hashes  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.settings import GatewaySettings, RouteConfig  # noqa: E402
from tenancy.service import TenancyService  # noqa: E402
from tests.gateway.gateway_fakes import LoopbackServer  # noqa: E402
from tests.serverutil import REPO, free_port, serve_tiny, stop, wait_for  # noqa: E402

TOKEN_ENV = "PG_ROUTING_NODE_TOKEN"


def _child_env() -> dict[str, str]:
    """The nodes import pyzmq/msgpack from wherever this process found them."""
    dirs = [str(REPO)] + sorted({str(Path(m.__file__).parent.parent) for m in (zmq, msgpack)})
    return {"PYTHONPATH": os.pathsep.join(dirs), TOKEN_ENV: "node-secret"}


@pytest.fixture(scope="module")
def kv_nodes(tmp_path_factory):
    procs, nodes = [], []
    try:
        for i in range(2):
            home = tmp_path_factory.mktemp(f"node{i}")
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            (home / "node.toml").write_text(f'[server]\nnode_token_env = "{TOKEN_ENV}"\n'
                                            f'[engine]\nkv_events_endpoint = "{endpoint}"\n')
            url, proc = serve_tiny(home, "--config", str(home / "node.toml"), env=_child_env())
            procs.append(proc)
            nodes.append((url, endpoint))
        yield nodes
    finally:
        for proc in procs:
            stop(proc)


def test_a_request_goes_to_the_node_that_holds_its_prefix_and_tenants_stay_apart(kv_nodes, tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "node-secret")
    home = tmp_path / "gw"
    admin = TenancyService.open(home)
    keys = {name: admin.create_tenant(name).api_key for name in ("acme", "globex")}
    namespaces = {name: admin.authenticate(key).namespace for name, key in keys.items()}
    admin.close()
    route = RouteConfig(model="tiny", nodes=tuple(u for u, _ in kv_nodes), kv_events=tuple(e for _, e in kv_nodes),
                        node_token_env=TOKEN_ENV)
    settings = GatewaySettings(home=home, routes=(route,), routing_policy="kv_aware", route_prefix_tokens=256)
    app = create_app(settings)
    with LoopbackServer(app) as gw:
        router = app.state.router
        labels = [f"node:tiny-{i}" for i in range(1, len(kv_nodes) + 1)]  # the default node names
        clients = {n: openai.OpenAI(base_url=f"{gw.url}/v1", api_key=k, max_retries=0) for n, k in keys.items()}
        served = 0
        for family in range(4):
            # 6 shared blocks (96 tokens), then the two requests diverge long before the 256-token span
            # that prefix_hash's rendezvous key covers: only the index can bring the second one home.
            shared = [(family * 131 + 7 * j) % 500 + 3 for j in range(96)]
            first = shared + [(family * 17 + j) % 400 + 5 for j in range(200)]
            second = shared + [(family * 23 + j) % 300 + 11 for j in range(200)]
            r1 = clients["acme"].completions.create(model="tiny", prompt=first, max_tokens=1, temperature=0)
            chain = prefix_block_hashes(namespaces["acme"], first, 16)
            assert wait_for(lambda c=chain: max(router.index.prefix_lengths(c, labels).values()) == len(c)), \
                "the node's BlockStored events never reached the gateway's index"
            r2 = clients["acme"].completions.create(model="tiny", prompt=second, max_tokens=1, temperature=0)
            assert r1.usage.prompt_tokens_details is None or r1.usage.prompt_tokens_details.cached_tokens == 0
            assert r2.usage.prompt_tokens_details.cached_tokens == 96, f"family {family}: not routed to the holder"
            served += 1
            # the other tenant's identical prompt shares no block with acme's, wherever it lands
            r3 = clients["globex"].completions.create(model="tiny", prompt=first, max_tokens=1, temperature=0)
            cached = r3.usage.prompt_tokens_details.cached_tokens if r3.usage.prompt_tokens_details else 0
            assert cached == 0
        assert served == 4 and router.routed_prefix_blocks >= 4 * 6
        assert all(s.gaps == 0 and s.bad_payloads == 0 for s in router.events.stats.values())


def test_a_pool_with_a_tokenizer_routes_chat_on_the_nodes_block_chain(kv_nodes, tmp_path, monkeypatch,
                                                                        tiny_model_dir):
    """RouteConfig.tokenizer: the gateway renders chat itself and sends token ids, so kv_aware sees
    the chain the node caches -- a chat that shares its system block(s) with an earlier one and
    parts from it inside the 256-token rendezvous span still lands on the node holding them. The
    ids are the ones the node renders itself (same prompt_tokens as asking the node directly)."""
    from engine.prompt_tokenizer import PromptTokenizer
    from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope

    monkeypatch.setenv(TOKEN_ENV, "node-secret")
    home = tmp_path / "gw"
    admin = TenancyService.open(home)
    key = admin.create_tenant("acme").api_key
    namespace = admin.authenticate(key).namespace
    admin.close()
    route = RouteConfig(model="tiny", nodes=tuple(u for u, _ in kv_nodes), kv_events=tuple(e for _, e in kv_nodes),
                        node_token_env=TOKEN_ENV, tokenizer=str(tiny_model_dir))
    settings = GatewaySettings(home=home, routes=(route,), routing_policy="kv_aware", route_prefix_tokens=256)
    tokenizer = PromptTokenizer.from_dir(tiny_model_dir)
    scope = StaticTenantScope(namespace=namespace, metrics_label="acme")
    labels = [f"node:tiny-{i}" for i in range(1, len(kv_nodes) + 1)]  # the default node names
    app = create_app(settings)
    with LoopbackServer(app) as gw:
        router = app.state.router
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
        node = openai.OpenAI(base_url=f"{kv_nodes[0][0]}/v1", api_key="node-secret", max_retries=0)
        for family in range(3):
            # no trailing whitespace: the gateway's safe canonicalization trims it for tenants, and the
            # node's own path (asked with the node token) does not canonicalize
            system = (f"Family {family} support desk. Answer briefly and politely, in English. " * 3).strip()
            asks = [" ".join(f"w{family}q{k}x{j}" for j in range(60)) for k in range(2)]
            first, second = ([{"role": "system", "content": system}, {"role": "user", "content": a}] for a in asks)
            r1 = client.chat.completions.create(model="tiny", messages=first, max_tokens=1, temperature=0)
            direct = node.chat.completions.create(model="tiny", messages=first, max_tokens=1, temperature=0)
            assert r1.usage.prompt_tokens == direct.usage.prompt_tokens  # the ids the node renders itself
            ids = tokenizer.tokenize(GenerateRequest(request_id="probe", tenant=scope, messages=first,
                                                     sampling=SamplingParams(max_tokens=1)))
            chain = prefix_block_hashes(namespace, ids, 16)
            assert wait_for(lambda c=chain: max(router.index.prefix_lengths(c, labels).values()) == len(c)), \
                "the chat's blocks never reached the index under the chain the gateway computed"
            r2 = client.chat.completions.create(model="tiny", messages=second, max_tokens=1, temperature=0)
            assert r2.usage.prompt_tokens_details.cached_tokens >= 16, f"family {family}: not routed to the holder"
