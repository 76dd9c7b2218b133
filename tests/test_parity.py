"""helpers.calc.parity: the noise floor of fp32 rounding from two curves, the bound, and curves it must refuse."""
import pytest

from helpers.calc import parity

# a one-process reference in fp64, its fp32 twin (a drift growing to 2e-5), and curves to compare with the fp32 one
ONE64 = [2.30, 2.21, 2.12, 2.02, 1.95, 1.90]
DRIFT = [1e-7, 2e-7, 1e-6, 4e-6, 1e-5, 2e-5]
ONE32 = [a + d for a, d in zip(ONE64, DRIFT)]


def test_floor_is_the_fp32_runs_largest_distance_from_the_fp64_run():
    assert parity.floor(ONE32, ONE64) == pytest.approx(2e-5)
    assert parity.floor(ONE32, ONE64, upto=3) == pytest.approx(1e-6)  # only the compared steps' drift counts


def test_floor_is_never_below_one_fp32_unit_of_the_losses():
    assert parity.floor(ONE64, ONE64) == pytest.approx(parity.FP32_EPS * 2.30)
    assert parity.spread_floor([1.0, 1.0], [1.0, 1.0]) == parity.FP32_EPS


def test_another_fp32_ordering_within_a_few_floors_is_accepted():
    other = [a - 1.5 * d for a, d in zip(ONE64, DRIFT)]  # drifts the other way: 2.5 floors from the fp32 run
    result = parity.check(other, ONE32, parity.floor(ONE32, ONE64))
    assert result["ok"] and result["ratio"] == pytest.approx(2.5) and result["bound"] == pytest.approx(8 * 2e-5)


def test_a_curve_off_by_more_than_k_floors_is_refused():
    wrong = list(ONE32)
    wrong[-1] += 9 * 2e-5  # e.g. one different batch, a missed all-reduce, a different update
    result = parity.check(wrong, ONE32, parity.floor(ONE32, ONE64))
    assert not result["ok"] and result["ratio"] == pytest.approx(9)
    assert "= 9 x the floor 2.00e-05; bound 1.60e-04 (1.1 of it)" in parity.describe(result)


def test_a_larger_k_or_an_explicit_bound_moves_the_limit():
    wrong = [a + 1.8e-4 for a in ONE32]  # 9 floors
    floor = parity.floor(ONE32, ONE64)
    assert parity.check(wrong, ONE32, floor, k=10)["ok"] and not parity.check(wrong, ONE32, floor)["ok"]
    assert not parity.check(wrong, ONE32, floor, bound=1e-5)["ok"]


def test_fp64_bound_scales_the_fp32_floor_by_the_rounding_ratio():
    assert parity.fp64_bound(1e-4) == pytest.approx(8 * 1e-4 * 2.0 ** -29)
    one = [2.3, 2.2]
    assert parity.check([2.3, 2.2 + 1e-13], one, 1e-4, bound=parity.fp64_bound(1e-4))["ok"]
    assert not parity.check([2.3, 2.2 + 1e-11], one, 1e-4, bound=parity.fp64_bound(1e-4))["ok"]


def test_mappings_pair_by_step_so_a_resumed_curve_compares_with_its_own_steps():
    one = dict(enumerate(ONE32, start=1))
    resumed = {5: ONE32[4] + 1e-5, 6: ONE32[5] - 1e-5}
    assert parity.max_gap(resumed, one) == pytest.approx(1e-5)
    assert parity.floor(one, dict(enumerate(ONE64, start=1)), upto=4) == pytest.approx(4e-6)


def test_curves_that_do_not_cover_the_same_steps_are_refused_not_cut_short():
    with pytest.raises(ValueError, match="same steps"):
        parity.check(ONE32[:3], ONE32, 1e-5)
    with pytest.raises(ValueError, match=r"steps \[7\]"):
        parity.max_gap({7: 1.0}, dict(enumerate(ONE32, start=1)))
    with pytest.raises(TypeError):
        parity.max_gap(ONE32, dict(enumerate(ONE32, start=1)))
    with pytest.raises(ValueError, match="positive"):
        parity.check(ONE32, ONE32, 0.0)


def test_twin_floor_is_the_largest_rounding_of_the_runs_given_with_their_fp64_twins():
    two32, two64 = [2.30, 2.21 + 5e-5], [2.30, 2.21]  # a distributed run that rounded further from exact
    assert parity.twin_floor((ONE32, ONE64), (two32, two64)) == pytest.approx(5e-5)
    assert parity.twin_floor((ONE32, ONE64)) == parity.floor(ONE32, ONE64)
    with pytest.raises(ValueError):
        parity.twin_floor()
