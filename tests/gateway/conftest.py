"""Fixtures the wire-compatibility tests (``test_wire_*.py``) share: a real ``prefixgate serve --model
tiny`` per test module (``wire_server.tiny_server``), the openai SDK on it, and raw HTTP to it. A module
that defines a fixture of the same name keeps its own."""

from __future__ import annotations

import openai
import pytest
from wire_server import poster, tiny_server


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
