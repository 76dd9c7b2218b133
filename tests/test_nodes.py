"""launch.torchrun(nnodes=2): two torchrun agents on this machine act as two nodes of one job."""
from pathlib import Path

import pytest

from helpers import launch
from helpers.launch import LaunchError
from test_launch_faults import assert_no_survivors

STEPS = "tests/scripts/steps.py"


@pytest.mark.slow
def test_two_nodes_number_ranks_globally_and_locally(runs_root, children_before):
    run = launch.torchrun("course/ddp_basics.py", 1, nnodes=2, show="none", timeout=180)
    ranks = run.results_by_rank()
    assert sorted(ranks) == [0, 1]
    assert all(r["world_size"] == 2 and r["local_world_size"] == 1 for r in ranks.values())
    assert [r["local_rank"] for r in ranks.values()] == [0, 0], "each node numbers its ranks from 0"
    assert len(list(run.run_dir.glob("elastic/node*"))) == 2, "one torchrun agent per node"
    assert_no_survivors(run.run_dir, children_before)


@pytest.mark.slow
def test_crash_on_the_second_node_names_its_global_rank(runs_root, children_before):
    with pytest.raises(LaunchError) as info:
        launch.torchrun(STEPS, 1, nnodes=2, show="none", timeout=180, env={"FAULT_RANK": 1, "FAULT_STEP": 2})
    assert info.value.rank == 1
    assert "injected fault on rank 1" in str(info.value)
    assert_no_survivors(info.value.run_dir, children_before)


def test_nodes_sharing_gpus_are_refused(runs_root):
    with pytest.raises(LaunchError, match="share GPUs") as info:
        launch.torchrun(STEPS, 1, nnodes=2, machine=launch.Machine(gpus=2, cpus=8))
    assert info.value.reason == "invalid"
    assert not Path(runs_root).exists()


@pytest.mark.parametrize("nnodes", [0, -1, "2", True, 1.5])
def test_bad_nnodes_is_refused(runs_root, nnodes):
    with pytest.raises(LaunchError, match="nnodes"):
        launch.torchrun(STEPS, 1, nnodes=nnodes)
