"""Engine-node settings that cannot work are refused when the config loads, not at the first request:
node URLs (scheme, host, port) and node names; `prefixgate serve` says so in one line, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from gateway.settings import RouteConfig
from tests.serverutil import REPO, error_lines, free_port


@pytest.mark.parametrize("url,problem", [
    ("127.0.0.1:8901", "http:// or https://"),  # no scheme
    ("ftp://127.0.0.1:8901", "http:// or https://"),
    ("http://127.0.0.1:99999", "not a valid URL"),
    ("http://127.0.0.1:port", "not a valid URL"),
    ("http://:8901", "no host"),
])
def test_a_node_url_that_cannot_work_is_refused(url: str, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        RouteConfig(model="m", nodes=("http://127.0.0.1:8000", url))
    with pytest.raises(ValidationError, match=problem):
        RouteConfig(model="m", nodes=("http://127.0.0.1:8000",), prefill_nodes=(url,))


def test_node_urls_and_names_that_work() -> None:
    route = RouteConfig(model="m", nodes=("http://10.0.0.2:8000", "https://node-b.internal", "http://[::1]:9001/"))
    assert route.names_of_nodes == ("m-1", "m-2", "m-3")
    named = RouteConfig(model="m", nodes=("http://a:1", "http://b:2"), node_names=("gpu-a", "gpu.b_2"))
    assert named.names_of_nodes == ("gpu-a", "gpu.b_2")


@pytest.mark.parametrize("names,problem", [
    (("a",), "one name per node"),
    (("a", "a"), "distinct"),
    (("a", "bad name"), "letters, digits"),
    (("a", "x" * 65), "letters, digits"),
])
def test_node_names_are_one_per_node_distinct_and_header_safe(names: tuple[str, ...], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        RouteConfig(model="m", nodes=("http://a:1", "http://b:2"), node_names=names)


def test_serve_refuses_a_bad_node_url_in_one_line(tmp_path) -> None:
    config = tmp_path / "gw.toml"
    config.write_text('[[routes]]\nmodel = "tiny"\nnodes = ["http://127.0.0.1:8901", "127.0.0.1:8902"]\n')
    res = subprocess.run(
        [sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(tmp_path / "home"), "--model", "none",
         "--port", str(free_port()), "--config", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (line,) = error_lines(res.stderr)
    assert "'127.0.0.1:8902'" in line and "http:// or https://" in line
