"""Stored chat completions on both stores (SQLite and PostgreSQL): keyed on (id, tenant), sealed with
the tenant's data key (the completion and its messages apart), listed in a total order with the
model and metadata filters, metadata updated alone, gone with the tenant."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tenancy import chat_completions
from tenancy.service import AuthenticationError, TenancyService
from tenancy.types import ChatCompletionQuery, StoredChatCompletion
from tests.fleetutil import read_rows


def _stored(cid: str, *, model: str = "tiny", metadata: dict[str, str] | None = None,
            text: str = "an answer") -> StoredChatCompletion:
    completion = {"id": cid, "object": "chat.completion", "created": 1, "model": model,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                  "metadata": metadata or {}}
    messages = [{"id": f"{cid}-0", "role": "user", "content": f"question of {cid}", "content_parts": None}]
    return StoredChatCompletion(cid, model, completion, messages)


def _ids(svc: TenancyService, ctx: object, **query: object) -> tuple[list[str], bool]:
    page = svc.list_chat_completions(ctx, ChatCompletionQuery(**query))
    assert page is not None
    return [c["id"] for c in page.completions], page.has_more


def test_a_completion_is_its_tenants_only_sealed_and_deleted_with_it(svc: TenancyService) -> None:
    a = svc.authenticate(svc.create_tenant("a").api_key)
    b = svc.authenticate(svc.create_tenant("b").api_key)
    kept = _stored("chatcmpl-1", text="the secret answer")
    svc.save_chat_completion(a, kept)
    assert svc.load_chat_completion(a, "chatcmpl-1") == kept.completion
    assert svc.chat_completion_messages(a, "chatcmpl-1") == kept.messages
    # another tenant that learns the id finds nothing, changes nothing, lists nothing
    assert svc.load_chat_completion(b, "chatcmpl-1") is None
    assert svc.chat_completion_messages(b, "chatcmpl-1") is None
    assert svc.update_chat_completion_metadata(b, "chatcmpl-1", {"k": "v"}) is None
    assert svc.delete_chat_completion(b, "chatcmpl-1") is False
    assert _ids(svc, b) == ([], False)
    assert svc.list_chat_completions(b, ChatCompletionQuery(after="chatcmpl-1")) is None
    svc.save_chat_completion(b, _stored("chatcmpl-1", text="b's"))  # a colliding id never overwrites a's row
    assert svc.load_chat_completion(a, "chatcmpl-1") == kept.completion
    [row] = read_rows(svc, "SELECT tenant_id, model, head, messages FROM chat_completions")
    assert row["tenant_id"] == a.tenant_id and row["model"] == "tiny"
    assert b"secret" not in bytes(row["head"]) and b"question" not in bytes(row["messages"])
    assert svc.delete_chat_completion(a, "chatcmpl-1") is True and svc.load_chat_completion(a, "chatcmpl-1") is None
    svc.save_chat_completion(a, _stored("chatcmpl-2"))
    svc.delete_tenant("a")
    assert read_rows(svc, "SELECT id FROM chat_completions") == []


def test_a_part_cannot_be_opened_as_the_other_or_for_another_id(svc: TenancyService) -> None:
    """Each sealed part is bound to (part, tenant, id): a head copied into the messages column, or
    a row's head moved to another id, fails its tag and is never served."""
    ctx = svc.authenticate(svc.create_tenant("a").api_key)
    cipher = svc._response_cipher(ctx)
    head = chat_completions.seal(cipher, "head", ctx.tenant_id, "chatcmpl-1", {"id": "chatcmpl-1"})
    assert chat_completions.open_part(cipher, "head", ctx.tenant_id, "chatcmpl-1", head) == {"id": "chatcmpl-1"}
    assert chat_completions.open_part(cipher, "messages", ctx.tenant_id, "chatcmpl-1", head) is None
    assert chat_completions.open_part(cipher, "head", ctx.tenant_id, "chatcmpl-2", head) is None
    assert chat_completions.open_part(cipher, "head", "t_other", "chatcmpl-1", head) is None


def test_pages_walk_every_completion_once_in_either_order(svc: TenancyService) -> None:
    ctx = svc.authenticate(svc.create_tenant("a").api_key)
    made = [f"chatcmpl-{k}" for k in range(7)]
    for cid in made:
        svc.save_chat_completion(ctx, _stored(cid))
    for order, expected in (("asc", made), ("desc", made[::-1])):
        seen: list[str] = []
        after = None
        while True:
            ids, more = _ids(svc, ctx, after=after, limit=3, order=order)
            seen += ids
            if not more:
                break
            after = ids[-1]
        assert seen == expected
    assert _ids(svc, ctx) == (made, False)  # 20 a page, oldest first by default
    assert _ids(svc, ctx, limit=7) == (made, False) and _ids(svc, ctx, limit=6) == (made[:6], True)


def test_filters_by_model_and_every_metadata_pair(svc: TenancyService) -> None:
    ctx = svc.authenticate(svc.create_tenant("a").api_key)
    rows = [("c0", "tiny", {"team": "red"}), ("c1", "big", {"team": "red"}), ("c2", "tiny", {"team": "blue"}),
            ("c3", "tiny", {"team": "red", "env": "prod"}), ("c4", "tiny", {}), ("c5", "tiny", {"team": "red"})]
    for cid, model, metadata in rows:
        svc.save_chat_completion(ctx, _stored(cid, model=model, metadata=metadata))
    assert _ids(svc, ctx, model="big") == (["c1"], False)
    assert _ids(svc, ctx, metadata={"team": "red"}) == (["c0", "c1", "c3", "c5"], False)
    assert _ids(svc, ctx, metadata={"team": "red", "env": "prod"}) == (["c3"], False)
    assert _ids(svc, ctx, model="tiny", metadata={"team": "red"}) == (["c0", "c3", "c5"], False)
    # a filtered page fills across batches, and knows whether another match follows
    assert _ids(svc, ctx, metadata={"team": "red"}, limit=2) == (["c0", "c1"], True)
    assert _ids(svc, ctx, metadata={"team": "red"}, limit=2, after="c1") == (["c3", "c5"], False)
    assert _ids(svc, ctx, metadata={"team": "red"}, limit=1, order="desc", after="c3") == (["c1"], True)
    assert _ids(svc, ctx, metadata={"team": "green"}) == ([], False)


def test_updating_metadata_changes_only_the_metadata(svc: TenancyService) -> None:
    ctx = svc.authenticate(svc.create_tenant("a").api_key)
    kept = _stored("chatcmpl-1", metadata={"a": "1"})
    svc.save_chat_completion(ctx, kept)
    updated = svc.update_chat_completion_metadata(ctx, "chatcmpl-1", {"b": "2"})
    assert updated == {**kept.completion, "metadata": {"b": "2"}}
    assert svc.load_chat_completion(ctx, "chatcmpl-1") == updated
    assert svc.chat_completion_messages(ctx, "chatcmpl-1") == kept.messages
    assert _ids(svc, ctx, metadata={"b": "2"}) == (["chatcmpl-1"], False)
    assert _ids(svc, ctx, metadata={"a": "1"}) == ([], False)
    assert svc.update_chat_completion_metadata(ctx, "chatcmpl-nope", {}) is None


def test_a_tenant_deleted_by_another_process_is_an_unknown_key(
        home: Path, open_service: Callable[..., TenancyService]) -> None:
    """The gateway still holds the key in its auth cache when the CLI deletes the tenant: every call
    is an AuthenticationError (a 401), and no data key is made again for the deleted tenant."""
    gateway, cli = open_service(home, auth_cache_ttl_s=60), open_service(home)
    try:
        ctx = gateway.authenticate(cli.create_tenant("gone").api_key)
        gateway.save_chat_completion(ctx, _stored("chatcmpl-1"))
        cli.delete_tenant("gone")
        calls: list[Callable[[], object]] = [
            lambda: gateway.save_chat_completion(ctx, _stored("chatcmpl-2")),
            lambda: gateway.load_chat_completion(ctx, "chatcmpl-1"),
            lambda: gateway.chat_completion_messages(ctx, "chatcmpl-1"),
            lambda: gateway.list_chat_completions(ctx, ChatCompletionQuery()),
            lambda: gateway.update_chat_completion_metadata(ctx, "chatcmpl-1", {}),
            lambda: gateway.delete_chat_completion(ctx, "chatcmpl-1"),
        ]
        for call in calls:
            with pytest.raises(AuthenticationError, match="tenant has been deleted"):
                call()
        assert read_rows(gateway, "SELECT id FROM chat_completions") == []
        assert read_rows(gateway, "SELECT owner FROM data_keys WHERE owner = ?", [f"tenant:{ctx.tenant_id}"]) == []
    finally:
        gateway.close()
        cli.close()


def _age(svc: TenancyService, table: str, row_id: str, seconds: float) -> None:
    """Make a stored row look ``seconds`` older (its created_at moved back)."""
    db = svc.database.connect()
    try:
        with db.transaction():
            db.execute(f"UPDATE {table} SET created_at = created_at - ? WHERE id = ?", [seconds, row_id])
    finally:
        db.close()


def test_stored_items_expire_after_the_retention(home: Path, open_service: Callable[..., TenancyService]) -> None:
    """Past ``stored_ttl_s`` a stored completion or response is never served (retrieve, messages, list,
    update, delete, previous_response_id's load) and is deleted: the tenant's own at its next store
    write (here the delete), every tenant's when a service opens."""
    svc = open_service(home, stored_ttl_s=3600.0)
    try:
        a = svc.authenticate(svc.create_tenant("a").api_key)
        b = svc.authenticate(svc.create_tenant("b").api_key)
        for cid in ("chatcmpl-old", "chatcmpl-new"):
            svc.save_chat_completion(a, _stored(cid))
        svc.save_response(a, "resp_old", {"id": "resp_old"})
        svc.save_chat_completion(b, _stored("chatcmpl-b-old"))
        _age(svc, "chat_completions", "chatcmpl-old", 7200)
        _age(svc, "chat_completions", "chatcmpl-b-old", 7200)
        _age(svc, "responses", "resp_old", 7200)
        assert svc.load_response(a, "resp_old") is None  # filtered by the read: no write has purged it yet
        assert {r["id"] for r in read_rows(svc, "SELECT id FROM responses")} == {"resp_old"}
        assert svc.load_chat_completion(a, "chatcmpl-old") is None
        assert svc.chat_completion_messages(a, "chatcmpl-old") is None
        assert svc.update_chat_completion_metadata(a, "chatcmpl-old", {"k": "v"}) is None
        assert svc.delete_chat_completion(a, "chatcmpl-old") is False
        assert _ids(svc, a) == (["chatcmpl-new"], False)
        assert svc.load_response(a, "resp_old") is None
        assert svc.load_chat_completion(a, "chatcmpl-new") is not None  # within the retention: kept
        kept = {r["id"] for r in read_rows(svc, "SELECT id FROM chat_completions")}
        assert kept == {"chatcmpl-new", "chatcmpl-b-old"}  # b's waits for b's next call, or a restart
        assert read_rows(svc, "SELECT id FROM responses") == []
    finally:
        svc.close()
    again = open_service(home, stored_ttl_s=3600.0)  # opening purges every tenant's
    try:
        assert {r["id"] for r in read_rows(again, "SELECT id FROM chat_completions")} == {"chatcmpl-new"}
    finally:
        again.close()


def test_without_a_retention_stored_items_stay(home: Path, open_service: Callable[..., TenancyService]) -> None:
    svc = open_service(home, stored_ttl_s=None)
    try:
        a = svc.authenticate(svc.create_tenant("a").api_key)
        svc.save_chat_completion(a, _stored("chatcmpl-1"))
        _age(svc, "chat_completions", "chatcmpl-1", 400 * 86_400)
        assert svc.load_chat_completion(a, "chatcmpl-1") is not None
    finally:
        svc.close()
    with pytest.raises(ValueError, match="stored_ttl_s"):
        open_service(home, stored_ttl_s=0.0)
