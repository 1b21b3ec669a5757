"""A door's body costs no translation it is refused after (the DoS audit's many-small-strings
bodies), on a real uvicorn over loopback: the Responses and Messages doors (and count_tokens)
refuse a body over ``max_prompt_chars`` from the character count of the body as sent, before
translating it into a chat request. The translation and the chat body's validation were tenths of
a second of pure Python for 3 MB of small parts, holding the GIL against every other tenant's
stream, for a body refused anyway.

Where work ran is seen by wrapping the function that does it: each call records whether its thread
runs an event loop (the scan of a body, which every request schema calls first).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest
from gateway_fakes import FakeEngine, LoopbackServer

import gateway.ingress
from gateway.app import create_app
from gateway.ingress import scan
from gateway.routes.completions_asgi import OFF_LOOP_BYTES
from gateway.settings import GatewaySettings
from tenancy.service import TenancyService
from tests.fleetutil import read_rows

MAX_CHARS = 40_000
# 2,000 parts of 10 characters: as sent, 28 characters a Responses part ("type", "input_text",
# "text", the text) and 22 a Messages one; the chat body the Responses door made of it had 22 a
# part (still over the bound), the Messages door's joins them into one string (under it).
PARTS = 2_000
TEXT = "abcdefghij"


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _recording(seen: list[bool], fn: Callable) -> Callable:
    def recorded(*args: object, **kwargs: object) -> object:
        seen.append(_on_event_loop())
        return fn(*args, **kwargs)
    return recorded


@pytest.fixture
def scans(monkeypatch):
    """Where each body scan ran: True for the event loop's thread, False for a worker thread."""
    seen: list[bool] = []
    monkeypatch.setattr(gateway.ingress, "scan", _recording(seen, scan))
    return seen


def _serve(tmp_path, settings: GatewaySettings, engine: FakeEngine):
    tenancy = TenancyService.open(tmp_path)
    key = tenancy.create_tenant("acme").api_key
    return tenancy, key, LoopbackServer(create_app(settings, engine=engine, tenancy=tenancy))


@pytest.fixture
def served(tmp_path):
    """(gateway url, a tenant's key, the gateway's tenancy) with ``max_prompt_chars`` = MAX_CHARS."""
    tenancy, key, server = _serve(tmp_path, GatewaySettings(max_prompt_chars=MAX_CHARS), FakeEngine())
    try:
        with server as srv:
            yield srv.url, key, tenancy
    finally:
        tenancy.close()


def _post(url: str, key: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, timeout=60, trust_env=False,
                      headers={"Authorization": f"Bearer {key}", "x-api-key": key, "Content-Type": "application/json"})


def _statuses(tenancy: TenancyService) -> list[str]:
    tenancy.flush()
    return [r["status"] for r in read_rows(tenancy, "SELECT status FROM usage ORDER BY created_at")]


RESPONSES = {"model": "tiny", "max_output_tokens": 4,
             "input": [{"role": "user", "content": [{"type": "input_text", "text": TEXT}] * PARTS}]}
MESSAGES = {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}] * PARTS}]}
COUNT = {"model": "tiny", "messages": MESSAGES["messages"]}


def _openai_refusal(chars: int) -> dict:
    return {"error": {"message": f"the request holds {chars} characters of text; the limit is {MAX_CHARS}",
                      "type": "invalid_request_error", "param": "messages", "code": "request_too_large"}}


def _anthropic_refusal(chars: int) -> dict:
    return {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": f"messages: the request holds {chars} characters of text; the limit is {MAX_CHARS}"}}


@pytest.mark.parametrize("path, body, refusal", [
    ("/v1/responses", RESPONSES, _openai_refusal),
    ("/v1/messages", MESSAGES, _anthropic_refusal),
    ("/v1/messages/count_tokens", COUNT, _anthropic_refusal),
])
def test_a_door_refuses_a_body_over_the_character_bound_before_translating_it(served, scans, path, body, refusal):
    url, key, tenancy = served
    raw = json.dumps(body).encode()
    assert len(raw) > OFF_LOOP_BYTES  # validated in the tenant's worker thread
    chars = scan(json.loads(raw)).chars
    assert chars > MAX_CHARS
    r = _post(url, key, path, raw)
    assert r.status_code == 400, r.text
    assert r.json() == refusal(chars)  # the chat pipeline's 400, counting the body as sent
    assert scans == [False]  # the door's body, off the loop; no chat body was built (and scanned) from it
    assert _statuses(tenancy) == ["error"]  # its ledger row, as the chat pipeline's refusal had


def test_a_door_body_within_the_bound_is_served(served, scans):
    url, key, _ = served
    body = {**RESPONSES, "input": [{"role": "user", "content": [{"type": "input_text", "text": TEXT}] * 100}]}
    r = _post(url, key, "/v1/responses", json.dumps(body).encode())
    assert r.status_code == 200 and r.json()["object"] == "response", r.text
    assert len(scans) == 2  # the door's body and the chat body it became
