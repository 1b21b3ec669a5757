"""``POST /v1/responses`` for a tenant deleted (by the CLI, another process) while the gateway still
holds its key in the auth cache: a 401 like any unknown key, never a 500 from the stored response's
foreign key, and the request's ledger row says error."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from gateway_fakes import FakeEngine, LoopbackServer

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tenancy.service import TenancyService
from tests.fleetutil import read_rows


@pytest.fixture
def deleted(tmp_path):
    """(gateway url, the deleted tenant's key, the gateway's tenancy): the key is still cached."""
    gateway = TenancyService.open(tmp_path, auth_cache_ttl_s=60)
    cli = TenancyService.open(tmp_path)
    key = cli.create_tenant("gone").api_key
    try:
        with LoopbackServer(create_app(GatewaySettings(), engine=FakeEngine(), tenancy=gateway)) as srv:
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=30)
            client.responses.create(model="tiny", input="hello")  # authenticated once: cached
            cli.delete_tenant("gone")
            yield srv.url, key, gateway
    finally:
        cli.close()
        gateway.close()


def test_a_whole_response_is_a_401(deleted):
    url, key, gateway = deleted
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as err:
        client.responses.create(model="tiny", input="hello again")
    assert err.value.code == "invalid_api_key"
    gateway.flush()
    assert [r["status"] for r in read_rows(gateway, "SELECT status FROM usage ORDER BY created_at")] == ["ok", "error"]


def test_a_stream_ends_with_an_unknown_key_error(deleted):
    url, key, _ = deleted
    with httpx.stream("POST", f"{url}/v1/responses", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": "tiny", "input": "hello again", "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    errors = [e for e in events if e["type"] == "error"]
    assert errors and errors[0]["code"] == "invalid_api_key"
    assert events[-1]["type"] == "response.failed"


def test_reading_deleting_or_continuing_a_stored_response_is_a_401(deleted):
    """Audit finding 2 over HTTP: GET, DELETE and ``previous_response_id`` of the deleted tenant
    are 401s like any unknown key (not 404s), and none makes a data key for it again."""
    url, key, gateway = deleted
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
    calls = (lambda: client.responses.retrieve("resp_1"), lambda: client.responses.delete("resp_1"),
             lambda: client.responses.create(model="tiny", input="more", previous_response_id="resp_1"))
    for call in calls:
        with pytest.raises(openai.AuthenticationError) as err:
            call()
        assert err.value.code == "invalid_api_key"
    assert [r["owner"] for r in read_rows(gateway, "SELECT owner FROM data_keys") if r["owner"].startswith("tenant:")] == []


def test_storing_or_reading_a_chat_completion_is_a_401(deleted):
    """The same for stored chat completions: a whole or streamed ``store: true`` chat request, and
    every read of the store, is a 401 like an unknown key, and no data key is made again."""
    url, key, gateway = deleted
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
    hello = [{"role": "user", "content": "hello"}]
    calls = (lambda: client.chat.completions.create(model="tiny", messages=hello, store=True),
             lambda: client.chat.completions.retrieve("chatcmpl-1"),
             lambda: client.chat.completions.list(),
             lambda: client.chat.completions.update("chatcmpl-1", metadata={"k": "v"}),
             lambda: client.chat.completions.delete("chatcmpl-1"),
             lambda: client.chat.completions.messages.list("chatcmpl-1"))
    for call in calls:
        with pytest.raises(openai.AuthenticationError) as err:
            call()
        assert err.value.code == "invalid_api_key"
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": "tiny", "messages": hello, "stream": True, "store": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "invalid_api_key" and events[-1] == "[DONE]"
    assert [r["owner"] for r in read_rows(gateway, "SELECT owner FROM data_keys") if r["owner"].startswith("tenant:")] == []
