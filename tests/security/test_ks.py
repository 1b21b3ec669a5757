"""The KS test the timing audit relies on, checked against known values (no scipy)."""

from __future__ import annotations

import random

import pytest
from security_helpers import kolmogorov_q, ks_2samp


def test_identical_samples_have_zero_distance() -> None:
    d, p = ks_2samp([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])
    assert d == 0.0 and p == 1.0


def test_disjoint_samples_have_distance_one() -> None:
    d, p = ks_2samp([1.0] * 200, [2.0] * 200)
    assert d == 1.0 and p < 1e-30


def test_distance_by_hand() -> None:
    # F_a jumps at 1,2,3,4; F_b at 3,4,5,6: the largest gap is at x=2 (0.5 - 0) and x=4 (1.0 - 0.5).
    d, _ = ks_2samp([1, 2, 3, 4], [3, 4, 5, 6])
    assert d == pytest.approx(0.5)


def test_kolmogorov_distribution_known_points() -> None:
    # Critical values of the Kolmogorov distribution: P(K > 1.358) = 0.05, P(K > 1.628) = 0.01.
    assert kolmogorov_q(1.358) == pytest.approx(0.05, abs=1e-3)
    assert kolmogorov_q(1.628) == pytest.approx(0.01, abs=5e-4)
    assert kolmogorov_q(0.5) == pytest.approx(0.9639, abs=1e-3)


def test_same_distribution_is_rarely_rejected_and_a_shift_always() -> None:
    rng = random.Random(7)
    rejected = 0
    for _ in range(200):
        a = [rng.gauss(0, 1) for _ in range(200)]
        b = [rng.gauss(0, 1) for _ in range(200)]
        rejected += ks_2samp(a, b)[1] < 0.05
    assert rejected <= 20  # nominal 5% = 10 of 200; a wrong p-value is far off either way
    a = [rng.gauss(0, 1) for _ in range(200)]
    b = [rng.gauss(0.5, 1) for _ in range(200)]
    assert ks_2samp(a, b)[1] < 1e-3
