"""vLLM's ``/tokenize`` and ``/detokenize`` against a real ``prefixgate serve --model tiny`` over raw HTTP: the
ids are the engine's own (the text prompt as the model's tokenizer encodes it; the messages as a chat
completion of them counts its prompt), they decode back, and what the engine would not do is refused
naming the field."""

from __future__ import annotations

import httpx
import pytest
from wire_server import error_of, max_model_len, poster, tiny_server

transformers = pytest.importorskip("transformers")

from engine.launch import default_tiny_dir  # noqa: E402

MESSAGES = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("pg-tokenize")


@pytest.fixture(scope="module")
def server(home):
    yield from tiny_server(home)


@pytest.fixture(scope="module")
def post(server):
    return poster(*server)


@pytest.fixture(scope="module")
def tok(home, server):
    return transformers.AutoTokenizer.from_pretrained(default_tiny_dir(home))


def test_a_text_prompt_is_the_tokenizers_ids_and_decodes_back(server, post, tok):
    text = "The quick brown fox jumps over the lazy dog, twice."
    r = post("/tokenize", {"prompt": text})  # no model: the local engine's, as vLLM's one model
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == max_model_len(*server) and body["token_strs"] is None
    back = post("/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": tok.decode(body["tokens"])}


def test_messages_are_the_ids_a_chat_completion_runs(post):
    r = post("/tokenize", {"model": "tiny", "messages": MESSAGES})
    assert r.status_code == 200, r.text
    ran = post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
    assert ran.status_code == 200, ran.text
    assert r.json()["count"] == ran.json()["usage"]["prompt_tokens"] == len(r.json()["tokens"])
    # the engine's defaults, sent explicitly, are the same request
    same = post("/tokenize", {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": True,
                              "continue_final_message": False, "add_special_tokens": False})
    assert same.json()["tokens"] == r.json()["tokens"]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "add_special_tokens": False}, "add_special_tokens"),
    ({"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    ({"messages": MESSAGES, "add_generation_prompt": False}, "add_generation_prompt"),
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ({"prompt": "hi", "return_token_strs": True}, "return_token_strs"),
    ({"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_what_the_engine_would_not_do_is_refused_naming_the_field(post, body, param):
    assert error_of(post("/tokenize", {"model": "tiny", **body}), param)


def test_bad_requests_get_openai_errors(server, post):
    assert "exactly one" in error_of(post("/tokenize", {"model": "tiny", "prompt": "hi", "messages": MESSAGES}),
                                     "messages")["message"]
    assert error_of(post("/tokenize", {"model": "tiny"}), "prompt")["code"] == "missing_required_parameter"
    assert post("/tokenize", {"model": "no-such-model", "prompt": "hi"}).status_code == 404
    # what a chat completion refuses in its messages is the same 400 here, not a server error
    assert error_of(post("/tokenize", {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}),
                    "messages[0].role")
    assert error_of(post("/tokenize", {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}),
                    "messages[0].tool_call_id")
    assert error_of(post("/detokenize", {"model": "tiny", "tokens": [1, 10**9]}), "prompt")  # past the vocabulary
    limit = max_model_len(*server)
    long = error_of(post("/tokenize", {"model": "tiny", "prompt": "word " * (2 * limit)}), "prompt")
    assert long["code"] == "context_length_exceeded"
    url, _ = server
    anonymous = httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, timeout=60, trust_env=False)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"


def test_a_provider_route_has_no_tokenizer_here():
    """A model served through a provider: the upstream tokenizes, so both routes refuse naming ``model``
    (before any upstream call: the route's key is never read)."""
    from fastapi.testclient import TestClient
    from gateway_fakes import FakeEngine, FakeTenancy

    from gateway.app import create_app
    from gateway.settings import GatewaySettings, RouteConfig

    tenancy = FakeTenancy()
    key = tenancy.add("acme")
    route = RouteConfig(model="up", provider="openai/tiny", api_base="http://127.0.0.1:9/v1",
                        api_key_env="PG_TEST_NO_SUCH_KEY", max_model_len=256)
    app = create_app(GatewaySettings(routes=(route,)), engine=FakeEngine(), tenancy=tenancy)
    with TestClient(app) as client:
        headers = {"Authorization": f"Bearer {key}"}
        for path, body in (("/tokenize", {"model": "up", "prompt": "hi"}), ("/detokenize", {"model": "up", "tokens": [1]})):
            r = client.post(path, json=body, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
