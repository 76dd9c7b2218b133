"""The cluster templates in course/: SLURM batch scripts for torchrun and DeepSpeed, and a DeepSpeed hostfile.

No cluster here, so the templates are checked three ways: the shell parses them (``bash -n``); every
launcher flag they use exists in the installed launcher's ``--help``; and a dry run executes each batch
script with stand-ins for ``scontrol``/``srun``/``torchrun``/``deepspeed`` that record the command line,
which the real launchers' own argument parsers must then accept.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COURSE = REPO / "course"
TORCHRUN_SBATCH = COURSE / "slurm_torchrun.sbatch"
DEEPSPEED_SBATCH = COURSE / "slurm_deepspeed.sbatch"
HOSTFILE = COURSE / "hostfile"
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)$")
SLURM_ENV = {"SLURM_JOB_NODELIST": "node[001-002]", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
             "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_PER_TASK": "16", "SLURM_GPUS_ON_NODE": "4"}
NODES = ["node001", "node002"]
MASTER_PORT = 20000 + 4242 % 10000  # derived from the job id, the same on every node


# ---------------------------------------------------------------------------------------------
# reading the templates


def command_text(path: Path) -> str:
    """The script without comment lines, continuation lines joined (what the shell will run)."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    return re.sub(r"\\\n\s*", " ", "\n".join(lines))


def launcher_flags(path: Path, launcher: str) -> set[str]:
    """``--flags`` given to ``launcher`` in the script: from the launcher's name up to the training script."""
    flags = set()
    for m in re.finditer(rf"(?:^|[\s'\"]){launcher}\s(.*)", command_text(path), re.M):
        args = re.split(r"\S+\.py\b", m.group(1))[0]  # stop at the training script
        flags |= {f.split("=")[0] for f in re.findall(r"(?<![\w-])--[A-Za-z][\w-]*(?:=\S*)?", args)}
    return flags


@lru_cache(maxsize=None)
def help_text(launcher: str) -> str:
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--help"]
    else:
        deepspeed_bin = Path(sys.executable).parent / "deepspeed"
        cmd = [str(deepspeed_bin), "--help"] if deepspeed_bin.exists() else \
            [sys.executable, "-c", "from deepspeed.launcher.runner import main; main()", "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def help_flags(launcher: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", help_text(launcher)))


# ---------------------------------------------------------------------------------------------
# static checks


@pytest.mark.parametrize("path", [TORCHRUN_SBATCH, DEEPSPEED_SBATCH], ids=lambda p: p.name)
def test_batch_script_is_valid_bash(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", [TORCHRUN_SBATCH, DEEPSPEED_SBATCH], ids=lambda p: p.name)
def test_batch_script_asks_for_one_launcher_task_per_node_and_finds_the_master_node(path):
    text = path.read_text()
    assert text.startswith("#!/bin/bash\n")
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert directives["ntasks-per-node"] == "1"  # one launcher per node; it starts the per-GPU ranks
    assert {"nodes", "gpus-per-node", "time"} <= directives.keys()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
    for variable in ("MASTER_ADDR", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        assert variable in command_text(path)
    assert "shared" in text.lower()  # says where checkpoints must live
    # `cmd | head -n1` under pipefail fails whenever head closes the pipe before cmd is done writing
    assert not re.search(r"^set -\w*o pipefail", text, re.M) or "| head" not in command_text(path)


@pytest.mark.slow
def test_every_torchrun_flag_in_the_sbatch_exists_in_torchrun_help():
    used = launcher_flags(TORCHRUN_SBATCH, "torchrun")
    assert {"--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--max-restarts"} <= used
    assert not used - help_flags("torchrun"), f"not in torchrun --help: {used - help_flags('torchrun')}"


@pytest.mark.slow
def test_every_deepspeed_flag_in_the_sbatch_exists_in_deepspeed_help():
    used = launcher_flags(DEEPSPEED_SBATCH, "deepspeed")
    assert {"--hostfile", "--no_ssh", "--node_rank", "--master_addr", "--master_port"} <= used
    assert not used - help_flags("deepspeed"), f"not in deepspeed --help: {used - help_flags('deepspeed')}"


def test_flag_extraction_catches_a_misspelled_flag(tmp_path):
    bad = tmp_path / "bad.sbatch"
    bad.write_text("#!/bin/bash\n# torchrun --in-a-comment\n"
                   "srun torchrun --nnodes 2 \\\n  --max-restart 3 train.py --lr 1\n")
    assert launcher_flags(bad, "torchrun") == {"--nnodes", "--max-restart"}  # not the comment, not the script's
    assert "--max-restart" not in help_flags("torchrun")


def test_hostfile_lines_are_host_and_slots():
    entries = [ln.strip() for ln in HOSTFILE.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert entries, "the hostfile lists no host"
    parsed = [HOSTFILE_LINE.match(e) for e in entries]
    assert all(parsed), [e for e, m in zip(entries, parsed) if not m]
    hosts = [m.group(1) for m in parsed]
    assert len(hosts) == len(set(hosts)) and all(int(m.group(2)) >= 1 for m in parsed)


def test_deepspeed_reads_the_hostfile_as_written():
    from deepspeed.launcher.runner import fetch_hostfile

    pool = fetch_hostfile(str(HOSTFILE))
    assert pool == {"worker-0": 4, "worker-1": 4}


# ---------------------------------------------------------------------------------------------
# dry runs: the batch scripts executed with stand-in commands


STUBS = {
    # scontrol show hostnames <list>  -> the two nodes of SLURM_JOB_NODELIST
    "scontrol": 'if [ "$1 $2" = "show hostnames" ]; then printf "%s\\n" ' + " ".join(NODES) + '; else exit 2; fi\n',
    # srun [options] command...  -> run the command once, as the first node would (SLURM_NODEID=0)
    "srun": 'echo "$@" > "$STUB_LOG/srun.args"\nwhile [ "${1#-}" != "$1" ]; do shift; done\n'
            'SLURM_NODEID=0 SLURM_PROCID=0 exec "$@"\n',
    # the first node's address, and the interface that holds it
    "getent": '[ "$1 $2" = "ahostsv4 node001" ] && echo "10.1.0.1        STREAM node001"\n',
    "ip": 'case "$*" in\n  "-o -4 addr show to 10.1.0.1") echo "4: ibp65s0    inet 10.1.0.1/16 scope global ibp65s0" ;;\n'
          '  "-o link show dev ibp65s0" | "-o link show dev ib1") echo "$5: <BROADCAST,UP>" ;;\n  *) exit 1 ;;\nesac\n',
    "torchrun": 'printf "%s\\0" "$@" > "$STUB_LOG/torchrun.args"\n'
                'echo "$NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME" > "$STUB_LOG/ifname"\n',
    "deepspeed": 'printf "%s\\0" "$@" > "$STUB_LOG/deepspeed.args"\n'
                 'echo "$NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME" > "$STUB_LOG/ifname"\n',
}


def dry_run(script: Path, tmp_path: Path, env: dict | None = None) -> tuple[list[str], Path]:
    """Execute the batch script with stubs on PATH; return the launcher's argv and the submit dir."""
    bin_dir, log_dir, submit_dir = tmp_path / "bin", tmp_path / "log", tmp_path / "submit"
    for d in (bin_dir, log_dir, submit_dir):
        d.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        stub = bin_dir / name
        stub.write_text("#!/bin/bash\n" + body)
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB_LOG": str(log_dir),
           "SLURM_SUBMIT_DIR": str(submit_dir), **SLURM_ENV, **(env or {})}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launcher = "torchrun" if "torchrun" in script.name else "deepspeed"
    argv = (log_dir / f"{launcher}.args").read_text().split("\0")[:-1]
    return argv, submit_dir


def _options_source(script: str) -> str:
    """Where a course script's options are defined: the script, and the rank-side harness whose shared flags
    (--epochs, --batch-size, ...) it adds to its parser."""
    harness = REPO / "helpers" / "rank" / "harness.py"
    return (REPO / script).read_text() + (harness.read_text() if harness.is_file() else "")


def test_torchrun_sbatch_dry_run_gives_torchrun_a_command_line_it_accepts(tmp_path):
    from torch.distributed.run import get_args_parser

    argv, submit_dir = dry_run(TORCHRUN_SBATCH, tmp_path)
    args = get_args_parser().parse_args(argv)
    assert args.nnodes == "2" and args.nproc_per_node == "4"
    assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == f"node001:{MASTER_PORT}" and args.rdzv_id == "4242"
    assert args.max_restarts == 3
    assert args.training_script == "course/elastic_cifar10.py" and (REPO / args.training_script).is_file()
    # the script's own options exist in the script, and the snapshot folder was prepared
    script_args = args.training_script_args
    script_source = _options_source(args.training_script)
    for flag in (a for a in script_args if a.startswith("--")):
        assert f'"{flag}"' in script_source, flag
    snapshot_dir = Path(script_args[script_args.index("--snapshot-dir") + 1])
    assert snapshot_dir.is_dir() and "4242" in str(snapshot_dir) and submit_dir in snapshot_dir.parents


def test_deepspeed_sbatch_dry_run_gives_deepspeed_a_command_line_it_accepts(tmp_path):
    from deepspeed.launcher.runner import fetch_hostfile, parse_args

    argv, _ = dry_run(DEEPSPEED_SBATCH, tmp_path)
    args = parse_args(argv)
    assert args.no_ssh and args.node_rank == 0  # srun's SLURM_NODEID on the first node
    assert args.master_addr == "node001" and args.master_port == MASTER_PORT
    assert args.user_script == "course/ds_cifar10.py" and (REPO / args.user_script).is_file()
    script_source = _options_source(args.user_script)
    for flag in (a for a in args.user_args if a.startswith("--")):
        assert f'"{flag}"' in script_source, flag
    # the hostfile the script generated from the allocation is what DeepSpeed expects
    assert fetch_hostfile(args.hostfile) == {"node001": 4, "node002": 4}
    assert all(HOSTFILE_LINE.match(ln) for ln in Path(args.hostfile).read_text().splitlines())
    # a first run saves checkpoints; once one exists (a requeued job), it also resumes from it
    save_dir = args.user_args[args.user_args.index("--save-dir") + 1]
    assert "--load-dir" not in args.user_args
    Path(save_dir).mkdir(parents=True)
    (Path(save_dir) / "latest").write_text("global_step100")
    argv, _ = dry_run(DEEPSPEED_SBATCH, tmp_path)
    user_args = parse_args(argv).user_args
    assert user_args[user_args.index("--load-dir") + 1] == save_dir


def test_srun_starts_the_launchers_with_kill_on_bad_exit(tmp_path):
    dry_run(TORCHRUN_SBATCH, tmp_path)
    srun_args = shlex.split((tmp_path / "log" / "srun.args").read_text())
    assert srun_args[0] == "--kill-on-bad-exit=1" and srun_args[1] == "torchrun"


@pytest.mark.parametrize("script", [TORCHRUN_SBATCH, DEEPSPEED_SBATCH], ids=lambda p: p.name)
def test_network_interface_is_the_one_holding_the_master_address_unless_named(script, tmp_path):
    dry_run(script, tmp_path)
    assert (tmp_path / "log" / "ifname").read_text().split() == ["ibp65s0", "ibp65s0"]  # not a hard-coded ib0
    dry_run(script, tmp_path, {"NCCL_SOCKET_IFNAME": "^docker0,lo", "GLOO_SOCKET_IFNAME": "ib1"})
    assert (tmp_path / "log" / "ifname").read_text().split() == ["^docker0,lo", "ib1"]


@pytest.mark.parametrize("script", [TORCHRUN_SBATCH, DEEPSPEED_SBATCH], ids=lambda p: p.name)
def test_training_arguments_come_from_train_args_with_ten_epochs_by_default(script, tmp_path):
    launcher = "torchrun" if "torchrun" in script.name else "deepspeed"
    argv, _ = dry_run(script, tmp_path)
    assert argv[argv.index("--epochs") + 1] == "10"
    argv, _ = dry_run(script, tmp_path, {"TRAIN_ARGS": "--epochs 1 --train-size 64"})
    assert argv[argv.index("--epochs") + 1] == "1" and argv[argv.index("--train-size") + 1] == "64", launcher


def test_header_shows_the_cpu_rehearsal_command_with_the_gpu_line_overridden():
    for script in (TORCHRUN_SBATCH, DEEPSPEED_SBATCH):
        header = script.read_text().split("\n#SBATCH")[0]
        assert f"--gpus-per-node=0 --cpus-per-task=2 course/{script.name}" in header
        assert "TRAIN_ARGS=" in header and "tests/slurm_cluster.py" in header
    assert "DS_ACCELERATOR=cpu" in DEEPSPEED_SBATCH.read_text().split("\n#SBATCH")[0]
