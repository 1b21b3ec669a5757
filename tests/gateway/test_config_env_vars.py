"""What a config file may name from the environment: every `*_env` key must name a set variable, secrets
themselves are not read from the file, and `serve` reads $PREFIXGATE_DATABASE_URL / _REDIS_URL as the
admin commands do (flag > environment > file)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from gateway.cli.main import build_parser, main
from gateway.cli.serve_cmd import build_settings
from gateway.settings import read_config_file


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port kept busy: a `serve` that got past its settings fails at once instead of serving."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("entries, var", [
    ('[server]\nnode_token_env = "PG_CFG_UNSET_NODE"\n', "PG_CFG_UNSET_NODE"),
    ('[server]\nmetrics_token_env = "PG_CFG_UNSET_METRICS"\n', "PG_CFG_UNSET_METRICS"),
    ('[[routes]]\nmodel = "up"\nprovider = "openai/up"\napi_base = "http://127.0.0.1:9/v1"\n'
     'api_key_env = "PG_CFG_UNSET_UPSTREAM"\n', "PG_CFG_UNSET_UPSTREAM"),
    ('[[routes]]\nmodel = "pool"\nnodes = ["http://127.0.0.1:9"]\nnode_token_env = "PG_CFG_UNSET_POOL"\n',
     "PG_CFG_UNSET_POOL"),
])
@pytest.mark.parametrize("value", [None, ""])
def test_a_config_file_naming_an_unset_or_empty_variable_stops_serve_with_one_line(
        tmp_path, capsys, monkeypatch, held_port, entries, var, value):
    if value is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, value)
    cfg = tmp_path / "gw.toml"
    cfg.write_text('[engine]\nmodel = "none"\n' + entries)
    assert main(["serve", "--home", str(tmp_path), "--config", str(cfg), "--port", str(held_port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prefixgate: error: config file "), err
    assert f"'{var}': that environment variable is empty or unset" in err


def test_set_variables_fill_the_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("PG_CFG_NODE", "node-secret")
    monkeypatch.setenv("PG_CFG_METRICS", "metrics-secret")
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("server:\n  node_token_env: PG_CFG_NODE\n  metrics_token_env: PG_CFG_METRICS\n")
    values = read_config_file(cfg)
    assert (values["node_token"], values["metrics_token"]) == ("node-secret", "metrics-secret")


@pytest.mark.parametrize("key, hint", [
    ("node_token", "node_token_env"), ("metrics_token", "metrics_token_env"), ("home", "--home"), ("model_dir", "model"),
])
def test_secrets_and_command_line_paths_are_refused_in_the_file(tmp_path, key, hint):
    cfg = tmp_path / "gw.toml"
    cfg.write_text(f'[server]\n{key} = "value"\n')
    with pytest.raises(ValueError, match=f"`{key}`: .*{hint}"):
        read_config_file(cfg)


def test_serve_reads_the_database_url_from_the_environment_between_flag_and_file(tmp_path, capsys, monkeypatch):
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install 'prefixgate[fleet]')")
    unreachable = "postgresql://prefixgate@127.0.0.1:1/"  # refused at once: the message names the URL tried
    cfg = tmp_path / "gw.toml"
    cfg.write_text(f'[server]\ndatabase_url = "{unreachable}from_file"\n')
    monkeypatch.setenv("PREFIXGATE_DATABASE_URL", f"{unreachable}from_env")
    base = ["serve", "--home", str(tmp_path), "--model", "none", "--config", str(cfg), "--port", "0"]
    assert main(base) == 2
    assert f"{unreachable}from_env" in capsys.readouterr().err
    assert main([*base, "--database-url", f"{unreachable}from_flag"]) == 2
    assert f"{unreachable}from_flag" in capsys.readouterr().err


def test_serve_reads_the_redis_url_from_the_environment_between_flag_and_file(tmp_path, monkeypatch):
    cfg = tmp_path / "gw.toml"
    cfg.write_text('[server]\nredis_url = "redis://file:6379/0"\n')
    base = ["serve", "--model", "none", "--config", str(cfg)]
    assert build_settings(build_parser().parse_args(base), tmp_path).redis_url == "redis://file:6379/0"
    monkeypatch.setenv("PREFIXGATE_REDIS_URL", "redis://env:6379/0")
    assert build_settings(build_parser().parse_args(base), tmp_path).redis_url == "redis://env:6379/0"
    flagged = build_parser().parse_args([*base, "--redis-url", "redis://flag:6379/0"])
    assert build_settings(flagged, tmp_path).redis_url == "redis://flag:6379/0"
