"""Large bodies never cost the event loop (the DoS audit's leftovers), on a real uvicorn over loopback:

- a body over ``OFF_LOOP_BYTES`` is validated in the tenant's worker thread on every costly door,
  the Responses and Messages doors (and count_tokens, cache warming) included, which FastAPI used
  to parse and validate on the event loop; a refused one gets the very 400 FastAPI gives;
- a body of more token ids than ``MAX_TOKEN_IDS`` is refused from its raw bytes: ~2 M ids are never
  decoded into Python integers to be counted (that held the GIL for a second or more).

Where validation ran is seen by wrapping ``gateway.ingress.scan``, which every request schema calls
first on the parsed body: each call records whether its thread runs an event loop.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from gateway_fakes import FakeEngine, LoopbackServer, on_event_loop

import gateway.ingress
from gateway.app import create_app
from gateway.ingress import MAX_TOKEN_IDS, BodyShape, excess_token_ids, scan
from gateway.routes.completions_asgi import OFF_LOOP_BYTES
from gateway.settings import GatewaySettings
from tenancy.service import TenancyService
from tests.fleetutil import read_rows

PAD = "z" * (OFF_LOOP_BYTES + 1000)  # an extra field (the doors keep unknown fields) that makes a body large


@pytest.fixture
def scans(monkeypatch):
    """Where each body scan ran: True for the event loop's thread, False for a worker thread."""
    seen: list[bool] = []

    def recorded(value: object, **kwargs: int) -> BodyShape:
        seen.append(on_event_loop())
        return scan(value, **kwargs)

    monkeypatch.setattr(gateway.ingress, "scan", recorded)
    return seen


@pytest.fixture
def served(tmp_path):
    """(gateway url, a tenant's key, the gateway's tenancy) on a real uvicorn with a fake engine."""
    tenancy = TenancyService.open(tmp_path)
    key = tenancy.create_tenant("acme").api_key
    try:
        with LoopbackServer(create_app(GatewaySettings(), engine=FakeEngine(), tenancy=tenancy)) as srv:
            yield srv.url, key, tenancy
    finally:
        tenancy.close()


def _statuses(tenancy: TenancyService) -> list[str]:
    tenancy.flush()
    return [r["status"] for r in read_rows(tenancy, "SELECT status FROM usage ORDER BY created_at")]


def _post(url: str, key: str, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, timeout=60, trust_env=False,
                      headers={"Authorization": f"Bearer {key}", "x-api-key": key, "Content-Type": "application/json"})


def test_the_sdks_large_bodies_are_served_and_validated_off_the_event_loop(served, scans):
    url, key, _ = served
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)
    small = oai.responses.create(model="tiny", input="hello", max_output_tokens=4)
    assert scans and all(scans)  # a small body: validated on the loop (cheaper than a thread hop), as chat too
    scans.clear()
    big = oai.responses.create(model="tiny", input="hello", max_output_tokens=4, extra_body={"padding": PAD})
    assert big.status == small.status and big.output_text == small.output_text
    message = claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hello"}],
                                     extra_body={"padding": PAD})
    assert message.type == "message" and message.content[0].text
    counted = claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                           extra_body={"padding": PAD})
    assert counted.input_tokens > 0
    assert len(scans) >= 3 and not any(scans), scans  # every large body: in the tenant's worker thread


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": "tiny", "input": "hello", "max_output_tokens": "lots"}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": "hello"}),
    ("/v1/messages/count_tokens", {"model": "tiny"}),
    ("/v1/cache/warm", {"model": "tiny", "messages": []}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": "two"}),
])
def test_a_large_refused_body_gets_fastapis_400_off_the_event_loop(served, scans, path, body):
    """The same error (the door's shape, message and param) as the small body FastAPI refuses, and
    the same accounting: a ledger row each."""
    url, key, tenancy = served
    small = _post(url, key, path, body)
    assert small.status_code == 400, small.text
    rows = _statuses(tenancy)  # count_tokens is not billed: no row for its refusals either
    scans.clear()
    # cache warming refuses unknown fields: a long user instead (its error comes after the messages')
    padding = {"user": "u" * (OFF_LOOP_BYTES + 10)} if path == "/v1/cache/warm" else {"padding": PAD}
    large = _post(url, key, path, {**body, **padding})
    assert large.status_code == 400, large.text
    assert large.json() == small.json()
    assert scans and not any(scans), scans
    assert _statuses(tenancy) == rows * 2


def test_unparsable_large_bodies_get_fastapis_answers(served, scans):
    url, key, _ = served
    cut = json.dumps({"model": "tiny", "input": "hello", "padding": PAD}).encode()[:-10]
    r = _post(url, key, "/v1/responses", cut)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    # what only json.loads takes is served as FastAPI serves it: a UTF-8 BOM
    bom = b"\xef\xbb\xbf" + json.dumps({"model": "tiny", "input": "hello", "max_output_tokens": 4,
                                        "padding": PAD}).encode()
    r = _post(url, key, "/v1/responses", bom)
    assert r.status_code == 200 and r.json()["object"] == "response", r.text
    assert not any(scans)


@pytest.mark.parametrize("prompt", [
    [1] * (2 * 1024 * 1024 - 100),  # ~4 MiB of ids, one prompt: the audit's body
    [[7] * 30_000] * 64,  # batched: 1.9 M ids
])
def test_a_body_of_too_many_token_ids_is_refused_before_it_is_decoded(served, scans, prompt):
    url, key, tenancy = served
    body = json.dumps({"model": "tiny", "max_tokens": 1, "prompt": prompt}, separators=(",", ":")).encode()
    r = _post(url, key, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"Invalid request: the request holds more than {MAX_TOKEN_IDS} token ids.",
                                 "type": "invalid_request_error", "param": "prompt", "code": "invalid_value"}
    assert scans == []  # never parsed: the bound came from the bytes
    assert _statuses(tenancy) == ["error"]  # counted like any refused body


# The byte-level count against the scan's, at the bound: each decoy holds ``ids`` token ids as the
# scan counts them, wrapped in what a byte count could miscount (text that looks like ids, floats,
# empty lists, escapes, whitespace). With MAX_TOKEN_IDS - ids more in the prompt the body is at the
# bound (accepted), with one more it is over (refused), by the scan and by ``excess_token_ids`` alike.
DECOYS = [
    pytest.param({}, 0, id="nothing"),
    pytest.param({"metadata": {"text": "[1,2,3]," * 40_000}}, 0, id="ids-in-text"),
    pytest.param({"stop": ["\\\"[1, 2]\"", "]]]", "[9]"]}, 0, id="escaped-quotes-and-brackets"),
    pytest.param({"x": [1.5, 2, 3], "y": [1e3], "z": [[], [ ], [True, 1], [-1, 0]]}, 2, id="floats-empties-negatives"),
    pytest.param({"enum": [1, 2, 3], "nested": [[4, 5], [6]]}, 6, id="int-lists-elsewhere"),
    pytest.param({"pad": [0] * 50_000}, 50_000, id="many-in-another-field"),
]


def test_the_refusal_names_the_field_holding_the_most_ids():
    body = json.dumps({"model": "tiny", "prompt": [1] * 1000, "pad": [[2] * 1000] * (MAX_TOKEN_IDS // 1000)}).encode()
    refusal = excess_token_ids(body)
    assert refusal is not None and refusal.context["param"] == "pad"


def _body(decoy: dict, prompt_ids: int, spaced: bool) -> bytes:
    separators = (", ", ": ") if spaced else (",", ":")
    return json.dumps({"model": "tiny", "prompt": [[3] * 1000] * (prompt_ids // 1000) + [[3] * (prompt_ids % 1000)],
                       **decoy}, separators=separators).encode()


def _scan_refuses(body: bytes) -> bool:
    try:
        scan(json.loads(body))
    except Exception as exc:  # noqa: BLE001 - pydantic_core's PydanticCustomError
        assert "token ids" in str(exc), exc
        return True
    return False


@pytest.mark.parametrize("spaced", [False, True])
@pytest.mark.parametrize("decoy, ids", DECOYS)
def test_the_byte_count_refuses_exactly_what_the_scan_refuses(decoy, ids, spaced):
    at_bound = _body(decoy, MAX_TOKEN_IDS - ids, spaced)
    over = _body(decoy, MAX_TOKEN_IDS - ids + 1, spaced)
    assert not _scan_refuses(at_bound) and excess_token_ids(at_bound) is None
    assert _scan_refuses(over)
    refusal = excess_token_ids(over)
    assert refusal is not None and refusal.context == {
        "message": f"the request holds more than {MAX_TOKEN_IDS} token ids",
        "param": "prompt"}  # the field holding the most ids


def test_a_large_body_without_ids_is_not_refused():
    text = json.dumps({"model": "tiny", "prompt": ",".join(["1"] * 400_000)}).encode()  # commas and digits in text
    assert len(text) > 2 * MAX_TOKEN_IDS and excess_token_ids(text) is None
    top_level_list = json.dumps([1] * (MAX_TOKEN_IDS + 1)).encode()  # not an object: the schema's own 400
    assert excess_token_ids(top_level_list) is None
