"""Helpers shared by the security and slow suites: homes with tenants, OpenAI-shape checks, KS test."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def offline_env() -> None:
    """Set before anything imports litellm/tiktoken/transformers, so nothing touches the network."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    import importlib.util

    spec = importlib.util.find_spec("litellm")
    if spec and spec.origin:
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(Path(spec.origin).parent / "litellm_core_utils" / "tokenizers"))


offline_env()

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


def assert_anthropic_error(body: Any, status: int) -> dict[str, Any]:
    """Anthropic's error shape (``/v1/messages``): {"type": "error", "error": {"type": str, "message": str}}."""
    assert isinstance(body, dict) and body.get("type") == "error", f"HTTP {status}: not Anthropic's shape: {body!r}"
    err = body.get("error")
    assert isinstance(err, dict) and isinstance(err.get("type"), str) and err["type"], body
    assert isinstance(err.get("message"), str) and err["message"], body
    return err


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


# --------------------------------------------------------------------------- timing audit

_WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
          "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega"]


def random_prompt(rng, words: int) -> str:
    """A prompt nobody has sent before (random words; ~1.1 tokens a word with cl100k)."""
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def timing_audit(client, victim_key: str, attacker_key: str, trials: int, *, words: int = 160,
                 seed: int = 0) -> dict[str, Any]:
    """The prompt-cache audit of Gu et al. 2025 ("Auditing Prompt Caching in LM APIs"), over HTTP.

    Each trial: the victim sends a fresh random prompt P; then the attacker sends either P (an
    "attack" trial: a hit if the cache is shared) or another fresh prompt Q of the same length (a
    "control" trial: a certain miss). The two kinds are interleaved in a shuffled order, so drift
    in machine load affects both alike, and each is preceded by the same victim work. The attacker
    measures time to the complete max_tokens=1 response (= TTFT for one token).

    Returns {"attack": [s...], "control": [s...], "D", "p", "attack_cached", "control_cached"}
    where *_cached sum the cached_tokens the attacker was told (0 across tenants).
    """
    import random
    import time

    rng = random.Random(seed)
    kinds = ["attack"] * trials + ["control"] * trials
    rng.shuffle(kinds)
    times: dict[str, list[float]] = {"attack": [], "control": []}
    cached = {"attack": 0, "control": 0}

    def send(key: str, prompt: str) -> tuple[float, int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        t0 = time.perf_counter()
        r = client.post("/v1/completions", json=body, headers=auth(key))
        dt = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        return dt, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for _ in range(3):  # warm-up: first requests pay one-time costs (allocations, caches)
        send(attacker_key, random_prompt(rng, words))
    for kind in kinds:
        p = random_prompt(rng, words)
        send(victim_key, p)
        dt, hit = send(attacker_key, p if kind == "attack" else random_prompt(rng, words))
        times[kind].append(dt)
        cached[kind] += hit
    d, p = ks_2samp(times["attack"], times["control"])
    return {"attack": times["attack"], "control": times["control"], "D": d, "p": p,
            "attack_cached": cached["attack"], "control_cached": cached["control"]}


def summarize(xs: Sequence[float]) -> str:
    s = sorted(xs)
    return f"n={len(s)} p50={1000 * s[len(s) // 2]:.1f}ms p90={1000 * s[int(len(s) * 0.9)]:.1f}ms"
