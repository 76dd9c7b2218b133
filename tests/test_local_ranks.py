"""course/gpt_local.py: DP x TP ranks with real numbers, simulated in this process (torch's LocalTensor) at 8-64
ranks, against one unsplit process; the private API it rests on, pinned; a layout that cannot split refused before
anything starts. The same step on 4 real gloo ranks against 4 simulated ones is notebook 14's claim (nbval runs it)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

import course.gpt_local as script
from helpers.notebook.lessons.at_scale import LOCAL_FLOORS

# Reordering fp32 sums moves a result by a few ulps of its terms, as much as fp32 itself moves it from fp64: a rank's
# gradients may sit a few noise floors (the one-process fp32 step's distance from fp64, measured in the same run)
# from fp64, never orders of magnitude.
FLOORS = LOCAL_FLOORS  # the same bound as notebook 14's claim


def simulate(world: int, tp: int) -> dict:
    """gpt_local.py's step on ``world`` ranks simulated in this process, TP ``tp``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return script.step(script.parse_args(["--simulate", str(world), "--tp", str(tp)]), world)
    finally:
        dist.destroy_process_group()


def test_the_private_api_the_simulation_rests_on_is_where_it_expects():
    """torch.distributed._local_tensor is private: if torch moves it, this fails first, naming what moved."""
    import torch.distributed._local_tensor as local

    for name in ("LocalTensorMode", "rank_map", "tensor_map", "enabled_local_tensor_mode"):
        assert hasattr(local, name), f"torch.distributed._local_tensor.{name} moved"


# 64 simulated ranks take 8 s alone and up to a minute beside the fast tier's other worker: the larger two are slow
@pytest.mark.parametrize("world, tp", [(8, 2), pytest.param(16, 4, marks=pytest.mark.slow)])  # 64: notebook 14
def test_every_simulated_rank_holds_the_one_process_step_within_a_few_noise_floors(world, tp):
    r = simulate(world, tp)
    assert (r["ranks"], r["dp"], r["tp"]) == (world, world // tp, tp)
    assert sorted(r["loss"]) == list(range(world)) and sorted(r["grad_error"]) == list(range(world))
    for loss in r["loss"].values():
        assert loss == pytest.approx(r["loss_one_process"], rel=1e-5)
    assert 0 < r["floor"] and max(r["grad_error"].values()) <= FLOORS * r["floor"]


def test_a_wrong_split_is_seen_by_the_comparison():
    """The check is not empty: without the DP average (each rank's gradients of its own slice) the error is far
    above the floors."""
    from helpers.rank import local_ranks

    keep = local_ranks.average_gradients
    script.average_gradients = lambda *a: None
    try:
        r = simulate(4, 2)
    finally:
        script.average_gradients = keep
    assert max(r["grad_error"].values()) > 100 * FLOORS * r["floor"]


@pytest.mark.parametrize("argv, problem", [(["--simulate", 12, "--tp", 5], "--tp 5 does not divide the 12 ranks"),
                                           (["--simulate", 12, "--tp", 3], "--tp 3 does not divide the 8 heads")])
def test_a_layout_that_cannot_split_is_refused_before_any_group_exists(argv, problem):
    with pytest.raises(SystemExit, match=problem):
        script.main([*map(str, argv)])
    assert not dist.is_initialized()
