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


def test_each_size_range_is_priced_by_its_own_line():
    sizes, seconds = [1e6, 2e6, 4e6], [1e-3, 2e-3, 6e-3]  # 1 GB/s up to 2 MB, then 0.5 GB/s: a cache outgrown
    assert [comm.local_seconds(sizes, seconds, s) for s in sizes] == pytest.approx(seconds)  # through each point
    assert comm.local_seconds(sizes, seconds, 1.5e6) == pytest.approx(1.5e-3)
    assert comm.local_seconds(sizes, seconds, 3e6) == pytest.approx(4e-3)
    assert comm.local_seconds(sizes, seconds, 8e6) == pytest.approx(14e-3)  # beyond: the last range's line
    assert comm.local_seconds(sizes, seconds, 0.5e6) == pytest.approx(0.5e-3)  # below: the first range's line
    assert comm.local_seconds([4e6, 1e6, 2e6], [6e-3, 1e-3, 2e-3], 3e6) == pytest.approx(4e-3)  # any order
    assert comm.local_seconds([1e6, 2e6], [1e-3, 3e-3], 1e3) == 0.0  # a line below zero is no time, not negative
    one_line = comm.fit_alpha_beta(sizes, seconds)
    assert max(abs(r) for r in one_line["residuals"]) > 0.1  # what one line misses on the same points
    fits = {"all_reduce": dict(one_line, sizes=sizes, seconds=seconds)}
    assert comm.predict_calls(fits, [("all_reduce", 3e6)] * 2, local=True) == pytest.approx(8e-3)
    assert comm.predict_calls(fits, [("all_reduce", 3e6)]) == pytest.approx(comm.predict_seconds(one_line, 3e6))
    with pytest.raises(ValueError, match="two or more different sizes"):
        comm.local_seconds([1e6, 1e6], [1e-3, 2e-3], 1e6)
    with pytest.raises(KeyError, match="all_gather"):
        comm.predict_calls(fits, [("all_gather", 1e6)], local=True)


def test_a_collective_is_priced_at_the_idle_time_it_followed():
    sizes = [1e6, 2e6]
    by_idle = {0.0: [1e-3, 2e-3], 5.0: [1.5e-3, 2.5e-3], 30.0: [2e-3, 3e-3]}
    assert comm.idle_seconds(sizes, by_idle, 1e6, 0) == pytest.approx(1e-3)  # back to back
    assert comm.idle_seconds(sizes, by_idle, 1e6, 2.5) == pytest.approx(1.25e-3)  # half-way from 0 to 5 ms
    assert comm.idle_seconds(sizes, by_idle, 1.5e6, 17.5) == pytest.approx(2.25e-3)  # both lines at once
    assert comm.idle_seconds(sizes, by_idle, 1e6, 300) == pytest.approx(2e-3)  # beyond the longest: its price
    assert comm.idle_seconds(sizes, {30.0: [2e-3, 3e-3]}, 1e6, 1) == pytest.approx(2e-3)  # below the shortest
    fits = {"all_reduce": dict(sizes=sizes, seconds=by_idle[0.0], by_idle=by_idle, alpha=0.0, beta=1e-9)}
    assert comm.predict_calls(fits, [("all_reduce", 2e6)] * 2, idle=5) == pytest.approx(5e-3)
    assert comm.predict_calls(fits, [("all_reduce", 2e6)] * 2, local=True) == pytest.approx(4e-3)  # back to back
    with pytest.raises(ValueError, match="idle"):
        comm.idle_seconds(sizes, {}, 1e6, 1)
    with pytest.raises(ValueError, match="idle"):
        comm.idle_seconds(sizes, by_idle, 1e6, -1)


def test_no_size_costs_more_than_a_larger_one():
    # a spike at 128 KiB (0.97 ms, between 0.33 and 0.40 ms) is priced at the 256 KiB cost; the order of the
    # points does not matter, and a curve that already rises is left as it is
    sizes = [2 ** 16, 2 ** 17, 2 ** 18, 2 ** 19]
    assert comm.never_cheaper(sizes, [0.33, 0.97, 0.40, 0.46]) == [0.33, 0.40, 0.40, 0.46]
    assert comm.never_cheaper(sizes[::-1], [0.46, 0.40, 0.97, 0.33]) == [0.46, 0.40, 0.40, 0.33]
    assert comm.never_cheaper(sizes, [1.0, 2.0, 3.0, 4.0]) == [1.0, 2.0, 3.0, 4.0]
    # the price of a 147 KiB message, by the line through its two neighbours, before and after
    spiked = comm.local_seconds(sizes, [0.33, 0.97, 0.40, 0.46], 147 * 1024)
    capped = comm.local_seconds(sizes, comm.never_cheaper(sizes, [0.33, 0.97, 0.40, 0.46]), 147 * 1024)
    assert spiked > 0.85 and capped == pytest.approx(0.40)
    with pytest.raises(ValueError, match="sizes but"):
        comm.never_cheaper(sizes, [1.0])
