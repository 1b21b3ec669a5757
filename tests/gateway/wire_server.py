"""What the wire-compatibility tests (``test_wire_*.py``) share: a real ``prefixgate serve --model tiny``
with one tenant, raw HTTP to it, and the check of a 400 in the OpenAI envelope."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from tenancy.service import TenancyService
from tests.serverutil import serve_tiny, stop

FORCED = 15339  # a token id that +100 logit_bias makes greedy emit (test_tools_sdk.py uses it too)

Post = Callable[[str, dict], httpx.Response]


def tiny_server(home: Path) -> Iterator[tuple[str, str]]:
    """Serve the tiny model under ``home``; yields (url, tenant key), stops the server after."""
    with TenancyService.open(home) as svc:
        key = svc.create_tenant("wire").api_key
        svc.flush()
    url, proc = serve_tiny(home, "--kv-blocks", "256", timeout=300)
    try:
        yield url, key
    finally:
        stop(proc)


def poster(url: str, key: str) -> Post:
    """``post(path, body)``: the JSON body to ``url + path`` with the tenant's bearer key."""
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120,
                          trust_env=False)
    return post


def error_of(resp: httpx.Response, param: str) -> dict:
    """The OpenAI error envelope of a 400 naming ``param``."""
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


def max_model_len(url: str, key: str) -> int:
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, trust_env=False).json()
    return models["data"][0]["max_model_len"]
