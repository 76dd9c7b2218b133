"""course/pitfall_desync.py, its lesson module (helpers.notebook.lessons.flight) and check_diagnosis: the dump
parser finds who stopped where on synthetic dumps, the checker's right and wrong answers, and (slow) each injected
fault at 2 and 3 ranks named by the parser, by torch's analyser and by every claim line."""
import json
import pickle

import pytest

from helpers.notebook.exercises import write_trace
from helpers.notebook.lessons import flight


def entry(seq: int, op: str) -> dict:
    """One Flight Recorder entry, with the fields the parser reads (a real one has many more)."""
    return {"collective_seq_id": seq, "profiling_name": f"gloo:{op}", "is_p2p": False, "process_group": ("0", "")}


def write_dumps(run_dir, calls: dict[int, list[str]]) -> None:
    """A run folder holding ``fr/fr_rank<R>`` for each rank, its collectives numbered 1, 2, ... in the given order."""
    (run_dir / flight.DUMPS).mkdir(parents=True)
    for rank, ops in calls.items():
        dump = {"version": "2.10", "pg_config": {}, "entries": [entry(i + 1, op) for i, op in enumerate(ops)]}
        (run_dir / flight.DUMPS / f"{flight.PREFIX}{rank}").write_bytes(pickle.dumps(dump))


STEPS = ["all_reduce"] * 4
ORDER = {0: STEPS + ["all_reduce"], 1: STEPS + ["all_reduce"], 2: STEPS + ["broadcast"]}
MISSING = {0: STEPS, 1: STEPS[:-1]}


# --- the parser ------------------------------------------------------------------------------------------------------

def test_first_disagreement_names_the_odd_rank_out():
    calls = {r: dict(enumerate(ops, 1)) for r, ops in ORDER.items()}
    assert flight.first_disagreement(calls) == {"rank": 2, "op": "broadcast", "seq": 5, "expected": "all_reduce"}
    calls = {r: dict(enumerate(ops, 1)) for r, ops in MISSING.items()}
    assert flight.first_disagreement(calls) == {"rank": 1, "op": None, "seq": 4, "expected": "all_reduce"}


def test_first_disagreement_of_two_ranks_takes_rank_0_as_the_reference_and_none_when_all_agree():
    calls = {0: {1: "all_reduce", 2: "all_reduce"}, 1: {1: "all_reduce", 2: "broadcast"}}
    assert flight.first_disagreement(calls)["rank"] == 1
    assert flight.first_disagreement({0: {1: "all_reduce"}, 1: {1: "all_reduce"}}) is None
    assert flight.first_disagreement({}) is None


def test_first_disagreement_skips_what_the_ring_buffer_dropped():
    calls = {0: {3: "all_reduce", 4: "all_reduce"}, 1: {1: "barrier", 2: "x", 3: "all_reduce", 4: "broadcast"}}
    assert flight.first_disagreement(calls) == {"rank": 1, "op": "broadcast", "seq": 4, "expected": "all_reduce"}


def test_stuck_reads_the_dump_files_of_a_run_folder(tmp_path):
    write_dumps(tmp_path, ORDER)
    (tmp_path / flight.DUMPS / ".partial3").write_bytes(b"half")  # a dump being written: not a rank's
    assert sorted(flight.dumps(tmp_path)) == [0, 1, 2]
    assert flight.collectives(flight.dumps(tmp_path)[2])[5] == "broadcast"
    assert flight.stuck(tmp_path) == {"rank": 2, "op": "broadcast", "seq": 5, "expected": "all_reduce"}


def test_injected_says_the_last_rank_at_any_nproc():
    assert flight.injected("order", 4) == {"rank": 3, "op": "broadcast", "seq": 5, "expected": "all_reduce"}
    assert flight.injected("missing", 2, steps=6)["seq"] == 6
    with pytest.raises(ValueError, match="order"):
        flight.injected("none", 2)


def test_excerpt_keeps_the_verdict_lines_and_the_course_frame():
    text = ("Not all ranks joining collective, sequence number: 4\ninternal record id: 3\ncollective: gloo:all_reduce\n"
            "missing ranks: {1}\ncollective stack trace:\n all_reduce at <site-packages>/torch/x.py:1\n"
            "main at course/pitfall_desync.py:75\n")
    assert flight.excerpt(text) == ["Not all ranks joining collective, sequence number: 4",
                                    "collective: gloo:all_reduce", "missing ranks: {1}",
                                    "main at course/pitfall_desync.py:75"]


# --- check_diagnosis ----------------------------------------------------------------------------------------------

@pytest.fixture
def missing(tmp_path):
    write_dumps(tmp_path, MISSING)
    return tmp_path


@pytest.mark.parametrize("op", ["all_reduce", "allreduce", "dist.all_reduce()", "ALLREDUCE", "gloo:all_reduce"])
def test_check_diagnosis_accepts_the_rank_behind_and_the_collective_it_never_called(missing, op):
    verdict = write_trace.check_diagnosis(1, op, missing)
    assert verdict.ok and "rank 1 never called all_reduce #4" in verdict.message


@pytest.mark.parametrize("rank, op, hint", [
    (0, "all_reduce", "lowest sequence number"),
    (5, "all_reduce", "ranks 0 to 1"),
    (1, "broadcast", "the other ranks waited in"),
    ("one", "all_reduce", "as a number"),
    (1, 3, "as the analysis does"),
])
def test_check_diagnosis_names_the_mistake(missing, rank, op, hint):
    verdict = write_trace.check_diagnosis(rank, op, missing)
    assert not verdict.ok and hint in verdict.hint


def test_check_diagnosis_on_a_swapped_order(tmp_path):
    write_dumps(tmp_path, ORDER)
    assert write_trace.check_diagnosis(2, "broadcast", tmp_path).ok
    said = write_trace.check_diagnosis(2, "all_reduce", tmp_path)
    assert not said.ok and "what the other ranks called" in said.hint
    assert "culprit" in write_trace.check_diagnosis(0, "broadcast", tmp_path).hint


def test_check_diagnosis_on_a_run_that_agrees_or_has_no_dumps(tmp_path):
    write_dumps(tmp_path, {0: STEPS, 1: STEPS})
    assert "same collectives" in write_trace.check_diagnosis(1, "all_reduce", tmp_path).message
    assert "no Flight Recorder dumps" in write_trace.check_diagnosis(1, "all_reduce", tmp_path / "nowhere").message


# --- real runs ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_without_a_fault_the_run_passes_and_the_dumps_agree(runs_root):
    run = flight.run_scenario("none", nproc=2, timeout_s=3)
    assert run.returncode == 0 and sorted(flight.dumps(run)) == [0, 1] and flight.stuck(run) is None
    assert json.loads((run.run_dir / "env.json").read_text())["args"][:2] == ["--scenario", "none"]


@pytest.mark.slow
def test_gloo_writes_no_dump_by_itself_so_the_script_writes_each_ranks(runs_root, tmp_path):
    # what NCCL's watchdog is told to do on a timeout, asked of gloo: torch 2.14 writes nothing, hence the script's
    # own dump (torch's private _dump_fr_trace, pinned here and by the tests above that read its files)
    from helpers import launch

    folder = tmp_path / "dumps"
    folder.mkdir()
    prefix = folder / "torch_dump_"
    with pytest.raises(launch.LaunchError):
        launch.torchrun(flight.SCRIPT, nproc=2, args=["--scenario", "order", "--timeout-s", "3", "--no-dump"],
                        env={"CUDA_VISIBLE_DEVICES": "", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                             "TORCH_FR_DUMP_TEMP_FILE": str(prefix)}, timeout=120, show="none", name="fr_no_dump")
    assert list(folder.iterdir()) == []
    assert callable(getattr(__import__("torch")._C._distributed_c10d, "_dump_fr_trace", None))
