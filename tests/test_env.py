"""helpers.notebook.env (report, verdict, formulas), the CUDA probe it shares with the launcher, the kernel's
DeepSpeed accelerator, and the two communication scripts in course/."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.calc import comm
from helpers.notebook import env
from helpers import launch

ROOT = Path(__file__).resolve().parent.parent
cpu_only = pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="asserts CPU-machine facts")

# What `ds_report` printed on the 2-core CPU machine (deepspeed 0.19.8, DS_ACCELERATOR=cpu), colour codes
# included, behind the accelerator line that ds_report_summary prints first.
DS_REPORT_CPU = """accelerator ... cpu gloo
--------------------------------------------------
DeepSpeed C++/CUDA extension op report
--------------------------------------------------
NOTE: Ops not installed will be just-in-time (JIT) compiled at
      runtime if needed. Op compatibility means that your system
      meet the required dependencies to JIT install the op.
--------------------------------------------------
JIT compiled ops requires ninja
ninja .................. \x1b[92m[OKAY]\x1b[0m
--------------------------------------------------
op name ................ installed .. compatible
--------------------------------------------------
deepspeed_not_implemented  \x1b[93m[NO]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m
\x1b[93m [WARNING] \x1b[0m async_io requires the dev libaio .so object and headers but these were not found.
\x1b[93m [WARNING] \x1b[0m async_io: please install the libaio-dev package with apt
async_io ............... \x1b[93m[NO]\x1b[0m ....... \x1b[93m[NO]\x1b[0m
deepspeed_ccl_comm ..... \x1b[93m[NO]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m
deepspeed_shm_comm ..... \x1b[93m[NO]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m
cpu_adagrad ............ \x1b[93m[NO]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m
cpu_adam ............... \x1b[93m[NO]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m
cpu_lion ............... \x1b[93m[NO]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m
fused_adam ............. \x1b[93m[NO]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m
pin_memory ............. \x1b[93m[NO]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m
--------------------------------------------------
DeepSpeed general environment info:
torch install path ............... ['/work/main/.venv/lib/python3.11/site-packages/torch']
torch version .................... 2.14.1+cu130
deepspeed install path ........... ['/work/main/.venv/lib/python3.11/site-packages/deepspeed']
deepspeed info ................... 0.19.8, unknown, unknown
deepspeed wheel compiled w. ...... torch 0.0
shared memory (/dev/shm) size .... 23.54 GB
W1130 07:10:01.681000 4064 torch/utils/cpp_extension.py:183] No CUDA runtime is found, using CUDA_HOME='/usr/local'
"""


# --- formulas and profiles --------------------------------------------------------------------
def test_bus_bandwidth_follows_nccl_tests_definition():
    size, seconds = 256 * 2**20, 0.01
    for n in (1, 2, 4, 8):
        algbw, busbw = comm.bus_bandwidth(size, seconds, n)
        assert algbw == pytest.approx(size / seconds / 1e9)
        assert busbw == pytest.approx(algbw * 2 * (n - 1) / n)
    assert comm.bus_bandwidth(1e9, 1.0, 2) == pytest.approx((1.0, 1.0))   # n=2: busbw == algbw
    assert comm.bus_bandwidth(1e9, 1.0, 8) == pytest.approx((1.0, 1.75))  # n=8: 2*7/8


def test_bus_bandwidth_refuses_zero_time():
    with pytest.raises(ValueError):
        comm.bus_bandwidth(1024, 0.0, 2)


def test_profile_auto_follows_the_hardware(monkeypatch):
    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    monkeypatch.setattr(env, "gpu_count", lambda: 0)
    assert env.profile() == "smoke"
    monkeypatch.setattr(env, "gpu_count", lambda: 4)
    assert env.profile("auto") == "full"


def test_profile_env_var_overrides_auto_but_not_an_explicit_choice(monkeypatch):
    monkeypatch.setenv("COURSE_PROFILE", "full")
    monkeypatch.setattr(env, "gpu_count", lambda: 0)
    assert env.profile() == "full"
    assert env.profile("smoke") == "smoke"


def test_unknown_profile_is_refused_with_the_valid_choices(monkeypatch):
    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    with pytest.raises(ValueError, match="smoke"):
        env.profile("fast")
    monkeypatch.setenv("COURSE_PROFILE", "turbo")
    with pytest.raises(ValueError, match="COURSE_PROFILE"):
        env.profile()


# --- this machine (CPU) -----------------------------------------------------------------------
@cpu_only
def test_cpu_machine_sees_no_gpu_and_picks_gloo():
    assert env.gpu_count() == 0
    assert env.default_backend() == "gloo"
    assert env.default_nproc() == 2
    assert env.backends()["nccl_usable"] is False
    dev = env.devices()
    assert len(dev) == 1 and dev[0]["kind"] == "cpu" and dev[0]["cores"] == env.cpu_count()
    assert env.versions()["nccl"] is None


@cpu_only
def test_cuda_probe_without_gpus_starts_nothing_and_finds_no_capability():
    from helpers.launch import machine
    assert machine.cuda_probe() == {"device_count": 0, "devices": [], "cudnn": None, "nccl": None, "error": None}
    assert env.cuda_capabilities() == [] and launch.Machine.detect().cuda_capabilities() == []


@pytest.mark.slow
def test_the_cuda_probe_runs_as_a_module_of_the_launcher():
    proc = subprocess.run([sys.executable, "-m", "helpers.launch.machine", "--probe"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device_count"] == env.gpu_count() and len(out["devices"]) == out["device_count"]
    assert all(d["capability"] for d in out["devices"])


@pytest.mark.slow
def test_the_kernel_entry_point_sets_a_cpu_accelerator_for_its_own_deepspeed_imports():
    code = ("import os; assert 'DS_ACCELERATOR' not in os.environ; import helpers.launch; "
            "from helpers.rank import deepspeed_facts as ds; ds.validate_config({'train_batch_size': 4}, 2); "
            "ds.deepspeed_estimate(10**6, 2); a = os.environ.get('DS_ACCELERATOR'); import helpers.notebook; "
            "print(a, os.environ.get('DS_ACCELERATOR'))")
    clean = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=clean)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].split() == ["None", "cpu"]  # set by helpers.notebook, never by a calculation
    proc = subprocess.run([sys.executable, "-c", "import os, helpers.notebook; print(os.environ['DS_ACCELERATOR'])"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env={**clean, "DS_ACCELERATOR": "cuda"})
    assert proc.stdout.strip() == "cuda"  # one the user set is kept


def _cpu_report(**overrides):
    rep = {"torch_error": None, "versions": {"torch": "2.14.1", "torch_cuda": "13.0", "deepspeed": "0.19.8"},
           "gpu_count": 0, "devices": [{"kind": "cpu", "name": "Xeon"}], "backend": "gloo", "nproc": 2,
           "nvidia_smi": [], "probe_error": None, "cuda_visible_devices": None, "allreduce": None,
           "deepspeed": env.parse_ds_report(DS_REPORT_CPU) | {"ok": True, "error": None},
           "compile": {"ok": True, "compile_s": 7.0, "error": None}}
    return rep | overrides


def _rows(rows):
    return {r["check"]: r for r in rows}


def test_cpu_verdict_warns_about_missing_gpus_and_waits_for_the_allreduce():
    rows = _rows(env.verdict(_cpu_report()))
    assert rows["GPUs visible"]["status"] == "warn" and "--gpus all" in rows["GPUs visible"]["advice"]
    assert rows["multi-rank all-reduce"]["status"] == "warn"
    assert rows["ready for DDP"]["status"] == "warn"
    assert rows["backend"]["advice"] == "gloo"


def test_cpu_verdict_is_ready_once_the_allreduce_passed():
    ar = {"allreduce_ok": True, "all_ranks_ok": True, "world_size": 2, "backend": "gloo",
          "all_reduce": 3.0, "expected": 3.0}
    rows = _rows(env.verdict(_cpu_report(allreduce=ar)))
    assert rows["ready for DDP"]["advice"] == "yes"
    assert rows["ready for DeepSpeed"]["advice"] == "yes"


def test_verdict_blames_the_allreduce_when_a_rank_disagreed():
    records = [{"kind": "result", "rank": 0, "allreduce_ok": True, "world_size": 2},
               {"kind": "result", "rank": 1, "allreduce_ok": False, "world_size": 2}]
    rows = _rows(env.verdict(_cpu_report(allreduce=records)))
    assert rows["multi-rank all-reduce"]["status"] == "fail"
    assert rows["ready for DDP"]["advice"].startswith("no")


def test_verdict_explains_gpus_hidden_from_torch():
    smi = [{"index": 0, "name": "NVIDIA H100", "memory_total_gib": 80.0, "driver_version": "550.54"}]
    rows = _rows(env.verdict(_cpu_report(nvidia_smi=smi, cuda_visible_devices="")))
    assert rows["GPUs visible"]["status"] == "fail"
    assert "CUDA_VISIBLE_DEVICES" in rows["GPUs visible"]["advice"]


@cpu_only
def test_real_cpu_verdict_mentions_gpus_flag():
    rows = _rows(env.verdict(env.report(deepspeed=False, torch_compile=False)))
    assert rows["GPUs visible"]["status"] == "warn" and "--gpus all" in rows["GPUs visible"]["advice"]
    assert rows["backend"]["advice"] == "gloo"


# --- ds_report --------------------------------------------------------------------------------
def test_ds_report_parsing_strips_colours_and_reads_the_op_table():
    out = env.parse_ds_report(DS_REPORT_CPU)
    assert out["accelerator"] == "cpu" and out["comm_backend"] == "gloo"
    assert out["deepspeed_version"] == "0.19.8"
    assert out["ninja"] is True
    ops = {o["op"]: o for o in out["ops"]}
    assert len(ops) == 9
    assert ops["cpu_adam"] == {"op": "cpu_adam", "installed": False, "compatible": True}
    assert ops["async_io"]["compatible"] is False
    assert "deepspeed_not_implemented" in ops  # name longer than the dot column
    assert any("libaio" in w for w in out["warnings"])
    assert not any("\x1b" in str(v) for v in out["info"].values())


def test_ds_report_parsing_of_a_cuda_style_table():
    # Lines in the format env_report.py prints on CUDA (installed op, "torch cuda version" present).
    text = ("fused_adam ............. \x1b[92m[YES]\x1b[0m ...... \x1b[92m[OKAY]\x1b[0m\n"
            "torch cuda version ............... 12.1\n")
    out = env.parse_ds_report(text)
    assert out["ops"] == [{"op": "fused_adam", "installed": True, "compatible": True}]
    assert out["accelerator"] == "cuda"
