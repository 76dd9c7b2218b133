"""The notebook-01 scripts (ddp_basics, collectives, sampler_demo), launched for real on two ranks."""
import pytest

from helpers import launch
from helpers.rank.devices import gpu_count

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(gpu_count() == 1, reason="two ranks need two GPUs (or none) on this machine")]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """Launch a course script on two ranks, with run directories in a temporary folder."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HELPERS_RUNS_DIR", str(tmp_path_factory.mktemp("runs")))

        def _start(script, *args):
            return launch.torchrun(f"course/{script}", nproc=2, args=list(args), show="none", timeout=120)
        yield _start


# --- ddp_basics.py ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def basics(start):
    return start("ddp_basics.py").results_by_rank()


def test_both_ranks_report_who_they_are(basics):
    assert sorted(basics) == [0, 1]
    assert [basics[r]["env_rank"] for r in (0, 1)] == [0, 1]
    assert all(basics[r]["world_size"] == basics[r]["local_world_size"] == 2 for r in (0, 1))


def test_local_rank_equals_rank_on_one_node(basics):
    assert all(basics[r]["local_rank"] == basics[r]["env_rank"] for r in (0, 1))


def test_dist_get_rank_matches_rank_variable_after_init(basics):
    assert all(basics[r]["rank_matches"] and basics[r]["dist_rank"] == r for r in (0, 1))


def test_rendezvous_variables_are_set_and_ranks_are_separate_processes(basics):
    assert all(basics[r]["master_addr_set"] and basics[r]["master_port_set"] for r in (0, 1))
    assert basics[0]["pid"] != basics[1]["pid"]
    assert basics[0]["hostname"] == basics[1]["hostname"]
    assert {basics[r]["backend"] for r in (0, 1)} == {"nccl" if gpu_count() else "gloo"}


# --- collectives.py --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def collectives(start):
    return start("collectives.py").results_by_rank()


def test_every_collective_is_correct_on_every_rank(collectives):
    assert sorted(collectives) == [0, 1]
    for rank, res in collectives.items():
        checks = {k: v for k, v in res.items() if k.endswith("_ok")}
        assert res["all_ok"] and all(v in (True, None) for v in checks.values()), (rank, checks)
        assert res["all_reduce_sum"] == [3] and res["all_reduce_max"] == [2]
        assert res["broadcast"] == [3, 1, 4]
        assert res["all_gather"] == [[0, 0], [1, 10]]
        assert res["scatter"] == [100 * rank, 100 * rank + 1]


def test_reduce_scatter_is_either_correct_or_skipped_with_a_reason(collectives):
    for rank, res in collectives.items():
        if res["reduce_scatter_skipped"] is None:
            assert res["reduce_scatter"] == [[0, 3], [6, 9]][rank] and res["reduce_scatter_ok"]
        else:
            assert res["reduce_scatter"] is None and res["reduce_scatter_skipped"]


def test_nobody_leaves_the_barrier_before_the_slowest_rank_arrives(collectives):
    arrivals = [collectives[r]["barrier_arrived"] for r in (0, 1)]
    departures = [collectives[r]["barrier_left"] for r in (0, 1)]
    assert min(departures) >= max(arrivals)
    assert arrivals[1] - arrivals[0] > 0.3  # rank 1 slept 0.5 s more ...
    assert collectives[0]["barrier_waited_s"] > 0.3  # ... and rank 0 waited for it
    assert all(collectives[r]["barrier_ok"] for r in (0, 1))


# --- sampler_demo.py -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampler_run(start):
    return start("sampler_demo.py")


@pytest.fixture(scope="module")
def sampler(sampler_run):
    return sampler_run.result


@pytest.fixture(scope="module")
def sampler_padded(start):
    return start("sampler_demo.py", "--num-samples", "21").result


@pytest.fixture(scope="module")
def sampler_no_set_epoch(start):
    return start("sampler_demo.py", "--no-set-epoch").result


def test_shards_are_disjoint_and_cover_the_dataset(sampler):
    assert sampler["disjoint"] and sampler["covers"] and sampler["padded"] == 0
    for shards in sampler["shards_by_epoch"]:
        assert sorted(shards[0] + shards[1]) == list(range(20))


def test_epochs_differ_with_set_epoch(sampler):
    assert sampler["set_epoch"] and sampler["epochs_differ"]
    assert sampler["shards_by_epoch"][0] != sampler["shards_by_epoch"][1]


def test_epochs_repeat_without_set_epoch(sampler_no_set_epoch):
    res = sampler_no_set_epoch
    assert not res["set_epoch"] and not res["epochs_differ"]
    assert res["shards_by_epoch"][0] == res["shards_by_epoch"][1]
    assert res["disjoint"] and res["covers"]


def test_uneven_dataset_is_padded_by_repeating_indices(sampler_padded):
    res = sampler_padded
    assert res["padded"] == 1 and res["per_rank"] == 11
    assert res["covers"] and not res["disjoint"]
    assert [len(r) for r in res["repeated"]] == [1, 1]  # one index seen twice per epoch


def test_every_rank_reports_its_own_shard_and_the_same_picture(sampler_run):
    by_rank = sampler_run.results_by_rank()
    assert sorted(by_rank) == [0, 1]
    for rank, res in by_rank.items():
        assert res["my_shards"] == [shards[rank] for shards in res["shards_by_epoch"]]
    assert by_rank[0]["shards_by_epoch"] == by_rank[1]["shards_by_epoch"]
