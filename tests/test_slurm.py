"""The cluster templates run for real: course/slurm_torchrun.sbatch and course/slurm_deepspeed.sbatch submitted to
a one-node SLURM cluster (tests/slurm_cluster.py) that this module starts and stops.

Every job is the CPU rehearsal the templates' headers show: 2 CPU ranks (gloo), ``--gpus-per-node=0`` on the
command line over the templates' GPU line, one OpenMP thread per rank, generated data. The torchrun runs all train
the same job (2000 images, 2 epochs = 64 steps, a snapshot every 5 steps), so their final weights must agree bit for
bit whatever happened in between (notebook 06 claims the same for an elastic restart, on CPU):

* ``baseline``:  never interrupted.
* ``killed``:    one worker is sent SIGKILL after the first snapshot; torchrun (--max-restarts 3) restarts both
  workers, which resume from the newest snapshot.
* ``requeued``:  ``scontrol requeue`` after the first snapshot, as a preemption would: SLURM kills the whole job and
  runs it again under the same job id; the new torchrun resumes from the newest snapshot.

Needs root and Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them); skips with the reason otherwise.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from helpers.rank.checkpoint import list_snapshots, snapshot_step, state_dict_sha256
from helpers.rank.metrics import read_metrics, results, steps
from slurm_cluster import LocalSlurm, missing_binaries

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_SBATCH = REPO / "course" / "slurm_torchrun.sbatch"
DEEPSPEED_SBATCH = REPO / "course" / "slurm_deepspeed.sbatch"
RANKS = 2
# What a CPU rehearsal puts on the sbatch command line: it overrides the templates' #SBATCH GPU line.
SBATCH_CPU = ["--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={RANKS}", "--time=00:10:00"]
JOB_ENV = {"GPUS_PER_NODE": str(RANKS), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
ELASTIC_ARGS = "--dataset synthetic --train-size 2000 --test-size 200 --epochs 2 --batch-size 32 --snapshot-every 5"
TOTAL_STEPS = 64  # 2000 images / 2 ranks = 1000 per rank = 32 batches of 32 (the last one 8) per epoch
DS_ARGS = "--dataset synthetic --train-size 320 --test-size 200 --epochs 1 --dtype bf16"
DS_STEPS = 5  # 320 images / 2 ranks = 160 per rank = 5 micro batches of 32, 1 per optimizer step
JOB_TIMEOUT_S = 240  # generous: the first DeepSpeed job also compiles DeepSpeed's CPU comm op
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(bool(missing_binaries()), reason=f"SLURM/munge not installed ({', '.join(missing_binaries())}"
                                                        "); apt-get install slurm-wlm munge, as .ci/run does"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the one-node SLURM cluster's daemons must run as root"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < RANKS, reason=f"needs {RANKS} CPUs for {RANKS} ranks"),
]


@pytest.fixture(scope="session")
def cluster():
    """A private one-node cluster for the session; every daemon and job process stopped by PID at the end."""
    # Not under pytest's tmp_path: munged wants every folder above its socket open to all users, pytest's are 0700.
    root = Path(tempfile.mkdtemp(prefix="course-slurm-"))
    slurm = LocalSlurm(root)
    try:
        slurm.start()
        yield slurm
    finally:
        killed = slurm.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert not killed, f"job processes outlived their jobs (killed at teardown): {killed}"


@pytest.fixture(scope="module")
def work():
    root = Path(tempfile.mkdtemp(prefix="course-slurm-jobs-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# submitting and watching jobs


def submit(cluster, script: Path, work: Path, name: str, env: dict, sbatch_args=SBATCH_CPU) -> "Job":
    """sbatch ``script`` from the repository root (the submit dir the templates cd to), as a learner would."""
    run_dir = work / name
    run_dir.mkdir(exist_ok=True)
    full_env = cluster.env({**os.environ, **JOB_ENV, "HELPERS_RUN_DIR": str(run_dir), **env})
    proc = subprocess.run(["sbatch", "--parsable", f"--output={run_dir}/slurm-%j.out", *sbatch_args, str(script)],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return Job(cluster, int(proc.stdout.strip().split(";")[0]), run_dir)


class Job:
    def __init__(self, cluster, job_id: int, run_dir: Path):
        self.cluster, self.id, self.run_dir = cluster, job_id, run_dir

    def info(self) -> dict[str, str]:
        proc = subprocess.run(["scontrol", "show", "job", "-o", str(self.id)], capture_output=True, text=True,
                              env=self.cluster.env(), timeout=20)
        assert proc.returncode == 0, proc.stderr
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def wait(self, timeout: float = JOB_TIMEOUT_S, until=lambda info: info["JobState"] in FINISHED) -> dict:
        deadline = time.monotonic() + timeout
        while not until(info := self.info()):
            if time.monotonic() > deadline:  # cancel it, or it holds the node's CPUs and the next jobs queue up
                subprocess.run(["scancel", str(self.id)], env=self.cluster.env(), timeout=20)
                raise AssertionError(f"job {self.id} still {info['JobState']} after {timeout} s:\n{self.output()}")
            time.sleep(0.3)
        return info

    def output(self) -> str:
        f = self.run_dir / f"slurm-{self.id}.out"
        return f.read_text(errors="replace") if f.exists() else ""

    def metrics(self) -> list[dict]:
        return read_metrics(self.run_dir)

    def result(self) -> dict:
        return results(self.metrics())


def wait_for_snapshot(job: Job, snapshot_dir: Path, timeout: float = JOB_TIMEOUT_S) -> int:
    """Block until the job has written its first snapshot; return the newest step on disk."""
    job.wait(timeout, until=lambda info: list_snapshots(snapshot_dir) or info["JobState"] in FINISHED)
    assert list_snapshots(snapshot_dir), f"job {job.id} ended before its first snapshot:\n{job.output()}"
    return snapshot_step(list_snapshots(snapshot_dir)[-1])


def elastic_env(work: Path, name: str) -> dict:
    return {"TRAIN_ARGS": ELASTIC_ARGS, "SNAPSHOT_DIR": str(work / name / "snapshots"), "OUT_DIR": str(work / name)}


def final_weights(job: Job) -> dict[str, torch.Tensor]:
    return torch.load(job.run_dir / "final_model.pt", map_location="cpu", weights_only=True)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"tensors differ: {differ}"
    assert state_dict_sha256(a) == state_dict_sha256(b)


def newest_snapshot_before_resume(records: list[dict]) -> tuple[int, int]:
    """(step resumed from, newest snapshot rank 0 had finished writing before that resume), from the metrics."""
    resumed, = [r for r in records if r.get("kind") == "event" and r.get("name") == "resumed" and r["rank"] == 0]
    written = [r["step"] for r in records if r.get("kind") == "event" and r.get("name") == "snapshot"
               and r["t"] < resumed["t"]]
    return resumed["step"], max(written)


def assert_completed(job: Job, info: dict) -> None:
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.output()


# ---------------------------------------------------------------------------------------------
# slurm_torchrun.sbatch


@pytest.fixture(scope="module")
def baseline(cluster, work):
    job = submit(cluster, TORCHRUN_SBATCH, work, "baseline", elastic_env(work, "baseline"))
    return job, job.wait()


def test_torchrun_sbatch_trains_to_completion_and_saves_the_final_weights(cluster, baseline):
    job, info = baseline
    assert_completed(job, info)
    result = job.result()
    assert result["steps"] == TOTAL_STEPS and result["world_size"] == RANKS
    assert result["resumed_from"] is None and result["restart_count"] == 0
    assert state_dict_sha256(final_weights(job)) == result["final_params_sha256"]
    # what the template chose by itself on a one-node cluster: the loopback interface, a port from the job id
    assert f"rendezvous {cluster.node}:{20000 + job.id % 10000} over lo" in job.output()


def test_killed_worker_is_restarted_by_torchrun_and_ends_bitwise_equal_to_the_uninterrupted_run(cluster, work,
                                                                                             baseline):
    env = elastic_env(work, "killed")
    job = submit(cluster, TORCHRUN_SBATCH, work, "killed", env)
    snapshot_on_disk = wait_for_snapshot(job, Path(env["SNAPSHOT_DIR"]))
    worker, = [p for p in psutil.process_iter(["cmdline"]) if "course/elastic_cifar10.py" in (p.info["cmdline"] or [])
               and _environ(p).get("SLURM_JOB_ID") == str(job.id) and _environ(p).get("LOCAL_RANK") == "1"]
    worker.send_signal(signal.SIGKILL)
    info = job.wait()
    assert_completed(job, info)
    assert info["Restarts"] == "0"  # torchrun handled it inside the job; SLURM never restarted the job
    result = job.result()
    assert result["restart_count"] == 1 and result["steps"] == TOTAL_STEPS
    resumed_from, newest = newest_snapshot_before_resume(job.metrics())
    assert resumed_from == result["resumed_from"] == newest >= snapshot_on_disk
    killed_at = max(r["step"] for r in steps(job.metrics(), 1) if r["attempt"] == 0)
    assert resumed_from < TOTAL_STEPS and killed_at < TOTAL_STEPS  # the kill came mid-run
    assert_bitwise_equal(final_weights(job), final_weights(baseline[0]))


def test_requeued_job_comes_back_under_the_same_id_and_ends_bitwise_equal_to_the_uninterrupted_run(cluster, work,
                                                                                                 baseline):
    env = elastic_env(work, "requeued")
    job = submit(cluster, TORCHRUN_SBATCH, work, "requeued", env)
    snapshot_on_disk = wait_for_snapshot(job, Path(env["SNAPSHOT_DIR"]))
    proc = subprocess.run(["scontrol", "requeue", str(job.id)], capture_output=True, text=True, env=cluster.env(),
                          timeout=20)
    assert proc.returncode == 0, proc.stderr
    info = job.wait(until=lambda info: info["JobState"] in FINISHED and info["Restarts"] != "0")
    assert_completed(job, info)
    assert info["Restarts"] == "1" and info["JobId"] == str(job.id)
    log = job.output()  # --open-mode=append: both runs of the job in one log
    assert f"job {job.id} (requeued 0 times)" in log and f"job {job.id} (requeued 1 times)" in log
    result = job.result()
    assert result["restart_count"] == 0 and result["steps"] == TOTAL_STEPS  # a new torchrun, not a restart
    resumed_from, newest = newest_snapshot_before_resume(job.metrics())
    assert resumed_from == result["resumed_from"] == newest >= snapshot_on_disk
    assert resumed_from < TOTAL_STEPS
    assert_bitwise_equal(final_weights(job), final_weights(baseline[0]))


def _environ(proc: psutil.Process) -> dict:
    try:
        return proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


# ---------------------------------------------------------------------------------------------
# slurm_deepspeed.sbatch


def test_deepspeed_sbatch_trains_zero2_bf16_on_cpu_and_a_resubmission_resumes_from_its_checkpoint(cluster, work):
    ckpt = work / "ds_checkpoints"
    # A private build folder for DeepSpeed's JIT-compiled CPU comm op: the shared ~/.cache one is also used by
    # whatever else runs DeepSpeed on this machine, and a build there holds a lock every other loader waits on.
    env = {"DS_ACCELERATOR": "cpu", "TRAIN_ARGS": DS_ARGS, "CKPT_DIR": str(ckpt),
           "HOSTFILE": str(work / "ds_hostfile"), "TORCH_EXTENSIONS_DIR": str(work / "torch_extensions")}
    first = submit(cluster, DEEPSPEED_SBATCH, work, "ds_first", env)
    assert_completed(first, first.wait())
    assert (work / "ds_hostfile").read_text() == f"{cluster.node} slots={RANKS}\n"  # generated from the allocation
    result = first.result()
    assert (result["zero_stage"], result["dtype"], result["world_size"]) == (2, "bf16", RANKS)
    assert result["optimizer_steps"] == DS_STEPS
    assert (ckpt / "latest").read_text() == f"global_step{DS_STEPS}"
    shards = sorted(p.name for p in (ckpt / f"global_step{DS_STEPS}").glob("*optim_states.pt"))
    assert len(shards) == RANKS, shards  # ZeRO-2: each rank saved its own shard of the optimizer state

    second = submit(cluster, DEEPSPEED_SBATCH, work, "ds_second", env)  # a new job, the same CKPT_DIR
    assert_completed(second, second.wait())
    assert second.id != first.id and "(resuming)" in second.output()
    assert f"resumed from {ckpt}/global_step{DS_STEPS}/" in second.output()
    assert second.result()["optimizer_steps"] == 2 * DS_STEPS
    assert (ckpt / "latest").read_text() == f"global_step{2 * DS_STEPS}"


# ---------------------------------------------------------------------------------------------
# bad submissions fail fast, saying what to change


BAD = {
    "nonexistent_interface": ({"NCCL_SOCKET_IFNAME": "nosuch0", "GLOO_SOCKET_IFNAME": "nosuch0"},
                              ["no network interface 'nosuch0'", "Set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME",
                               "this node has: ", " lo "]),
    "more_ranks_than_cpus": ({"GPUS_PER_NODE": str(RANKS + 1)},
                             [f"GPUS_PER_NODE={RANKS + 1} ranks on CPUs but --cpus-per-task={RANKS}",
                              "lower GPUS_PER_NODE or raise --cpus-per-task"]),
}


@pytest.mark.parametrize("script", [TORCHRUN_SBATCH, DEEPSPEED_SBATCH], ids=lambda p: p.stem)
@pytest.mark.parametrize("mistake", BAD)
def test_bad_submission_fails_at_once_saying_what_to_change(cluster, work, script, mistake):
    env, message = BAD[mistake]
    job = submit(cluster, script, work, f"bad_{script.stem}_{mistake}",
                 {"TRAIN_ARGS": ELASTIC_ARGS if script == TORCHRUN_SBATCH else DS_ARGS, "DS_ACCELERATOR": "cpu",
                  "SNAPSHOT_DIR": str(work / "bad" / "snapshots"), "OUT_DIR": str(work / "bad"),
                  "CKPT_DIR": str(work / "bad" / "ckpt"), "HOSTFILE": str(work / "bad" / "hostfile"), **env})
    start = time.monotonic()
    info = job.wait(timeout=60)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), job.output()
    assert time.monotonic() - start < 30  # refused by the template, before any launcher starts
    for text in message:
        assert text in job.output(), job.output()
    assert not job.metrics()  # no rank ever started


# ---------------------------------------------------------------------------------------------
# slurm_3d.sbatch


def test_3d_sbatch_runs_the_dp_pp_tp_script_on_8_ranks_and_every_rank_reports_its_role(cluster, work):
    """Submitted once, as the template's CPU rehearsal says: the default 2 x 2 x 2 mesh on 8 ranks of one node."""
    job = submit(cluster, REPO / "course" / "slurm_3d.sbatch", work, "gpt3d",
                 {"GPUS_PER_NODE": "8", "TRAIN_ARGS": "--steps 3 --skip-steps 1"})
    assert_completed(job, job.wait())
    result = job.result()
    assert result["world_size"] == 8 and (result["dp_degree"], result["pp_degree"], result["tp_degree"]) == (2, 2, 2)
    assert f"rendezvous {cluster.node}:{20000 + job.id % 10000} over lo" in job.output()
    assert all(f"rank {r}: data shard" in job.output() for r in range(8))
