"""Helpers shared by the security and slow suites: homes with tenants, OpenAI-shape checks, KS test."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TENANT_NAMES = ("acme", "beta")


def make_home(home: Path) -> tuple[Path, dict[str, str]]:
    """Build the tiny model under ``home`` and create tenants acme, beta and an admin 'ops'."""
    from engine.launch import ensure_tiny_model
    from tenancy.service import TenancyService

    ensure_tiny_model(home)
    svc = TenancyService.open(home)
    try:
        keys = {name: svc.create_tenant(name).api_key for name in TENANT_NAMES}
        keys["admin"] = svc.create_tenant("ops", admin=True).api_key
        svc.flush()
    finally:
        svc.close()
    return home, keys


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(body: Any, status: int) -> dict[str, Any]:
    """The OpenAI error envelope: {"error": {"message": str, "type": str, "param", "code"}}."""
    assert isinstance(body, dict) and set(body) == {"error"}, f"HTTP {status}: not the OpenAI shape: {body!r}"
    err = body["error"]
    assert isinstance(err, dict), body
    assert set(err) >= {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    return err


def ks_2samp(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov test, two-sided -> (D, asymptotic p-value).

    D = sup_x |F_a(x) - F_b(x)| over the pooled sample; p from the Kolmogorov distribution
    Q(lam) = 2 sum_{k>=1} (-1)^(k-1) exp(-2 k^2 lam^2) with Stephens' small-sample correction
    lam = (sqrt(n_e) + 0.12 + 0.11 / sqrt(n_e)) * D, n_e = n m / (n + m) (Numerical Recipes
    ``kstwo``). Accurate for n_e >= 4; our audits use 200+ samples per side.
    """
    xs, ys = sorted(a), sorted(b)
    n, m = len(xs), len(ys)
    if n == 0 or m == 0:
        raise ValueError("both samples must be non-empty")
    i = j = 0
    d = 0.0
    while i < n and j < m:
        x = min(xs[i], ys[j])
        while i < n and xs[i] <= x:  # step over ties together: both CDFs jump at x
            i += 1
        while j < m and ys[j] <= x:
            j += 1
        d = max(d, abs(i / n - j / m))
    ne = n * m / (n + m)
    lam = (math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d
    return d, kolmogorov_q(lam)


def kolmogorov_q(lam: float) -> float:
    """P(K > lam) for the Kolmogorov distribution (the KS p-value)."""
    if lam < 1e-3:
        return 1.0
    total, sign = 0.0, 1.0
    for k in range(1, 101):
        term = sign * 2.0 * math.exp(-2.0 * k * k * lam * lam)
        total += term
        if abs(term) < 1e-12:
            break
        sign = -sign
    return min(1.0, max(0.0, total))
