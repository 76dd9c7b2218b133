"""helpers.calc.comm's alpha-beta model: the fit recovers a known latency and bandwidth, weighs small and large
messages alike, refuses what it cannot fit, and predicts counts of collectives."""
from __future__ import annotations

import pytest

from helpers.calc import comm

SIZES = [1024 * 4 ** k for k in range(8)]  # 1 KiB .. 16 MiB, as notebook 00's sweep


def test_the_fit_recovers_latency_and_bandwidth_of_an_exact_model():
    alpha, gbs = 80e-6, 0.5
    fit = comm.fit_alpha_beta(SIZES, [alpha + n / (gbs * 1e9) for n in SIZES])
    assert fit["alpha"] == pytest.approx(alpha) and fit["bandwidth"] == pytest.approx(gbs)
    assert max(abs(r) for r in fit["residuals"]) < 1e-9
    assert comm.predict_seconds(fit, 1e6, count=3) == pytest.approx(3 * (alpha + 1e6 / 0.5e9))


def test_relative_weighting_keeps_the_latency_of_small_messages():
    alpha, gbs = 80e-6, 0.5
    noisy = [(alpha + n / (gbs * 1e9)) * (1.05 if i % 2 else 0.95) for i, n in enumerate(SIZES)]
    fit = comm.fit_alpha_beta(SIZES, noisy)
    assert fit["alpha"] == pytest.approx(alpha, rel=0.1)  # an unweighted fit misses a 1 KiB latency by far more
    assert max(abs(r) for r in fit["residuals"]) < 0.1


def test_what_cannot_be_fitted_is_refused():
    with pytest.raises(ValueError, match="two or more"):
        comm.fit_alpha_beta([1024], [1e-4])
    with pytest.raises(ValueError, match="two different sizes"):
        comm.fit_alpha_beta([1024, 1024], [1e-4, 2e-4])
