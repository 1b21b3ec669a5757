"""Explicit cache control in the local engine, through a real `prefixgate serve` with a small KV cache:
a 1h breakpoint (Anthropic SDK) and prompt_cache_retention="24h" (openai SDK) keep their prefix
through a flood that evicts an unmarked one; a tenant warms a prefix and sees what it holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from tenancy.service import TenancyService
from tests.serverutil import REPO, serve_tiny, stop

KV_BLOCKS = 48  # x 16 tokens: a few prompts fill it; each tenant may retain a quarter (12 blocks)
MARKED = "Return policy of ExampleCo: thirty days, receipt required, refunds to the card used. " * 2
UNMARKED = "Shipping policy of ExampleCo: two to five days, free above fifty euros, tracked. " * 2
KEPT = "Opening hours of ExampleCo: nine to six on weekdays, ten to four on Saturdays. " * 2
RETAINED = "Warranty terms of ExampleCo: two years on parts, one year on labour, proof needed. " * 2


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("pg-retention")


@pytest.fixture(scope="module")
def keys(home):
    with TenancyService.open(home) as svc:
        made = {name: svc.create_tenant(name).api_key
                for name in ("acme", "oai", "flood", "warm", "writer", "plain", "chat24", "in-memory", "legacy")}
        made["keeper"] = svc.create_tenant("keeper", cache_retention_s=3600).api_key  # the tenant setting
        svc.flush()
    return made


@pytest.fixture(scope="module")
def server(home, keys):
    url, proc = serve_tiny(home, "--kv-blocks", str(KV_BLOCKS), timeout=300)
    try:
        yield url
    finally:
        stop(proc)


def _flood(url: str, key: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    for k in range(8):  # ~20 blocks each: the whole cache several times over
        text = " ".join(f"item{k}x{j}" for j in range(120))
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=1)


def test_retained_prefixes_survive_a_flood_that_evicts_an_unmarked_one(server, keys):
    claude = anthropic.Anthropic(base_url=server, api_key=keys["acme"], max_retries=0, timeout=120)
    oai = openai.OpenAI(base_url=f"{server}/v1", api_key=keys["oai"], max_retries=0, timeout=120)
    question = [{"role": "user", "content": "Can I return shoes?"}]
    marked = [{"type": "text", "text": MARKED, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]

    def ask_marked():
        return claude.messages.create(model="tiny", max_tokens=1, system=marked, messages=question).usage

    def ask_unmarked():
        return claude.messages.create(model="tiny", max_tokens=1, system=UNMARKED, messages=question).usage

    keeper = openai.OpenAI(base_url=f"{server}/v1", api_key=keys["keeper"], max_retries=0, timeout=120)

    def ask_kept():  # plain chat completions: the tenant's cache_retention_s setting keeps the prefix
        return keeper.chat.completions.create(model="tiny", max_tokens=1, messages=[
            {"role": "system", "content": KEPT}, {"role": "user", "content": "Open on Saturday?"}]).usage

    def ask_retained():
        return oai.responses.create(model="tiny", instructions=RETAINED, input="Is the battery covered?",
                                    max_output_tokens=1, prompt_cache_retention="24h").usage

    first = ask_marked()
    assert first.cache_creation_input_tokens > 0 and first.cache_creation.ephemeral_1h_input_tokens > 0
    ask_unmarked()
    ask_retained()
    ask_kept()
    # before the flood all three are cached
    assert ask_unmarked().cache_read_input_tokens > 0
    _flood(server, keys["flood"])
    after = ask_marked()
    assert after.cache_read_input_tokens >= first.cache_creation_input_tokens
    assert ask_unmarked().cache_read_input_tokens == 0
    assert ask_retained().input_tokens_details.cached_tokens > 0
    assert ask_kept().prompt_tokens_details.cached_tokens > 0


def _written(url: str, key: str) -> int:
    """The tenant's ledger total of cache-creation tokens (/v1/usage flushes the ledger first)."""
    r = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}, trust_env=False, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["totals"]["cache_creation_tokens"]


def test_retained_prompts_count_their_cache_writes_in_the_ledger(server, keys):
    """prompt_cache_retention (Responses) writes the prompt's full blocks: cache-creation tokens in
    the ledger on the first call, at most the one block the engine recomputes on the second; a
    request with no retention writes nothing anyone asked for."""
    oai = openai.OpenAI(base_url=f"{server}/v1", api_key=keys["writer"], max_retries=0, timeout=120)
    instructions = "Delivery terms of ExampleCo: parcels by courier, signature on arrival, no PO boxes. " * 2

    def ask():
        return oai.responses.create(model="tiny", instructions=instructions, input="Do you deliver to PO boxes?",
                                    max_output_tokens=1, prompt_cache_retention="24h").usage

    first = ask()
    w1 = _written(server, keys["writer"])
    assert first.input_tokens_details.cached_tokens == 0
    assert w1 > 0 and w1 % 16 == 0 and w1 <= first.input_tokens  # full blocks of the tiny engine (16 tokens)
    second = ask()
    w2 = _written(server, keys["writer"])
    assert second.input_tokens_details.cached_tokens >= w1 - 16
    assert 0 <= w2 - w1 <= 16
    plain = openai.OpenAI(base_url=f"{server}/v1", api_key=keys["plain"], max_retries=0, timeout=120)
    plain.chat.completions.create(model="tiny", max_tokens=1, messages=[
        {"role": "system", "content": instructions}, {"role": "user", "content": "PO boxes?"}])
    assert _written(server, keys["plain"]) == 0


def test_warm_then_show_then_hit(server, keys):
    headers = {"Authorization": f"Bearer {keys['warm']}"}
    messages = [{"role": "system", "content": "Catalogue of ExampleCo: chairs, tables, lamps and rugs. " * 3},
                {"role": "user", "content": "List the lamps."}]
    before = httpx.get(f"{server}/v1/cache", headers=headers, trust_env=False, timeout=60).json()
    assert before["object"] == "cache" and before["tenant"] == "warm"
    warmed = httpx.post(f"{server}/v1/cache/warm", headers=headers, trust_env=False, timeout=120,
                        json={"model": "tiny", "messages": messages, "ttl": "1h"}).json()
    assert warmed["object"] == "cache.warm" and warmed["written_tokens"] >= 16 and warmed["cached_tokens"] == 0
    shown = httpx.get(f"{server}/v1/cache", headers=headers, trust_env=False, timeout=60).json()
    assert shown["tokens"]["hbm"] >= before["tokens"]["hbm"] + warmed["written_tokens"]
    assert shown["retained_tokens"] >= warmed["written_tokens"]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=keys["warm"], max_retries=0, timeout=120)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens >= warmed["written_tokens"]
    other = httpx.get(f"{server}/v1/cache", headers={"Authorization": f"Bearer {keys['flood']}"},
                      trust_env=False, timeout=60).json()
    assert other["tenant"] == "flood" and other["retained_tokens"] == 0
    bad = httpx.post(f"{server}/v1/cache/warm", headers=headers, trust_env=False, timeout=60,
                     json={"model": "tiny", "messages": messages, "ttl": "forever"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttl"


def test_cli_cache_warm_and_show(server, keys, tmp_path):
    body = tmp_path / "prompt.json"
    body.write_text(json.dumps({"model": "tiny", "messages": [
        {"role": "system", "content": "Store hours of ExampleCo: nine to five, closed on Sundays. " * 3},
        {"role": "user", "content": "Open on Sunday?"}]}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFIXGATE_API_KEY": keys["warm"]}

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gateway.cli.main", "cache", *argv], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=300)

    warm = cli("warm", "--url", server, "--ttl", "5m", str(body))
    assert warm.returncode == 0, warm.stderr
    assert json.loads(warm.stdout)["written_tokens"] >= 16
    show = cli("show", "--url", server, "--json")
    assert show.returncode == 0 and json.loads(show.stdout)["retained_tokens"] >= 16
    missing = cli("warm", "--url", server, str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "cannot read" in missing.stderr
    wrong = subprocess.run([sys.executable, "-m", "gateway.cli.main", "cache", "show", "--url", server,
                            "--key", "pg-wrong"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and "HTTP 401" in wrong.stderr


def _retained(url: str, key: str) -> int:
    r = httpx.get(f"{url}/v1/cache", headers={"Authorization": f"Bearer {key}"}, trust_env=False, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["retained_tokens"]


def test_chat_completions_honour_prompt_cache_retention_as_responses_do(server, keys):
    """The openai SDK sends prompt_cache_retention on chat.completions too: "24h" retains the prompt
    (GET /v1/cache) and counts its cache writes, as on /v1/responses; "in_memory" is the default policy;
    legacy completions has no such field (at OpenAI as here), so there it is an unknown field, ignored."""
    messages = [{"role": "system", "content": "Care guide of ExampleCo: oil the hinges yearly, dust weekly. " * 3},
                {"role": "user", "content": "How often do I oil the hinges?"}]

    def client(name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server}/v1", api_key=keys[name], max_retries=0, timeout=120)

    assert _retained(server, keys["chat24"]) == 0
    r = client("chat24").chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                                 prompt_cache_retention="24h")
    assert _retained(server, keys["chat24"]) >= 16 and r.usage.prompt_tokens >= 16
    assert _written(server, keys["chat24"]) >= 16
    client("in-memory").chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                                prompt_cache_retention="in_memory")
    assert _retained(server, keys["in-memory"]) == 0
    client("legacy").completions.create(model="tiny", prompt=messages[0]["content"], max_tokens=1,
                                        extra_body={"prompt_cache_retention": "24h"})
    assert _retained(server, keys["legacy"]) == 0


def test_a_bad_prompt_cache_retention_is_one_400_on_chat_and_responses(server, keys):
    headers = {"Authorization": f"Bearer {keys['plain']}"}
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
              "/v1/responses": {"input": "x", "max_output_tokens": 1}}
    errors = []
    for path, body in bodies.items():
        r = httpx.post(f"{server}{path}", headers=headers, trust_env=False, timeout=60,
                       json={"model": "tiny", **body, "prompt_cache_retention": "bogus"})
        assert r.status_code == 400, r.text
        errors.append(r.json()["error"])
    assert errors[0] == errors[1], errors
    assert errors[0]["param"] == "prompt_cache_retention" and errors[0]["code"] == "invalid_value"
    assert "'in_memory' and '24h'" in errors[0]["message"]
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=f"{server}/v1", api_key=keys["plain"], max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1, prompt_cache_retention="1w")
    ok = httpx.post(f"{server}/v1/completions", headers=headers, trust_env=False, timeout=60,
                    json={"model": "tiny", "prompt": "x", "max_tokens": 1, "prompt_cache_retention": "bogus"})
    assert ok.status_code == 200, ok.text  # not a completions field: unknown, tolerated
