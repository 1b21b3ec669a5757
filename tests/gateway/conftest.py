"""Fixtures the gateway tests share: for the wire-compatibility tests (``test_wire_*.py``) a real
``prefixgate serve --model tiny`` per test module (``wire_server.tiny_server``), the openai SDK on it and
raw HTTP to it; for in-process apps a real engine on the tiny checkpoint. A module that defines a
fixture of the same name keeps its own."""

from __future__ import annotations

import openai
import pytest
from wire_server import poster, tiny_server

from engine.config import EngineConfig
from engine.launch import build_engine


@pytest.fixture
def tiny_engine(tiny_model_dir):
    """A real in-process engine (64 KV blocks) on the tiny checkpoint, shut down after the test."""
    engine = build_engine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=64))
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    """(url, tenant key) of a tiny server of this test module's own."""
    yield from tiny_server(tmp_path_factory.mktemp(f"pg-{request.module.__name__.rsplit('.', 1)[-1]}"))


@pytest.fixture(scope="module")
def oai(server):
    url, key = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def post(server):
    return poster(*server)
