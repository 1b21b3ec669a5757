"""Pure units of the gateway: settings files, CLI flag errors, routing, usage normalisation, node wire."""

from __future__ import annotations

import hashlib

import pytest
from gateway_fakes import FakeEngine

from engine.disagg.request_wire import request_from_wire, request_to_wire
from engine.protocol import GenerateRequest, InvalidRequestError, SamplingParams, StaticTenantScope
from gateway.cli.main import main
from gateway.routing import Backend, BackendKind, choose, rendezvous_order, routing_key
from gateway.settings import GatewaySettings, RouteConfig, read_config_file
from gateway.upstream import normalize_usage


def test_toml_and_yaml_config(tmp_path, monkeypatch):
    monkeypatch.setenv("PG_NODE_TOKEN", "s3cret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")  # a named variable must be set (test_config_env_vars.py)
    toml = tmp_path / "gw.toml"
    toml.write_text(
        '[server]\nport = 9001\nmax_body_bytes = "1MiB"\nnode_token_env = "PG_NODE_TOKEN"\n'
        '[engine]\nmodel = "tiny"\ndram_bytes = "2GiB"\n'
        '[[routes]]\nmodel = "gpt-4o-mini"\nprovider = "openai/gpt-4o-mini"\napi_key_env = "OPENAI_API_KEY"\n'
        '[[routes]]\nmodel = "big"\nnodes = ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]\n'
    )
    s = GatewaySettings(**read_config_file(toml))
    assert (s.port, s.max_body_bytes, s.dram_bytes, s.node_token) == (9001, 1024**2, 2 * 1024**3, "s3cret")
    assert [r.model for r in s.routes] == ["gpt-4o-mini", "big"] and s.routes[1].nodes[1] == "http://10.0.0.3:8000"
    yml = tmp_path / "gw.yaml"
    yml.write_text("server:\n  port: 9002\nroutes:\n  - model: m\n    provider: openai/m\n    cache_salt: true\n")
    s2 = GatewaySettings(**read_config_file(yml))
    assert s2.port == 9002 and s2.routes[0].cache_salt


def test_config_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\nport=1")
    with pytest.raises(ValueError, match="cannot parse config file"):
        read_config_file(bad)
    ini = tmp_path / "x.ini"
    ini.write_text("port = 1\n")
    with pytest.raises(ValueError, match="must end in"):
        read_config_file(ini)
    extra = tmp_path / "extra.toml"
    extra.write_text("[servers]\nport=1\n")
    with pytest.raises(ValueError, match="unknown sections"):
        read_config_file(extra)
    with pytest.raises(ValueError, match="exactly one of"):
        RouteConfig(model="m", provider="openai/m", nodes=("http://x",))
    with pytest.raises(ValueError, match="duplicate"):
        GatewaySettings(routes=(RouteConfig(model="m", provider="a/b"), RouteConfig(model="m", provider="a/c")))


@pytest.mark.parametrize("flags, message", [
    (["--dram-bytes", "lots"], "--dram-bytes: invalid size 'lots'"),
    (["--nvme-bytes=-1GiB"], "--nvme-bytes: invalid size"),
    (["--kv-blocks", "1"], "--kv-blocks must be >= 2"),
    (["--port", "http"], "--port must be an integer"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--model", "/no/such/dir"], "not a checkpoint directory"),
    (["--config", "/no/such.toml"], "cannot read config file"),
    (["--model", "none", "--node-token-env", "PG_UNSET_TOKEN_VAR"], "PG_UNSET_TOKEN_VAR"),
    (["--model", "none", "--max-model-len", "0"], "--max-model-len must be >= 1"),
])
def test_serve_flag_errors_exit_2_with_one_line(tmp_path, capsys, flags, message):
    assert main(["serve", "--home", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prefixgate: error: ") and message in err


def _backends(n):
    return [Backend(f"node:http://10.0.0.{i}:8000", BackendKind.NODE, FakeEngine(), "") for i in range(n)]


def test_rendezvous_is_stable_and_moves_few_keys():
    nodes = _backends(4)
    keys = [routing_key(hashlib.sha256(b"t%d" % i).digest(), b"prompt", 1024) for i in range(400)]
    owner = {k: rendezvous_order(k, nodes)[0].label for k in keys}
    assert len(set(owner.values())) == 4  # every node owns some keys
    fewer = nodes[:3]  # removing a node moves only the keys it owned
    moved = [k for k in keys if rendezvous_order(k, fewer)[0].label != owner[k]]
    assert all(owner[k] == nodes[3].label for k in moved)
    assert rendezvous_order(keys[0], list(reversed(nodes)))[0].label == owner[keys[0]]


def test_routing_key_uses_namespace_and_prefix_blocks():
    ns_a, ns_b = b"a" * 32, b"b" * 32
    long_a = b"x" * 1024 + b"tail one"
    long_b = b"x" * 1024 + b"tail two, different"
    assert routing_key(ns_a, long_a, 1024) == routing_key(ns_a, long_b, 1024)  # shared 1 KiB prefix
    assert routing_key(ns_a, long_a, 1024) != routing_key(ns_b, long_a, 1024)  # tenants never share
    assert routing_key(ns_a, b"x" * 256 + b"y" * 256, 1024) != routing_key(ns_a, b"x" * 256 + b"z" * 256, 1024)
    assert routing_key(ns_a, b"short", 1024) != routing_key(ns_a, b"other", 1024)


def test_load_guard_falls_back_to_least_loaded():
    nodes = _backends(3)
    key = routing_key(b"ns", b"p", 1024)
    best = rendezvous_order(key, nodes)[0]
    assert choose(key, nodes, 2.0) is best
    best.inflight = 2  # 2 <= 2 * (0 + 1): still the cache-affine choice
    assert choose(key, nodes, 2.0) is best
    best.inflight = 3
    chosen = choose(key, nodes, 2.0)
    assert chosen is not best and chosen.inflight == 0


def test_normalize_usage_provider_shapes():
    openai = {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 64}}
    assert normalize_usage(openai) == normalize_usage(openai).__class__(100, 64, 5, 0)
    anthropic = {"input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 80,
                 "cache_creation_input_tokens": 20}
    u = normalize_usage(anthropic)
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.cache_creation_tokens) == (110, 80, 7, 20)
    deepseek = {"prompt_tokens": 50, "completion_tokens": 3, "prompt_cache_hit_tokens": 32,
                "prompt_cache_miss_tokens": 18}
    assert (normalize_usage(deepseek).prompt_tokens, normalize_usage(deepseek).cached_tokens) == (50, 32)
    assert normalize_usage({"prompt_tokens": 9, "completion_tokens": 1}).cached_tokens == 0


def test_split_request_wire_round_trip():
    scope = StaticTenantScope(namespace=b"\x01\x02", metrics_label="acme", priority=2, kv_block_quota=10)
    req = GenerateRequest(request_id="r", tenant=scope, sampling=SamplingParams(max_tokens=3, stop=("x",), seed=1),
                          messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}], model="m")
    back = request_from_wire(request_to_wire(req))
    assert back.tenant.namespace == b"\x01\x02" and back.tenant.priority == 2 and back.tenant.cipher is None
    assert back.sampling == req.sampling and list(back.messages) == list(req.messages) and back.model == "m"


def test_prompt_logprobs_cross_the_split_wire_and_are_refused_on_node_routes():
    """A scored request reaches a prefill/decode node whole (its sampling round-trips), but the node's
    OpenAI API has no way to send prompt logprobs back: the node route refuses it, never drops it."""
    from gateway.remote import request_body

    req = GenerateRequest(request_id="r", tenant=StaticTenantScope(), prompt_token_ids=[1, 2, 3],
                          sampling=SamplingParams(max_tokens=0, prompt_logprobs=2))
    back = request_from_wire(request_to_wire(req))
    assert back.sampling.prompt_logprobs == 2 and back.sampling.max_tokens == 0
    with pytest.raises(InvalidRequestError, match="prompt logprobs"):
        request_body(req, "m")


def test_serve_settings_from_flags_and_file(tmp_path):
    from gateway.cli.main import build_parser
    from gateway.cli.serve_cmd import build_settings

    cfg = tmp_path / "gw.yaml"
    cfg.write_text("server:\n  port: 9100\nengine:\n  dram_bytes: 1GiB\n")
    args = build_parser().parse_args(["serve", "--config", str(cfg), "--port", "9200", "--model", "none",
                                      "--kv-blocks", "64", "--nvme-bytes", "2GiB"])
    s = build_settings(args, tmp_path)
    assert s.port == 9200  # a flag beats the file
    assert s.dram_bytes == 1024**3 and s.kv_blocks == 64 and s.model is None and s.home == tmp_path
    assert s.nvme_bytes == 2 * 1024**3 and s.nvme_dir == tmp_path / "nvme"


def test_sse_chunks_are_split_on_lines_whatever_the_pieces():
    """The direct transport splits the upstream's event stream itself: an event cut across pieces,
    CRLF line ends, a last event without its blank line and [DONE] all come out right."""
    import asyncio

    from gateway.upstream import _sse_chunks

    stream = (b'data: {"a": 1}\r\n\r\n: keep-alive\n\ndata: {"b": "x\\ny"}\n\n'
              b'data: {"c": [1, 2]}\n\ndata: [DONE]\n\ndata: {"late": true}')

    async def collect(size: int) -> list[dict]:
        async def pieces():
            for i in range(0, len(stream), size):
                yield stream[i:i + size]

        return [chunk async for chunk in _sse_chunks(pieces())]

    expected = [{"a": 1}, {"b": "x\ny"}, {"c": [1, 2]}, {"late": True}]
    for size in (1, 3, 7, len(stream)):
        assert asyncio.run(collect(size)) == expected


def test_env_proxy_is_read_for_the_upstream_once(monkeypatch):
    from gateway.upstream import env_proxy_for

    for name in ("HTTPS_PROXY", "https_proxy", "http_proxy", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    assert env_proxy_for("http://api.example.com/v1") == "http://proxy.internal:3128"
    assert env_proxy_for("http://127.0.0.1:8000/v1") is None
    assert env_proxy_for("https://api.example.com/v1") is None  # no HTTPS_PROXY set
