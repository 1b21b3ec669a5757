"""Schemathesis against the gateway's own OpenAPI schema: every route, with and without a valid key.

Property: no input makes the server answer 5xx, and every 4xx body is the error shape its API's
clients expect: the OpenAI envelope, or Anthropic's on ``/v1/messages``.
Bounded (``MAX_EXAMPLES`` per route and auth mode) so it runs in well under a minute on 2 cores;
``PG_FUZZ_EXAMPLES`` raises it for a longer run.
"""

from __future__ import annotations

import os
from collections import Counter
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, settings
from security_helpers import assert_anthropic_error, assert_openai_error, auth

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = int(os.environ.get("PG_FUZZ_EXAMPLES", "15"))
# a generated max_tokens of 10^6 is valid input, but decoding it on the tiny CPU model takes
# minutes; the bound is checked separately (test_bad_input) and capped here.
MAX_TOKENS_CAP = 4


@pytest.fixture(scope="module")
def fuzz_target(gateway):
    client, keys, app = gateway
    return schemathesis.openapi.from_asgi("/openapi.json", app), keys


def _check(response) -> None:
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:500]}"
    if status >= 400:
        anthropic_door = urlsplit(str(response.request.url)).path.startswith("/v1/messages")
        (assert_anthropic_error if anthropic_door else assert_openai_error)(response.json(), status)


def _cap(case, model: str | None) -> None:
    if isinstance(case.body, dict):
        if model is not None:
            case.body["model"] = model
            # the server default (256) is slow on CPU; /v1/responses spells it max_output_tokens
            # (and ignores max_tokens: uncapped, one such body took over the 10 s read timeout)
            limit = "max_output_tokens" if case.path == "/v1/responses" else "max_tokens"
            if limit not in case.body and "max_completion_tokens" not in case.body:
                case.body[limit] = MAX_TOKENS_CAP
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n"):
            value = case.body.get(field)
            # pydantic also takes 200.0 and "200" as 200: cap every spelling of a large number
            try:
                large = not isinstance(value, bool) and float(value) > MAX_TOKENS_CAP
            except (TypeError, ValueError, OverflowError):
                large = False
            if large:
                case.body[field] = MAX_TOKENS_CAP


def _run_schema(schema, headers: dict[str, str] | None, model: str | None = None) -> Counter[int]:
    """Run every operation of ``schema`` for a bounded number of examples -> calls per status."""
    from hypothesis import given

    statuses: Counter[int] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            _cap(case, model)
            response = case.call(headers=headers) if headers else case.call()
            statuses[response.status_code] += 1
            if os.environ.get("PG_FUZZ_DEBUG"):
                print(case.method, case.path, response.status_code, str(case.body)[:80], response.text[:120])
            _check(response)

        run()
    return statuses


def test_fuzz_every_route_without_valid_auth(fuzz_target) -> None:
    schema, _ = fuzz_target
    statuses = _run_schema(schema, None)
    print(dict(statuses))
    assert statuses[401] > 0 and sum(statuses.values()) >= 50


def test_fuzz_every_route_with_valid_auth(fuzz_target) -> None:
    schema, keys = fuzz_target
    statuses = _run_schema(schema, auth(keys["acme"]))
    print(dict(statuses))
    # the valid key gets past auth: some requests succeed, the rest are clean 4xx
    assert statuses[200] > 0 and sum(statuses.values()) >= 50


def test_fuzz_bodies_that_reach_the_engine(fuzz_target) -> None:
    """Same, with the body's model forced to the served one, so generated bodies reach the engine."""
    schema, keys = fuzz_target
    statuses = _run_schema(schema, auth(keys["acme"]), model="tiny")
    print(dict(statuses))
    assert statuses[200] > 0 and statuses[400] > 0
