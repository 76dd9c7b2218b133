"""helpers/rank/exercises/traffic.py: counting a learner's process-group calls, and leaving the group as it was."""
import pytest
import torch
import torch.distributed as dist

from helpers.rank.exercises.traffic import Traffic


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_calls_are_counted_inside_and_the_group_works_after(one_rank):
    t = torch.ones(3)
    with Traffic() as traffic:
        dist.all_reduce(t)
    assert traffic.elements("allreduce") == [3] and traffic.collectives() == ["all_reduce"]
    # pybind11 methods must be restored as the class held them (a bare function set back loses ``self``): the
    # calls after the context, and a second context, still reach the group
    dist.all_reduce(t)
    with Traffic() as again:
        dist.all_reduce(t)
    assert again.elements("allreduce") == [3] and torch.equal(t, torch.ones(3))
