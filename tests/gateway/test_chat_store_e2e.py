"""Stored chat completions (``store: true``) through the real openai SDK against a real ``prefixgate
serve --model tiny`` on loopback: create (whole and streamed), retrieve, list with paging, order and
the model and metadata filters, update metadata, messages.list, delete; another tenant sees none of
it; the rows are sealed; a request without ``store`` keeps nothing. Once on the embedded SQLite store
and once on a real PostgreSQL server (skipped with the reason when it is not installed)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tenancy.service import TenancyService
from tests.fleetutil import postgres_server, read_rows  # noqa: F401 - postgres_server is a fixture
from tests.serverutil import serve_tiny, stop

MARKER = "zanzibar"  # a word of the prompts, to look for in the stored bytes


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database_url(request):
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("postgres_server").new_database()


@pytest.fixture(scope="module")
def home(tmp_path_factory, database_url):
    return tmp_path_factory.mktemp("pg-chat-store")


@pytest.fixture(scope="module")
def tenants(home, database_url):
    with TenancyService.open(home, database_url=database_url) as svc:
        keys = {name: svc.create_tenant(name).api_key for name in ("acme", "beta")}
        svc.flush()
    return keys


@pytest.fixture(scope="module")
def server(home, tenants, database_url):
    flags = ["--database-url", database_url] if database_url else []
    url, proc = serve_tiny(home, "--kv-blocks", "256", *flags, timeout=300)
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def rows(home, database_url):
    """``rows(sql, params)``: rows of the server's tenancy database, read on a connection of their own."""
    svc = TenancyService.open(home, database_url=database_url)
    yield lambda sql, params=(): read_rows(svc, sql, params)
    svc.close()


def oai(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _ask(client: openai.OpenAI, text: str, max_tokens: int = 3, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                          max_tokens=max_tokens, temperature=0, **kw)


def _all_ids(client: openai.OpenAI, **kw) -> list[str]:
    return [c.id for c in client.chat.completions.list(**kw)]  # the SDK follows has_more / after


def test_store_retrieve_list_update_messages_and_delete(server, tenants):
    client = oai(server, tenants["acme"])
    before = _all_ids(client)
    made = [_ask(client, f"Question {k} about {MARKER}?", store=True, metadata={"run": "crud", "k": str(k)})
            for k in range(3)]
    unstored = _ask(client, "Not kept.")
    got = client.chat.completions.retrieve(made[0].id)
    assert got.model_dump(exclude={"metadata"}) == made[0].model_dump(exclude={"metadata"})
    assert got.metadata == {"run": "crud", "k": "0"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(unstored.id)

    ids = [m.id for m in made]
    assert _all_ids(client) == before + ids  # oldest first by default
    assert _all_ids(client, limit=2) == before + ids  # pages of two, walked by the SDK
    page = client.chat.completions.list(limit=2, order="desc")
    assert [c.id for c in page.data] == ids[::-1][:2] and page.has_more
    assert _all_ids(client, metadata={"run": "crud"}) == ids
    assert _all_ids(client, metadata={"run": "crud", "k": "1"}) == [ids[1]]
    assert _all_ids(client, model="tiny", metadata={"run": "crud"}, order="desc") == ids[::-1]
    assert _all_ids(client, model="another-model") == []

    updated = client.chat.completions.update(ids[1], metadata={"run": "crud", "k": "one"})
    assert updated.id == ids[1] and updated.metadata == {"run": "crud", "k": "one"}
    assert client.chat.completions.retrieve(ids[1]).metadata == {"run": "crud", "k": "one"}
    assert _all_ids(client, metadata={"k": "1"}) == []
    assert client.chat.completions.retrieve(ids[1]).choices == made[1].choices  # nothing else changed

    deleted = client.chat.completions.delete(ids[2])
    assert (deleted.id, deleted.deleted, deleted.object) == (ids[2], True, "chat.completion.deleted")
    for call in (client.chat.completions.retrieve, client.chat.completions.delete,
                 client.chat.completions.messages.list):
        with pytest.raises(openai.NotFoundError) as err:
            call(ids[2])
        assert err.value.body["code"] == "chat_completion_not_found"
    assert _all_ids(client, metadata={"run": "crud"}) == ids[:2]


def test_messages_list_the_input_as_sent_with_ids(server, tenants):
    client = oai(server, tenants["acme"])
    parts = [{"type": "text", "text": "Part one. "}, {"type": "text", "text": f"Part two, {MARKER}."}]
    sent = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": parts, "name": "ola"}]
    made = client.chat.completions.create(model="tiny", messages=sent, max_tokens=2, store=True)
    messages = list(client.chat.completions.messages.list(made.id))
    assert [m.id for m in messages] == [f"{made.id}-{i}" for i in range(4)]
    assert [m.role for m in messages] == ["system", "user", "assistant", "user"]
    assert [m.content for m in messages] == ["Answer briefly.", "Hello", "Hi.", f"Part one. Part two, {MARKER}."]
    assert messages[0].content_parts is None
    assert [p.model_dump(exclude_none=True) for p in messages[3].content_parts] == parts and messages[3].name == "ola"
    page = client.chat.completions.messages.list(made.id, limit=2, order="desc")
    assert [m.id for m in page.data] == [f"{made.id}-3", f"{made.id}-2"] and page.has_more
    after = client.chat.completions.messages.list(made.id, after=f"{made.id}-1")
    assert [m.id for m in after.data] == [f"{made.id}-2", f"{made.id}-3"] and not after.has_more


def test_a_stream_is_stored_as_the_completion_it_sent(server, tenants):
    client = oai(server, tenants["acme"])
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"Stream about {MARKER}"}], max_tokens=4,
        temperature=0, stream=True, store=True, metadata={"run": "stream"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    got = client.chat.completions.retrieve(chunks[0].id)
    assert got.object == "chat.completion" and got.created == chunks[0].created and got.model == "tiny"
    assert got.choices[0].message.content == text and got.choices[0].finish_reason == finish[0]
    assert got.usage.completion_tokens >= 1 and got.metadata == {"run": "stream"}
    whole = _ask(client, f"Stream about {MARKER}", max_tokens=4)  # greedy: the same answer, not streamed
    assert whole.choices[0].message.content == text
    assert [m.content for m in client.chat.completions.messages.list(got.id)] == [f"Stream about {MARKER}"]


def test_another_tenant_finds_nothing(server, tenants):
    mine = _ask(oai(server, tenants["acme"]), "Mine", store=True, metadata={"run": "isolation"})
    other = oai(server, tenants["beta"])
    for call in (other.chat.completions.retrieve, other.chat.completions.delete,
                 other.chat.completions.messages.list):
        with pytest.raises(openai.NotFoundError):
            call(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.update(mine.id, metadata={"run": "stolen"})
    assert _all_ids(other) == [] and _all_ids(other, metadata={"run": "isolation"}) == []
    with pytest.raises(openai.BadRequestError) as err:  # as unknown to beta as any id
        other.chat.completions.list(after=mine.id)
    assert err.value.body["param"] == "after"
    assert oai(server, tenants["acme"]).chat.completions.retrieve(mine.id).metadata == {"run": "isolation"}


def test_stored_rows_are_sealed_and_unstored_requests_leave_nothing(server, tenants, rows):
    client = oai(server, tenants["acme"])
    count = rows("SELECT COUNT(*) AS n FROM chat_completions")[0]["n"]
    _ask(client, f"Plain {MARKER}")
    _ask(client, f"Plain {MARKER}", store=False, metadata={"run": "unstored"})
    list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "s"}], max_tokens=2,
                                        stream=True))
    assert rows("SELECT COUNT(*) AS n FROM chat_completions")[0]["n"] == count
    made = _ask(client, f"Sealed {MARKER}", store=True, metadata={"secret": MARKER})
    [row] = rows("SELECT head, messages FROM chat_completions WHERE id = ?", [made.id])
    assert MARKER.encode() not in bytes(row["head"]) and MARKER.encode() not in bytes(row["messages"])
    assert client.chat.completions.retrieve(made.id).metadata == {"secret": MARKER}


@pytest.mark.parametrize(("path", "param"), [
    ("/v1/chat/completions?limit=0", "limit"), ("/v1/chat/completions?limit=101", "limit"),
    ("/v1/chat/completions?order=sideways", "order"), ("/v1/chat/completions?after=chatcmpl-nope", "after"),
    ("/v1/chat/completions?metadata=x", "metadata"),
])
def test_bad_list_parameters_are_400s_naming_them(server, tenants, path, param):
    r = httpx.get(f"{server}{path}", headers={"Authorization": f"Bearer {tenants['acme']}"}, trust_env=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_bad_metadata_and_message_paging_are_400s(server, tenants):
    client = oai(server, tenants["acme"])
    made = _ask(client, "Bounds", store=True)
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(openai.BadRequestError) as err:
            _ask(client, "Too much", store=True, metadata=metadata)
        assert err.value.body["param"] == "metadata"
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.update(made.id, metadata=metadata)
        assert err.value.body["param"] == "metadata"
        with pytest.raises(openai.BadRequestError) as err:  # the Responses API shares the bounds
            client.responses.create(model="tiny", input="Too much", max_output_tokens=1, metadata=metadata)
        assert err.value.body["param"] == "metadata"
    _ask(client, "At the bounds", store=True, metadata={f"{i:064d}": "v" * 512 for i in range(16)})
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.update(made.id, metadata={}, extra_body={"model": "other"})
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.messages.list(made.id, after="nope")
    assert err.value.body["param"] == "after"
    assert client.chat.completions.update(made.id, metadata=None).metadata == {}
