"""What this machine can do for distributed training, and a verdict a learner can act on.

The notebook kernel must never initialise CUDA (every rank is a subprocess: see the README), so
this module only *counts* GPUs in-process (``torch.cuda.device_count()`` asks NVML and leaves
CUDA uninitialised). Everything that needs a CUDA context -- device names, memory, cuDNN and
NCCL versions -- comes from the launcher's CUDA probe (:func:`helpers.launch.machine.cuda_probe`), a short
subprocess that prints JSON. ``ds_report`` and the ``torch.compile`` smoke test run in subprocesses too.

Example (``python -m helpers.notebook.env`` prints the report as JSON)::

    run = launch.torchrun("course/allreduce_check.py")
    env.verdict_table(env.verdict(env.report(allreduce=run.result)))   # in a notebook: the table, in its language
"""
from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from ..launch.machine import cuda_capabilities, cuda_probe  # noqa: F401  (cuda_capabilities: for callers here)
from ..rank.devices import cpu_count, default_backend, default_nproc, gpu_count  # noqa: F401
from .i18n import AUTO, Cell, Lines, _, join

PROFILES = ("auto", "smoke", "full")
PROFILE_ENV = "COURSE_PROFILE"
_GIB = 1024 ** 3


# --- counting, without touching CUDA: helpers.rank.devices, shared with the ranks ---------------


def profile(requested: str = "auto") -> str:
    """Resolve a notebook's profile: ``"smoke"`` (quick, CPU) or ``"full"`` (the real lesson, GPUs).

    An explicit ``"smoke"``/``"full"`` wins; ``"auto"`` takes ``$COURSE_PROFILE`` if set, else
    ``"full"`` when GPUs are visible and ``"smoke"`` otherwise.

    >>> profile("smoke")
    'smoke'
    """
    def check(value: str, source: str) -> str:
        value = str(value).strip().lower()
        if value not in PROFILES:
            raise ValueError(f"{source}={value!r} is not a profile; use one of {', '.join(PROFILES)}")
        return value

    resolved = check(requested, "profile")
    if resolved == "auto" and os.environ.get(PROFILE_ENV, "").strip():
        resolved = check(os.environ[PROFILE_ENV], PROFILE_ENV)
    if resolved == "auto":
        resolved = "full" if gpu_count() > 0 else "smoke"
    return resolved


# --- the driver's view -----------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def nvidia_smi() -> list[dict]:
    """GPUs as the driver sees them (ignores CUDA_VISIBLE_DEVICES); [] where nvidia-smi is absent."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index,name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [[p.strip() for p in line.split(",")] for line in out.strip().splitlines()]
    return [{"index": int(i), "name": name, "memory_total_gib": round(float(mib) / 1024, 2) if mib.isdigit() else None,
             "driver_version": driver} for i, name, mib, driver in (r for r in rows if len(r) == 4 and r[0].isdigit())]


# --- the report -----------------------------------------------------------------------------
def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """Versions that matter for a bug report; CUDA-side ones are None on a CPU-only machine."""
    import torch
    probe = cuda_probe()
    return {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cudnn": probe.get("cudnn"), "nccl": probe.get("nccl"), "deepspeed": _dist_version("deepspeed"),
            "torchvision": _dist_version("torchvision"), "platform": platform.platform()}


def _cpu_model() -> str:
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        m = None
    return m[1].strip() if m else (platform.processor() or platform.machine())


def devices() -> list[dict]:
    """One dict per GPU (index, name, memory_total_gib, ...); on CPU one dict describing the CPU."""
    gpus, smi = cuda_probe()["devices"], nvidia_smi()
    if gpus:
        return [{"kind": "cuda", **g, "driver_version": smi[0]["driver_version"] if smi else None} for g in gpus]
    if gpu_count() > 0 and smi:   # the probe failed but the driver answers
        return [{"kind": "cuda", **g} for g in smi]
    import psutil
    return [{"kind": "cpu", "index": 0, "name": _cpu_model(), "cores": cpu_count(),
             "memory_total_gib": round(psutil.virtual_memory().total / _GIB, 2)}]


def backends() -> dict:
    """Which process-group backends this torch build has, and whether NCCL is usable (needs GPUs)."""
    import torch.distributed as dist
    nccl = dist.is_available() and dist.is_nccl_available()
    return {"nccl": nccl, "gloo": dist.is_available() and dist.is_gloo_available(),
            "mpi": dist.is_available() and dist.is_mpi_available(), "nccl_usable": nccl and gpu_count() > 0}


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_OP_LINE = re.compile(r"^(\w+)\s+\.*\s*\[(YES|NO)\]\s*\.*\s*\[(OKAY|NO|FAIL)\]\s*$")
_INFO_LINE = re.compile(r"^([^.\[][^.]*?)\s\.{3,}\s(.*)$")
# ds_report does not print the accelerator it picked, so we ask for it first, in the same process.
_DS_CMD = ("from deepspeed.accelerator import get_accelerator as g; a = g(); "
           "print('accelerator ...', a.device_name(), a.communication_backend_name(), flush=True); "
           "from deepspeed.env_report import cli_main; cli_main()")


def parse_ds_report(text: str) -> dict:
    """Parse ``ds_report`` output (colour codes and all) into ops, accelerator, versions, warnings."""
    ops, info, warnings = [], {}, []
    for raw in _ANSI.sub("", text).splitlines():
        line = raw.strip()
        if m := _OP_LINE.match(line):
            ops.append({"op": m[1], "installed": m[2] == "YES", "compatible": m[3] == "OKAY"})
        elif "[WARNING]" in line:
            warnings.append(line.split("[WARNING]", 1)[1].strip())
        elif (m := _INFO_LINE.match(line)) and m[1] != "op name":
            info[m[1].strip()] = m[2].strip()
    accel = info.get("accelerator", "").split()
    ninja = info.get("ninja")
    return {"accelerator": accel[0] if accel else ("cuda" if "torch cuda version" in info else None),
            "comm_backend": accel[1] if len(accel) > 1 else None,
            "deepspeed_version": info.get("deepspeed info", "").split(",")[0] or None,
            "ninja": None if ninja is None else ninja == "[OKAY]", "ops": ops, "info": info, "warnings": warnings}


def ds_report_summary(timeout: float = 120) -> dict:
    """Run DeepSpeed's ``ds_report`` in a subprocess (DS_ACCELERATOR=cpu without GPUs) and parse it.

    Returns ``parse_ds_report``'s dict plus ``ok``, ``seconds``, ``error``.
    """
    env = dict(os.environ) if gpu_count() else {"DS_ACCELERATOR": "cpu", **os.environ}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _DS_CMD], capture_output=True, text=True, timeout=timeout, env=env)
        text, error = proc.stdout + proc.stderr, None if proc.returncode == 0 else proc.stderr[-1000:]
    except subprocess.TimeoutExpired:
        text, error = "", f"ds_report did not finish within {timeout:.0f} s"
    out = parse_ds_report(text)
    out.update(ok=error is None and bool(out["ops"]), seconds=round(time.perf_counter() - t0, 2), error=error)
    return out


_COMPILE_CODE = r"""
import json, time, torch
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
x = torch.randn(16, 32, device=device)
out = {"ok": False, "device": device, "compile_s": None, "error": None}
try:
    t0 = time.perf_counter()
    y = torch.compile(model)(x)
    out["compile_s"] = round(time.perf_counter() - t0, 2)
    out["ok"] = bool(torch.allclose(y, model(x), atol=1e-5, rtol=1e-4))
    out["error"] = None if out["ok"] else "compiled output differs from eager"
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {str(exc)[-800:]}"
print(json.dumps(out))
"""


def torch_compile_smoke(timeout: float = 180) -> dict:
    """Compile a tiny MLP with ``torch.compile`` in a subprocess and compare it with eager.

    Returns ``{"ok", "compile_s", "error", "device"}``. On CPU, inductor needs a C++ compiler (gcc).
    """
    try:
        proc = subprocess.run([sys.executable, "-c", _COMPILE_CODE], capture_output=True, text=True, timeout=timeout)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {"ok": False, "compile_s": None, "error": f"torch.compile took longer than {timeout:.0f} s"}
    except (json.JSONDecodeError, IndexError):
        return {"ok": False, "compile_s": None, "error": (proc.stderr or "no output")[-800:]}


def report(*, allreduce: dict | list | None = None, deepspeed: bool = True, torch_compile: bool = True) -> dict:
    """Everything above in one dict. ``allreduce`` is ``Run.result`` (or ``Run.metrics``) of
    ``course/allreduce_check.py``; ``deepspeed``/``torch_compile`` switch off the slower subprocess checks."""
    rep: dict = {"torch_error": None}
    try:
        rep.update(versions=versions(), gpu_count=gpu_count(), devices=devices(), backends=backends(),
                   backend=default_backend(), nproc=default_nproc(), profile=profile(), cpu_count=cpu_count(),
                   nvidia_smi=nvidia_smi(), probe_error=cuda_probe().get("error"),
                   cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ImportError as exc:
        rep["torch_error"] = f"{type(exc).__name__}: {exc}"
        return rep
    rep["allreduce"] = allreduce
    rep["deepspeed"] = ds_report_summary() if deepspeed else None
    rep["compile"] = torch_compile_smoke() if torch_compile else None
    return rep


# --- the verdict ----------------------------------------------------------------------------
def _allreduce_outcome(ar) -> tuple[str, str]:
    if not ar:
        return "warn", _("not run yet: launch course/allreduce_check.py with helpers.launch.torchrun")
    results = [r for r in ar if r.get("kind") == "result"] if isinstance(ar, list) else [ar]
    world = max((r.get("world_size", 0) for r in results), default=0)
    ok = bool(results) and all(r.get("allreduce_ok") and r.get("all_ranks_ok", True) for r in results)
    r0 = results[0] if results else {}
    if ok:
        return "ok", _("{world} ranks, backend {backend}: sum {got} == {expected}", world=world,
                       backend=r0.get("backend"), got=r0.get("all_reduce"), expected=r0.get("expected"))
    return "fail", _("all-reduce gave {got}, expected {expected}: check the rank logs; NCCL_DEBUG=INFO shows which "
                     "transport NCCL chose", got=r0.get("all_reduce"), expected=r0.get("expected"))


def verdict(report: dict) -> list[dict]:
    """Rows ``{"check", "status": ok|warn|fail, "advice"}``, ending with: ready for DDP, ready for
    DeepSpeed (advice "yes"/"no"/"not yet ...") and the backend. ``check`` and ``advice`` are messages
    (:func:`helpers.notebook.i18n._`): English strings that the Chinese edition shows in Chinese."""
    rows: list[dict] = []

    def row(check, status, advice):
        rows.append({"check": check, "status": status, "advice": advice})

    def ready(check, needs):
        st = "fail" if any(r["status"] == "fail" for r in needs) else "ok" if all(r["status"] == "ok" for r in needs) \
            else "warn"
        blockers = join(r["check"] for r in needs if r["status"] == st)
        row(check, st, {"ok": _("yes"), "warn": _("not yet: see {blockers}", blockers=blockers),
                        "fail": _("no: see {blockers}", blockers=blockers)}[st])

    if report.get("torch_error"):
        row(_("torch imports"), "fail",
            _("{error} -- run `make setup` (pip install -e .)", error=report["torch_error"]))
        ready(_("ready for DDP"), rows), ready(_("ready for DeepSpeed"), rows[:1])
        return rows
    v, n, smi, backend = report["versions"], report["gpu_count"], report.get("nvidia_smi") or [], report["backend"]
    build = _("CUDA build {cuda}", cuda=v["torch_cuda"]) if v["torch_cuda"] else _("CUDA build none: CPU-only wheel")
    row(_("torch imports"), "ok", _("torch {version} ({build})", version=v["torch"], build=build))
    gpus = _("GPUs visible")
    if n > 0:
        row(gpus, "ok", _("{n} x {name}", n=n, name=report["devices"][0]["name"]))
    elif smi:
        why = (_("this torch is a CPU-only build: install a CUDA wheel") if not v["torch_cuda"] else
               _("CUDA_VISIBLE_DEVICES={visible!r} hides them, or the driver is too old for CUDA {cuda}",
                 visible=report.get("cuda_visible_devices"), cuda=v["torch_cuda"]))
        row(gpus, "fail", _("nvidia-smi lists {count} GPU(s) but torch sees none: {why}", count=len(smi), why=why))
    else:
        row(gpus, "warn", _("no GPU -- the course runs on CPU with gloo; if you expected GPUs, the container was "
                            "probably started without `--gpus all` / check nvidia-smi and CUDA_VISIBLE_DEVICES"))
    if report.get("probe_error"):
        row(_("CUDA probe"), "fail", _("{error} -- check the driver with nvidia-smi", error=report["probe_error"]))
    chosen = _("backend chosen")
    if n > 0 and backend != "nccl":
        row(chosen, "warn", _("GPUs present but this torch has no NCCL: gloo works, slowly"))
    else:
        row(chosen, "ok", _("{backend} ({nproc} ranks, one per GPU)", backend=backend, nproc=report["nproc"]) if n
            else _("{backend} ({nproc} ranks, on CPU)", backend=backend, nproc=report["nproc"]))
    row(_("multi-rank all-reduce"), *_allreduce_outcome(report.get("allreduce")))
    # A missing GPU is a warning (the course runs on CPU), a failed check is not.
    ddp = [r for r in rows if r["status"] == "fail" or r["check"] == "multi-rank all-reduce"]

    ds, want = report.get("deepspeed"), ("cuda" if n else "cpu")
    if ds is None:
        row("DeepSpeed", "warn", _("not checked (report(deepspeed=False))"))
    elif not v.get("deepspeed") or not ds.get("ok"):
        row("DeepSpeed", "fail", _("ds_report failed: {error}",
                                   error=(ds.get("error") or "no op table").strip()[-300:]))
    elif ds.get("accelerator") != want:
        row("DeepSpeed", "warn", _("accelerator {got}, expected {want}: set DS_ACCELERATOR={want}",
                                   got=ds.get("accelerator"), want=want))
    else:
        row("DeepSpeed", "ok", _("deepspeed {version}, accelerator {accelerator}", version=v["deepspeed"],
                                 accelerator=ds["accelerator"]))
    ds_row = rows[-1]

    c = report.get("compile")
    if c is None:
        row("torch.compile", "warn", _("not checked (report(torch_compile=False))"))
    elif c.get("ok"):
        row("torch.compile", "ok", _("compiled a small MLP in {seconds} s, matches eager", seconds=c["compile_s"]))
    else:
        row("torch.compile", "warn",
            _("{error} -- optional for this course; on CPU it needs gcc", error=c.get("error")))
    ready(_("ready for DDP"), ddp)
    ready(_("ready for DeepSpeed"), ddp + [ds_row])
    row(_("backend"), "ok", backend)
    return rows


def verdict_table(rows: list[dict]) -> Lines:
    """The verdict as aligned lines, one row per line, in the kernel's language (``str()`` or display it; a saved
    output keeps each message's msgid and fields, so the Chinese edition shows it in Chinese)."""
    return Lines([[Cell(r["status"].upper(), 6), Cell(r["check"], AUTO), Cell("  "), Cell(r["advice"])]
                  for r in rows])


if __name__ == "__main__":
    print(json.dumps(report(), indent=2, default=str))
