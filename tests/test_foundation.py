"""The skeleton's own contracts: CLI discovery, size parsing, protocol validation."""

import subprocess
import sys

import pytest

from engine.config import EngineConfig, parse_size
from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope, TenantScope


def test_parse_size_units():
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("8GiB") == 8 * 1024**3
    assert parse_size("4096") == 4096
    assert parse_size("1.5GB") == 1_500_000_000
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("-3MiB")


def test_engine_config_validates():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model_dir="x", block_size=12)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model_dir="x", device="tpu")
    cfg = EngineConfig(model_dir="some/dir")
    assert cfg.resolved_model_id == "dir"


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    assert SamplingParams(max_tokens=0).max_tokens == 0  # the prompt only (echo, scoring)
    with pytest.raises(ValueError, match="prompt logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert SamplingParams(temperature=0).greedy


def test_generate_request_needs_exactly_one_input():
    scope = StaticTenantScope()
    assert isinstance(scope, TenantScope)
    with pytest.raises(ValueError, match="exactly one"):
        GenerateRequest(request_id="r", tenant=scope)
    with pytest.raises(ValueError, match="exactly one"):
        GenerateRequest(request_id="r", tenant=scope, prompt="a", prompt_token_ids=[1])
    GenerateRequest(request_id="r", tenant=scope, prompt="hello")


def test_cli_help_and_unknown_command():
    ok = subprocess.run([sys.executable, "-m", "gateway.cli.main", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "prefixgate" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "gateway.cli.main", "no-such-cmd"], capture_output=True, text=True)
    assert bad.returncode == 2


def test_home_flag_before_or_after_the_subcommand():
    from gateway.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["--home", "/x", "serve"]).home == "/x"
    assert parser.parse_args(["serve", "--home", "/y"]).home == "/y"
    assert parser.parse_args(["serve"]).home is None
