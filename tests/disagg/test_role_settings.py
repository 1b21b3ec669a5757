"""`serve --role` and split routes: bad combinations are one line and exit code 2 / a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from gateway.settings import GatewaySettings, RouteConfig
from tests.serverutil import REPO, error_lines


def test_role_without_node_token_exits_2_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(tmp_path), "--model", "none",
                        "--role", "decode"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and "role decode needs a local engine" in lines[0]


def test_settings_validation(tmp_path):
    with pytest.raises(ValidationError, match="needs a node token"):
        GatewaySettings(role="prefill", model="tiny", model_dir=tmp_path)
    assert GatewaySettings(role="decode", model="tiny", model_dir=tmp_path, node_token="t").kv_port == 0
    with pytest.raises(ValidationError, match="prefill_nodes` needs `nodes`"):
        RouteConfig(model="m", provider="openai/x", prefill_nodes=("http://p",))


def test_a_kv_advertise_host_that_is_no_host_exits_2_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(tmp_path), "--model", "none",
                        "--kv-advertise-host", "10.0.0.5:8202"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and "kv_advertise_host" in lines[0]
    assert GatewaySettings(kv_advertise_host="fd00::5").kv_advertise_host == "fd00::5"


def test_split_when_decode_idle_is_a_route_setting(tmp_path):
    from gateway.app import build_router
    from gateway.disagg_client import DisaggEngineClient

    route = RouteConfig(model="m", nodes=("http://127.0.0.1:9",), prefill_nodes=("http://127.0.0.1:10",),
                        split_when_decode_idle=False)
    router = build_router(GatewaySettings(home=tmp_path, routes=(route,)))
    clients = [b.client for b in router.routes["m"].backends]
    assert clients and all(isinstance(c, DisaggEngineClient) and not c.policy.split_when_decode_idle
                           for c in clients)
    assert RouteConfig(model="m", nodes=("http://n",), prefill_nodes=("http://p",)).split_when_decode_idle
