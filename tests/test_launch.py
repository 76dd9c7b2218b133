"""helpers.launch on the happy path: what a successful run gives back, what it streams, the environment
the ranks get, the DeepSpeed launcher, and the input checks that refuse a launch before anything starts.

Faults (crashes, hangs, timeouts, interrupts, restarts) are in test_launch_faults.py.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch  # imported up front so no refused launch below pays for importing it


import helpers.launch as launch
from helpers.rank import metrics
from helpers.rank.devices import cpu_count
from helpers.launch import LaunchError, Machine
from helpers.launch.environment import rank_env
from helpers.launch.spec import _launch_rules

STEPS = "tests/scripts/steps.py"
ENV_PROBE = "tests/scripts/env_probe.py"
DS_TINY = "tests/scripts/ds_tiny.py"
RANK_LINE = re.compile(r"^\[rank\d+\]", re.M)

DS_CONFIG = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 0},
}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def rank_pids(run_dir: Path) -> dict[int, int]:
    return {int(r): int(p) for p, r in re.findall(r"pid=(\d+) rank=(\d+)",
                                                  "\n".join(f.read_text() for f in run_dir.glob("rank*.log")))}


def assert_ranks_gone(run_dir: Path, ranks=(0, 1)) -> None:
    pids = rank_pids(run_dir)
    assert set(ranks) <= set(pids), f"rank PIDs missing from the logs: {pids}"
    alive = {r: p for r, p in pids.items() if _alive(p)}
    assert not alive, f"ranks still running after the launch returned: {alive}"


# ---------------------------------------------------------------------------------------------
# one successful run, shared by the tests that only read its outcome


@pytest.fixture(scope="module")
def ok_run(tmp_path_factory):
    """steps.py on 2 ranks, show="none"; also returns everything the launch printed."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HELPERS_RUNS_DIR", str(root))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run = launch.torchrun(STEPS, nproc=2, show="none", timeout=120, env={"STEPS": 5})
    return SimpleNamespace(run=run, printed=out.getvalue() + err.getvalue(), root=root)


@pytest.mark.smoke
@pytest.mark.slow
def test_successful_run_returns_zero_and_records_it(ok_run):
    run = ok_run.run
    assert run.returncode == 0
    assert run.nproc == 2
    assert run.backend == "gloo"
    assert run.duration_s > 0
    assert run.restarts == 0
    outcome = json.loads((run.run_dir / "result.json").read_text())
    assert outcome["status"] == "ok"
    assert outcome["returncode"] == 0
    assert outcome["result"] == run.result
    assert_ranks_gone(run.run_dir)


@pytest.mark.smoke
@pytest.mark.slow
def test_run_dir_goes_under_helpers_runs_dir(ok_run):
    run = ok_run.run
    assert run.run_dir.is_dir()
    assert run.run_dir.parent == ok_run.root / "steps"  # name defaults to the script's stem
    for name in ("env.json", "result.json", "metrics.jsonl", "rank0.log", "rank1.log", "launcher.log"):
        assert (run.run_dir / name).is_file(), name


@pytest.mark.smoke
@pytest.mark.slow
def test_metrics_hold_step_records_of_every_rank(ok_run):
    run = ok_run.run
    for rank in (0, 1):
        steps = metrics.steps(run.metrics, rank=rank)
        assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
        assert all(r["value"] == 3.0 for r in steps)  # all-reduce of 1 + 2
    assert any(r["kind"] == "total" and r["rank"] == 0 for r in run.metrics)


@pytest.mark.smoke
@pytest.mark.slow
def test_result_merges_the_ranks_result_records(ok_run):
    run = ok_run.run
    assert run.result == {"steps_done": 5, "world_size": 2}
    assert run.results_by_rank() == {0: {"steps_done": 5, "world_size": 2}, 1: {"steps_done": 5, "world_size": 2}}


@pytest.mark.smoke
@pytest.mark.slow
def test_log_returns_one_ranks_lines(ok_run):
    run = ok_run.run
    log1 = run.log(1)
    assert "rank 1 step 4 sum=3" in log1
    assert "rank 0 step" not in log1
    assert "rank 0 step 4 sum=3" in run.log(0)
    assert not RANK_LINE.search(log1)  # the prefix is stripped in the per-rank log
    assert isinstance(run.log("launcher"), str)


@pytest.mark.smoke
@pytest.mark.slow
def test_show_none_prints_nothing_rank_prefixed(ok_run):
    printed = ok_run.printed
    assert not RANK_LINE.search(printed), printed
    assert "rank 0 step" not in printed


@pytest.mark.smoke
@pytest.mark.slow
def test_env_json_records_gloo_and_cpu_accelerator(ok_run):
    run = ok_run.run
    recorded = json.loads((run.run_dir / "env.json").read_text())
    assert recorded["backend"] == "gloo"
    assert recorded["ds_accelerator"] == "cpu"
    assert recorded["nproc"] == 2
    assert recorded["omp_num_threads"] == str(max(1, cpu_count() // 2))
    assert recorded["port"] == run.port
    assert recorded["command"] == run.command


@pytest.mark.smoke
@pytest.mark.slow
def test_cuda_is_not_initialised_by_a_launch(ok_run):
    import helpers.launch  # noqa: F401  (importing the helpers must not touch CUDA either)
    assert ok_run.run.returncode == 0  # a real launch has happened in this process
    assert not torch.cuda.is_initialized()


# ---------------------------------------------------------------------------------------------
# streaming


@pytest.mark.slow
def test_show_all_streams_every_rank_with_its_prefix(runs_root, capsys):
    run = launch.torchrun(STEPS, nproc=2, show="all", timeout=120, env={"STEPS": 2})
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("[rank0] rank 0 step 1 sum=3") for line in lines), out
    assert any(line.startswith("[rank1] rank 1 step 1 sum=3") for line in lines), out
    # every rank line carries its own rank's prefix
    for line in lines:
        m = re.match(r"^\[rank(\d)\] rank (\d) step", line)
        if m:
            assert m.group(1) == m.group(2), line
    assert_ranks_gone(run.run_dir)


@pytest.mark.slow
def test_show_rank0_streams_only_rank_0(runs_root, capsys):
    run = launch.torchrun(STEPS, nproc=2, timeout=120, env={"STEPS": 2})  # show="rank0" is the default
    out = capsys.readouterr().out
    assert "[rank0] rank 0 step 1 sum=3" in out, out
    assert "[rank1]" not in out
    assert "rank 1 step 1 sum=3" in run.log(1)  # rank 1's lines still reach its log


# ---------------------------------------------------------------------------------------------
# the environment each rank gets


@pytest.mark.slow
def test_env_argument_reaches_the_ranks_and_name_picks_the_folder(runs_root):
    run = launch.torchrun(STEPS, nproc=2, show="none", timeout=120, env={"STEPS": 3}, name="custom")
    assert run.run_dir.parent == runs_root / "custom"
    assert run.result["steps_done"] == 3
    assert [r["step"] for r in metrics.steps(run.metrics, rank=1)] == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# DeepSpeed's own launcher


@pytest.mark.slow
def test_deepspeed_launcher_runs_two_cpu_ranks(runs_root):
    # The first run JIT-builds DeepSpeed's CPU comm op (~40-110 s cold, cached in ~/.cache/torch_extensions).
    run = launch.deepspeed(DS_TINY, nproc=2, config=DS_CONFIG, show="none", timeout=600)
    assert run.returncode == 0
    assert run.result["steps_done"] == 2
    assert run.result["world_size"] == 2
    assert run.result["ds_world_size"] == 2
    assert sorted(run.results_by_rank()) == [0, 1]
    for rank in (0, 1):
        assert [r["step"] for r in metrics.steps(run.metrics, rank=rank)] == [1, 2]
        assert f"rank {rank} step 1 loss=" in run.log(rank)
    written = json.loads((run.run_dir / "deepspeed_config.json").read_text())
    assert written == DS_CONFIG
    recorded = json.loads((run.run_dir / "env.json").read_text())
    assert recorded["kind"] == "deepspeed"
    assert recorded["ds_accelerator"] == "cpu"
    assert_ranks_gone(run.run_dir)


def test_deepspeed_runs_the_per_node_launcher_the_cli_would_start(tmp_path, monkeypatch):
    """launch.deepspeed skips the `deepspeed` runner's process: it must pass the per-node launcher exactly what the
    runner would (captured here from the runner itself, its process start replaced), and the launcher's wait loop
    must still be the one DS_LAUNCH_MAIN shortens (one `time.sleep(1)` on the module's `time`)."""
    import inspect
    import subprocess
    import sys

    import deepspeed.launcher.launch as per_node
    import deepspeed.launcher.runner as runner

    assert per_node.time is time and inspect.getsource(per_node.main).count("time.sleep(") == 1
    loop = subprocess.run([sys.executable, "-c", launch.DS_LAUNCH_MAIN.replace("L.main()", "print(L.time.sleep)")],
                          capture_output=True, text=True)
    assert "<lambda>" in loop.stdout, loop.stderr

    started, popen = [], subprocess.Popen

    def start(cmd, *args, **kwargs):  # the runner's other subprocesses (probes) run; the launcher is only recorded
        if "deepspeed.launcher.launch" not in cmd:
            return popen(cmd, *args, **kwargs)
        started.append(cmd)
        return SimpleNamespace(returncode=0, wait=lambda: 0)

    monkeypatch.setattr(runner.subprocess, "Popen", start)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    spec = launch.LaunchSpec.check("deepspeed", DS_TINY, 2, ["--steps", 2], config=DS_CONFIG)
    ours, log_dir = launch._deepspeed_command(spec, 29511, tmp_path)
    runner.main(["--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", "29511",
                 f"--enable_each_rank_log={log_dir}", *ours[ours.index(str(spec.script)):]])
    cli = started[0]
    assert cli[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]
    assert ours[:3] == [sys.executable, "-u", "-c"] and "deepspeed.launcher.launch" in ours[3]
    assert ours[4:] == cli[4:]



# ---------------------------------------------------------------------------------------------
# input checks: refused before anything starts


def _refused(runs_root: Path, within_s: float = 5.0, **kwargs) -> LaunchError:
    """The launch is refused with reason "invalid": no run dir, no process, no waiting."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    script = kwargs.pop("script", STEPS)
    with pytest.raises(LaunchError) as info:
        launch.torchrun(script, **kwargs)
    assert time.monotonic() - start < within_s
    assert info.value.reason == "invalid"
    assert not runs_root.exists(), "a run directory was created for a launch that was refused"
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before, "a process was started for a launch that was refused"
    return info.value


def test_missing_script_is_refused_before_anything_launches(runs_root):
    e = _refused(runs_root, within_s=1.0, script="tests/scripts/no_such_script.py", nproc=2)
    assert "script not found" in str(e)
    assert "no_such_script.py" in str(e)
    assert e.run_dir is None


def test_script_that_is_not_a_path_is_refused(runs_root):
    e = _refused(runs_root, script=42, nproc=2)
    assert "path" in str(e)


@pytest.mark.parametrize("args, hint", [
    ("--steps 5", "shlex.split"),
    ({"steps": 5}, "['--key', 'value', ...]"),
    (["--cfg", {"a": 1}], "string, number or path"),
    (["--flag", True], "string, number or path"),
    (["--x", None], "string, number or path"),
    (42, "list of strings"),
])
def test_bad_args_are_refused_with_a_hint(runs_root, args, hint):
    e = _refused(runs_root, nproc=2, args=args)
    assert hint in str(e), str(e)


def test_good_args_are_turned_into_strings():
    assert launch._check_args(["--lr", 0.1, "--steps", 5, Path("/tmp/x")]) == ["--lr", "0.1", "--steps", "5", "/tmp/x"]
    assert launch._check_args(("--a", "b")) == ["--a", "b"]


@pytest.mark.parametrize("nproc", [0, -1, "2", 2.5, True])
def test_bad_nproc_is_refused(runs_root, nproc):
    e = _refused(runs_root, nproc=nproc)
    assert "nproc" in str(e)
    assert repr(nproc) in str(e) or str(nproc) in str(e)


def test_more_ranks_than_gpus_is_refused_naming_the_gpu_count(runs_root):
    e = _refused(runs_root, nproc=2, machine=Machine(gpus=1, cpus=8))
    assert "1 GPU" in str(e)
    assert "nproc<=1" in str(e)


def test_far_more_cpu_ranks_than_cores_is_refused(runs_root):
    e = _refused(runs_root, nproc=17, machine=Machine(gpus=0, cpus=2))
    assert "2 cores" in str(e)


def test_the_launch_is_decided_for_the_machine_it_is_given():
    gpus = Machine(gpus=4, cpus=16)
    assert gpus.backend == "nccl" and gpus.default_nproc == 4 and Machine(gpus=0, cpus=2).backend == "gloo"
    assert launch.LaunchSpec.check("torchrun", STEPS, machine=gpus).nproc == 4  # one rank per GPU
    hidden = launch.LaunchSpec.check("torchrun", STEPS, env={"CUDA_VISIBLE_DEVICES": ""}, machine=gpus)
    assert (hidden.nproc, hidden.gpus) == (2, 0)  # GPUs hidden: CPU ranks, as on a CPU machine
    assert launch.LaunchSpec.check("torchrun", STEPS, machine=Machine(gpus=0, cpus=2)).nproc == 2
    assert launch.LaunchSpec.check("torchrun", STEPS).machine == Machine.detect()
    with pytest.raises(LaunchError, match="machine must be"):
        launch.LaunchSpec.check("torchrun", STEPS, machine={"gpus": 2})
    with pytest.raises(ValueError, match="cpus"):
        Machine(gpus=0, cpus=0)


def test_ranks_get_the_deepspeed_accelerator_of_their_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what the notebook kernel sets for its own DeepSpeed imports
    gpus = Machine(gpus=2, cpus=8)
    env, backend = rank_env(2, tmp_path, {}, gpus)
    assert (backend, env["DS_ACCELERATOR"], env["OMP_NUM_THREADS"]) == ("nccl", "cuda", "4")
    env, backend = rank_env(2, tmp_path, {"CUDA_VISIBLE_DEVICES": ""}, gpus)
    assert (backend, env["DS_ACCELERATOR"]) == ("gloo", "cpu")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert rank_env(2, tmp_path, {}, Machine(gpus=0, cpus=2))[0]["DS_ACCELERATOR"] == "cpu"
    assert rank_env(2, tmp_path, {"DS_ACCELERATOR": "xpu"}, gpus)[0]["DS_ACCELERATOR"] == "xpu"  # the caller's wins
    assert "HELPERS_BACKEND" not in env


def test_free_port_comes_from_below_the_machines_ephemeral_range():
    port = launch.free_port(machine=Machine(gpus=0, cpus=2, ephemeral_ports=(30000, 60999)))
    assert 18000 <= port < 30000


def test_bf16_on_a_gpu_older_than_ampere_is_refused_before_launch(runs_root):
    config = {**DS_CONFIG, "bf16": {"enabled": True}}
    old = Machine(gpus=2, cpus=8, capabilities=("7.0", "7.0"))
    with pytest.raises(LaunchError, match="compute capability 8.0") as info:
        launch.deepspeed(DS_TINY, nproc=2, config=config, machine=old)
    assert info.value.reason == "invalid" and not runs_root.exists()
    spec = launch.LaunchSpec.check("deepspeed", DS_TINY, 2, config=config,
                                   machine=Machine(gpus=2, cpus=8, capabilities=("8.0", "9.0")))
    assert spec.config == config


# ---------------------------------------------------------------------------------------------
# a script's own launch rules (LAUNCH_RULES), read from its source


def _script(tmp_path, text: str) -> Path:
    path = tmp_path / "ruled.py"
    path.write_text(text)
    return path


RULED = 'import sys\nLAUNCH_RULES = {"--group": "divides_world_size"}\nsys.exit("never run by these tests")\n'


def test_launch_rules_are_read_without_running_the_script(tmp_path):
    assert _launch_rules(_script(tmp_path, RULED)) == {"--group": "divides_world_size"}
    assert _launch_rules(_script(tmp_path, "x = 1\n")) == {}
    assert _launch_rules(_script(tmp_path, 'def f():\n    LAUNCH_RULES = {"--a": "nope"}\n')) == {}  # module level only
    assert _launch_rules(_script(tmp_path, 'LAUNCH_RULES: dict = {"--a": "divides_world_size"}\n')) == {
        "--a": "divides_world_size"}


@pytest.mark.parametrize("args, problem", [
    (["--group", "3"], "--group 3 does not divide the 4 ranks"),
    (["--group=8"], "use one of 1, 2, 4"),
    (["--group", "two"], "--group must be a whole number of ranks, got 'two'"),
])
def test_a_flag_breaking_its_rule_is_refused_before_launch(runs_root, tmp_path, args, problem):
    e = _refused(runs_root, script=_script(tmp_path, RULED), nproc=4, args=args, machine=Machine(gpus=0, cpus=2))
    assert problem in str(e), str(e)


def test_a_flag_keeping_its_rule_passes(tmp_path):
    script = _script(tmp_path, RULED)
    for args in ([], ["--group", "2"], ["--group=4"], ["--other", "3"]):
        assert launch.LaunchSpec.check("torchrun", script, 4, args, machine=Machine(gpus=0, cpus=2)).args == tuple(args)


@pytest.mark.parametrize("declaration, problem", [
    ("LAUNCH_RULES = dict(a=1)", "must be a literal dict"),
    ("LAUNCH_RULES = {'--group': divides_world_size}", "must be a literal dict"),
    ("LAUNCH_RULES = ['--group']", "must be a literal dict"),
    ("LAUNCH_RULES = {'group': 'divides_world_size'}", "must be a literal dict"),
    ("LAUNCH_RULES = {'--group': 'is_even'}", "the rule 'is_even', which is not one of helpers.calc.mesh.RULES"),
])
def test_a_bad_launch_rules_declaration_is_refused_naming_the_script(runs_root, tmp_path, declaration, problem):
    e = _refused(runs_root, script=_script(tmp_path, f"import os\n{declaration}\n"), nproc=2)
    assert problem in str(e) and "ruled.py line 2" in str(e), str(e)


def test_the_fsdp2_script_declares_its_shard_size_rule():
    """course/fsdp2_cifar10.py's mesh must hold the world exactly: it says so itself, the launcher only reads it."""
    assert _launch_rules(launch.PROJECT_ROOT / "course" / "fsdp2_cifar10.py") == {"--shard-size": "divides_world_size"}


@pytest.mark.parametrize("kwarg", ["timeout", "stall_timeout"])
@pytest.mark.parametrize("value", [
    0, -5, "10", True, [10], float("nan"), float("inf"),
])
def test_bad_timeouts_are_refused(runs_root, kwarg, value):
    e = _refused(runs_root, nproc=2, **{kwarg: value})
    assert kwarg in str(e)
    assert "positive number of seconds" in str(e)


def test_bad_show_is_refused(runs_root):
    e = _refused(runs_root, nproc=2, show="everything")
    assert "show must be one of" in str(e)


@pytest.mark.parametrize("value", [-1, True, 1.5, "1"])
def test_bad_max_restarts_is_refused(runs_root, value):
    e = _refused(runs_root, nproc=2, max_restarts=value)
    assert "max_restarts" in str(e)


def test_bad_env_is_refused(runs_root):
    e = _refused(runs_root, nproc=2, env=["STEPS=3"])
    assert "env must be a dict" in str(e)


def test_deepspeed_missing_config_file_is_refused(runs_root):
    with pytest.raises(LaunchError) as info:
        launch.deepspeed(DS_TINY, nproc=2, config="no/such/ds_config.json")
    assert info.value.reason == "invalid"
    assert "config not found" in str(info.value)
    assert not runs_root.exists()


def test_deepspeed_config_of_wrong_type_is_refused(runs_root):
    with pytest.raises(LaunchError) as info:
        launch.deepspeed(DS_TINY, nproc=2, config=["train_batch_size", 4])
    assert info.value.reason == "invalid"
    assert "dict or a path" in str(info.value)
