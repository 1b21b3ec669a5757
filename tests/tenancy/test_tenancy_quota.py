"""Quotas: requests/min, tokens/min and USD budget, each with its own error kind."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from tenancy.errors import QuotaExceededError
from tenancy.quota import RateLimiter, check_budget, period_bounds, rate_error, usd
from tenancy.service import TenancyService
from tenancy.types import Quotas, UsageRecord


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_rpm_refuses_the_request_over_the_limit_with_kind_rate(svc: TenancyService) -> None:
    ctx = svc.authenticate(svc.create_tenant("a", rpm=3).api_key)
    for _ in range(3):
        svc.admit(ctx, estimated_tokens=10)
    with pytest.raises(QuotaExceededError) as err:
        svc.admit(ctx, estimated_tokens=10)
    e = err.value
    assert e.kind == "rate" and e.status == 429 and e.code == "rate_limit_exceeded"
    assert 0 < e.retry_after_s <= 20.0 + 1e-6  # one request refills in 60/3 s
    other = svc.authenticate(svc.create_tenant("b", rpm=3).api_key)
    svc.admit(other, estimated_tokens=10)  # buckets are per tenant


def test_tpm_refuses_with_kind_tokens_and_no_retry_when_the_request_can_never_fit(svc: TenancyService) -> None:
    ctx = svc.authenticate(svc.create_tenant("a", tpm=1000).api_key)
    svc.admit(ctx, estimated_tokens=600)
    with pytest.raises(QuotaExceededError) as err:
        svc.admit(ctx, estimated_tokens=600)
    assert err.value.kind == "tokens" and err.value.retry_after_s == pytest.approx(200 * 60 / 1000, rel=0.05)
    with pytest.raises(QuotaExceededError) as err:
        svc.admit(ctx, estimated_tokens=1001)
    assert err.value.kind == "tokens" and err.value.retry_after_s is None
    svc.admit(ctx, estimated_tokens=400)  # what is left still fits


def test_buckets_refill_at_the_per_minute_rate_and_a_refusal_consumes_nothing() -> None:
    clock = FakeClock()
    lim = RateLimiter(clock)
    q = Quotas(rpm=2, tpm=100)
    lim.admit("t", q, 50)
    lim.admit("t", q, 50)
    with pytest.raises(QuotaExceededError) as err:
        lim.admit("t", q, 1)
    assert err.value.kind == "rate" and err.value.retry_after_s == pytest.approx(30.0)
    clock.t += 30.0  # one request and 50 tokens refilled
    with pytest.raises(QuotaExceededError) as err:
        lim.admit("t", q, 60)
    assert err.value.kind == "tokens" and err.value.retry_after_s == pytest.approx(6.0)
    lim.admit("t", q, 50)  # the tokens refusal above did not eat the request slot
    clock.t += 3600
    lim.admit("t", q, 100)  # capped at capacity, not more
    with pytest.raises(QuotaExceededError):
        lim.admit("t", q, 100)


def test_budget_refuses_with_kind_budget_once_the_period_spend_reaches_it(svc: TenancyService) -> None:
    ctx = svc.authenticate(svc.create_tenant("a", budget_usd=0.01, budget_period="day").api_key)
    svc.admit(ctx, estimated_tokens=10)
    price = svc.price("gpt-4o", 1000, 0, 500)
    assert price.cost_usd > 0.005
    now = time.time()
    svc.record_usage(UsageRecord("r1", ctx.tenant_id, ctx.key_id, "gpt-4o", "openai", 1000, 0, 500, None, None,
                                 "ok", now))
    svc.admit(ctx, estimated_tokens=10)  # 0.0075 < 0.01
    svc.record_usage(UsageRecord("r2", ctx.tenant_id, ctx.key_id, "gpt-4o", "openai", 1000, 0, 500, None, None,
                                 "ok", now))
    with pytest.raises(QuotaExceededError) as err:
        svc.admit(ctx, estimated_tokens=10)
    e = err.value
    assert e.kind == "budget" and e.code == "insufficient_quota"
    assert 0 < e.retry_after_s <= 86400
    # spend recorded yesterday does not count against today
    other = svc.authenticate(svc.create_tenant("b", budget_usd=0.01, budget_period="day").api_key)
    svc.record_usage(UsageRecord("r3", other.tenant_id, other.key_id, "gpt-4o", "openai", 100000, 0, 0, None,
                                 None, "ok", now - 2 * 86400))
    svc.admit(other, estimated_tokens=10)


def test_budget_spend_is_read_from_the_shared_ledger(home, open_service) -> None:
    """Spend recorded by another gateway process counts once this one refreshes (within the TTL)."""
    g1, g2 = open_service(home, auth_cache_ttl_s=0.1), open_service(home, auth_cache_ttl_s=0.1)
    try:
        created = g1.create_tenant("a", budget_usd=0.001, budget_period="month")
        c1, c2 = g1.authenticate(created.api_key), g2.authenticate(created.api_key)
        g1.admit(c1, estimated_tokens=1)
        g2.record_usage(UsageRecord("x", c2.tenant_id, c2.key_id, "gpt-4o", "openai", 1000, 0, 0, None, None,
                                    "ok", time.time()))
        g2.flush()
        time.sleep(0.15)
        with pytest.raises(QuotaExceededError) as err:
            g1.admit(c1, estimated_tokens=1)
        assert err.value.kind == "budget"
    finally:
        g1.close()
        g2.close()


def test_quota_changes_apply_after_update(svc: TenancyService) -> None:
    created = svc.create_tenant("a", rpm=1)
    ctx = svc.authenticate(created.api_key)
    svc.admit(ctx, estimated_tokens=1)
    with pytest.raises(QuotaExceededError):
        svc.admit(ctx, estimated_tokens=1)
    svc.update_tenant("a", rpm=None, kv_blocks=64)
    ctx = svc.authenticate(created.api_key)
    assert ctx.quotas.rpm is None and ctx.kv_block_quota == 64
    for _ in range(20):
        svc.admit(ctx, estimated_tokens=1)


def test_period_bounds() -> None:
    now = datetime(2026, 12, 31, 23, 59, tzinfo=UTC)
    assert period_bounds("month", now) == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    assert period_bounds("day", now) == (datetime(2026, 12, 31, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    with pytest.raises(ValueError):
        period_bounds("week", now)


@pytest.mark.parametrize("wait", [19.0000001, 19.5, 19.9999, 0.2])
def test_the_retry_time_is_rounded_up_in_the_message_and_for_the_header(wait: float) -> None:
    """A client that waits the whole seconds it is told must be admitted: never rounded down."""
    for kind in ("rpm", "tpm"):
        e = rate_error(Quotas(rpm=3, tpm=1000), 600, kind, wait)
        assert wait <= e.retry_after_whole_s < max(wait, 1) + 1
        assert f"Retry in {e.retry_after_whole_s} s." in e.message


def test_a_budget_refusal_prints_amounts_under_a_cent_and_knows_when_it_resets() -> None:
    now = datetime(2026, 3, 4, 22, 30, tzinfo=UTC)
    with pytest.raises(QuotaExceededError) as err:
        check_budget(Quotas(budget_usd=0.00005, budget_period="day"), 0.0000532, now)
    assert "$0.0000532 spent of $0.00005 this day" in err.value.message
    assert err.value.retry_after_whole_s == 90 * 60  # to midnight UTC
    assert [usd(x) for x in (0, 5, 12.5, 0.5, 0.05, 0.123456)] == ["$0.00", "$5.00", "$12.50", "$0.50", "$0.05",
                                                                   "$0.1235"]
