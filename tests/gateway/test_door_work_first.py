"""A large body costs the event loop nothing, and a door's body no translation it is refused after
(the DoS audit's many-small-strings bodies), on a real uvicorn over loopback:

- the Responses and Messages doors (and count_tokens) refuse a body over ``max_prompt_chars`` from
  the character count of the body as sent, before translating it into a chat request: the
  translation and the chat body's validation were tenths of a second of pure Python for 3 MB of
  small parts, holding the GIL against every other tenant's stream, for a body refused anyway;
- ``pipeline.prepare``'s whole-body steps (the request's dump, the engine's messages, the miss
  tracker's render) run in the tenant's worker thread for a body over 64k characters.

Where work ran is seen by wrapping the function that does it: each call records whether its thread
runs an event loop (the scan of a body, which every request schema calls first; a model's dump).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from gateway_fakes import FakeEngine, LoopbackServer, on_event_loop

import gateway.ingress
from gateway.app import create_app
from gateway.ingress import scan
from gateway.miss_tracker import MissTracker
from gateway.routes.completions_asgi import OFF_LOOP_BYTES
from gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.settings import GatewaySettings
from tenancy.service import TenancyService
from tests.fleetutil import read_rows

MAX_CHARS = 40_000
# 2,000 parts of 10 characters: as sent, 28 characters a Responses part ("type", "input_text",
# "text", the text) and 22 a Messages one; the chat body the Responses door made of it had 22 a
# part (still over the bound), the Messages door's joins them into one string (under it).
PARTS = 2_000
TEXT = "abcdefghij"


def _recording(seen: list[bool], fn: Callable) -> Callable:
    def recorded(*args: object, **kwargs: object) -> object:
        seen.append(on_event_loop())
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
    """The Responses API's refusal: its param is that API's prompt field, ``input``."""
    return {"error": {"message": f"the request holds {chars} characters of text; the limit is {MAX_CHARS}",
                      "type": "invalid_request_error", "param": "input", "code": "request_too_large"}}


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


@pytest.fixture
def roomy(tmp_path):
    """A gateway whose engine takes long prompts: a large request runs all the way through prepare."""
    tenancy, key, server = _serve(tmp_path, GatewaySettings(), FakeEngine(max_model_len=200_000))
    try:
        with server as srv:
            yield srv.url, key
    finally:
        tenancy.close()


@pytest.fixture
def body_work(monkeypatch):
    """Where each whole-body step of ``prepare`` ran: the request's dump, a message's dump (the engine's
    messages), the miss tracker's look at the prompt. True for the event loop's thread."""
    seen: list[bool] = []
    for cls, name in ((ChatCompletionRequest, "model_dump"), (CompletionRequest, "model_dump"),
                      (ChatMessage, "model_dump"), (MissTracker, "observe")):
        monkeypatch.setattr(cls, name, _recording(seen, getattr(cls, name)))
    return seen


def _chat(parts: int) -> bytes:
    content = [{"type": "text", "text": f"word{i} "} for i in range(parts)]
    return json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}).encode()


def _completion(words: int) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 2, "prompt": " ".join(["word"] * words)}).encode()


@pytest.mark.parametrize("path, large, small", [
    ("/v1/chat/completions", _chat(4_000), _chat(10)),  # 4,000 parts, 84k characters as sent
    ("/v1/completions", _completion(20_000), _completion(10)),  # 100k characters
])
def test_prepare_walks_a_large_body_off_the_event_loop(roomy, body_work, path, large, small):
    url, key = roomy
    r = _post(url, key, path, small)
    assert r.status_code == 200, r.text
    assert body_work and all(body_work)  # a small body: inline, cheaper than a thread hop
    body_work.clear()
    r = _post(url, key, path, large)
    assert r.status_code == 200, r.text
    assert body_work and not any(body_work), body_work  # every whole-body step in the tenant's worker thread
