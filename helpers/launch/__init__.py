"""Launch real multi-process runs from a notebook cell, safely.

Every rank is a process of the standard launcher (``torchrun`` or ``deepspeed``), started as a
subprocess in its own session. The notebook kernel never forks, never spawns ranks itself and
never initialises CUDA, so a crashed or hung run cannot poison the kernel.

Example::

    from helpers import launch
    run = launch.torchrun("train.py", nproc=2)
    run.result            # merged ``Reporter.result`` records of the ranks
    run.log(1)            # everything rank 1 printed

On failure a :class:`LaunchError` names the failing rank and shows its traceback. Timeouts,
stalls (no output and no metric for ``stall_timeout`` seconds), a crashed rank and a
KeyboardInterrupt (the notebook's stop button) all end in the same place: the whole process tree
is killed and nothing is left running.

The package: :mod:`~helpers.launch.machine` describes the machine (GPUs, cores, backend, ports), detected or given
as ``machine=``; :mod:`~helpers.launch.spec` checks a launch's arguments against it once, before anything starts;
:mod:`~helpers.launch.environment` makes the run directory, the ranks' environment and a free port;
:mod:`~helpers.launch.session` runs and watches the launcher's process tree; :mod:`~helpers.launch.processes` kills
it (the whole run, whatever is left of it), holds the stop button while it does, and ends a run whose kernel died;
:mod:`~helpers.launch.diagnose` says which rank failed and why; :mod:`~helpers.launch.nodes` plays the nodes of a
multi-node job on one machine; :mod:`~helpers.launch.plain` runs a script the way ``python script.py`` in a terminal
would, bounded and cleaned up; :mod:`~helpers.launch.together` runs independent launches side by side on a CPU.
"""
from __future__ import annotations

import base64
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..rank import metrics as _metrics
from ..rank.devices import cpu_count  # noqa: F401  (benchmarks/ split the cores by it)
from .diagnose import _SECONDARY, _attempts, _error_for
from .environment import _new_run_dir, free_port, rank_env, runs_root
from .machine import Machine
from .machine import ephemeral_port_range as _ephemeral_port_range  # noqa: F401  (tests compare ports with it)
from .plain import PlainRun, python
from . import together
from .session import _Session, kill_tree
from .spec import PROJECT_ROOT, LaunchError, LaunchSpec, _check_args  # _check_args, _SECONDARY: tests use them
from .together import side_by_side


@dataclass
class Run:
    """The outcome of one launch; everything is also on disk under ``run_dir``."""

    run_dir: Path
    returncode: int
    duration_s: float
    command: list[str]
    nproc: int
    backend: str
    port: int
    restarts: int = 0
    nnodes: int = 1
    _metrics: list[dict] | None = field(default=None, repr=False)

    @property
    def metrics(self) -> list[dict]:
        """All records the ranks wrote with :class:`helpers.rank.metrics.Reporter`."""
        if self._metrics is None:
            self._metrics = _metrics.read_metrics(self.run_dir)
        return self._metrics

    @property
    def result(self) -> dict:
        """The ranks' ``Reporter.result`` records merged (rank 0 wins on conflicts)."""
        return _metrics.results(self.metrics)

    def results_by_rank(self) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for r in self.metrics:
            if r.get("kind") == "result":
                out.setdefault(r["rank"], {}).update({k: v for k, v in r.items() if k not in ("kind", "t", "rank")})
        return dict(sorted(out.items()))

    def part(self, name: str) -> "Run":
        """The run a script made in the folder ``name`` of the run directory: the same launch, its metrics and
        traces read from there (a script that trains several times in one launch, one configuration after another
        with one start-up, writes each into a folder of its own)."""
        return replace(self, run_dir=self.run_dir / name, _metrics=None)

    def log(self, rank: int | str = 0) -> str:
        """Everything one rank printed (``rank="launcher"`` for the launcher's own output)."""
        path = self.run_dir / (f"rank{rank}.log" if rank != "launcher" else "launcher.log")
        return path.read_text() if path.exists() else ""


def torchrun(script, nproc=None, args=(), *, env=None, timeout=None, stall_timeout=None, name=None,
             show="rank0", max_restarts: int = 0, nnodes: int = 1, machine: Machine | None = None) -> Run:
    """Run ``script`` on ``nproc`` ranks with ``torchrun`` and wait for it.

    ``show``: "rank0" streams rank 0's lines, "all" every rank's (and the launcher's), "none" nothing.
    ``timeout``: seconds for the whole run. ``stall_timeout``: seconds without any rank printing or reporting a
    metric, counted from the first such sign of life (start-up is bounded by ``timeout`` only).
    ``max_restarts``: torchrun's elastic restarts (``--max-restarts``) after a rank fails.
    ``env``: extra variables for the ranks; ``{"CUDA_VISIBLE_DEVICES": ""}`` runs CPU ranks with gloo on a GPU machine.
    ``nnodes``: rehearse a multi-node job on this machine: that many torchrun agents ("nodes", see
    :mod:`helpers.launch.nodes`), each running ``nproc`` ranks, meet at a c10d rendezvous. CPU ranks only.
    ``machine``: the :class:`Machine` to decide defaults and checks for (None: this one, detected).

    Example::

        run = torchrun("train.py", nproc=2, args=["--epochs", "1"], stall_timeout=60)
    """
    spec = LaunchSpec.check("torchrun", script, nproc, args, env=env, timeout=timeout, stall_timeout=stall_timeout,
                            name=name, show=show, max_restarts=max_restarts, nnodes=nnodes, machine=machine)
    return _launch(spec, _torchrun_command)


def deepspeed(script, nproc=None, args=(), *, config=None, env=None, timeout=None, stall_timeout=None,
              name=None, show="rank0", machine: Machine | None = None) -> Run:
    """Run ``script`` with DeepSpeed's own launcher (``deepspeed --num_gpus N``).

    ``config`` is a path to a ds_config JSON file or a dict; either way the script receives
    ``--deepspeed_config <file>`` (a dict is written into the run directory first). ``machine``: as for
    :func:`torchrun`.

    Example::

        run = deepspeed("train_ds.py", nproc=2, config={"train_batch_size": 64, ...})
    """
    spec = LaunchSpec.check("deepspeed", script, nproc, args, env=env, timeout=timeout, stall_timeout=stall_timeout,
                            name=name, show=show, config=config, machine=machine)
    return _launch(spec, _deepspeed_command)


def _torchrun_command(spec: LaunchSpec, port: int, run_dir: Path) -> tuple[list[str], Path | None]:
    """The launcher's command line, and the folder where it writes rank logs of its own (none: torchrun tees)."""
    common = ["--nproc-per-node", str(spec.nproc), "--max-restarts", str(spec.max_restarts), "--monitor-interval",
              "0.1", "--tee", "3", "--log-line-prefix-template", "[rank${rank}]:", str(spec.script), *spec.args]
    if spec.nnodes > 1:
        return [sys.executable, "-m", "helpers.launch.nodes", "--nnodes", str(spec.nnodes), "--port", str(port),
                "--log-dir", str(run_dir / "elastic"), "--", *common], None
    # c10d rendezvous: each restart re-rendezvouses instead of reading the dead attempt's addresses
    # from a static store (torchelastic's static rendezvous keeps one TCPStore across restarts)
    return [sys.executable, "-c", TORCHRUN_MAIN, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--log-dir", str(run_dir / "elastic"), *common], None


# `python -m torch.distributed.run`, except that an agent whose run succeeded leaves with os._exit, as the ranks do
# (helpers.rank.runtime.end_rank): tearing the interpreter down after `import torch` cost the agent about 0.5 s per
# launch, a third of the launcher's overhead over bare torchrun (benchmarks/bench_launcher.py). By the time main()
# returns, torchrun has stopped its log tailing and reaped its workers; a failed run raises out of main() with its
# error file, traceback and exit code, unchanged.
TORCHRUN_MAIN = ("import logging, os, sys; from torch.distributed.run import main; main(); logging.shutdown(); "
                 "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)")


DS_CONFIG_FILE = "deepspeed_config.json"  # where a ds_config passed as a dict is written, in the run directory


def _deepspeed_command(spec: LaunchSpec, port: int, run_dir: Path) -> tuple[list[str], Path | None]:
    """The launcher's command line (a dict config is written into the run directory first), and the folder where
    it makes every rank write its own log.

    On one node, ``deepspeed --num_gpus N script`` (``deepspeed.launcher.runner``) only builds a command and starts
    it as a second process: DeepSpeed's per-node launcher, ``python -u -m deepspeed.launcher.launch`` with the
    node's slots base64-encoded in ``--world_info``. This runs that per-node launcher directly
    (:data:`DS_LAUNCH_MAIN`), with the arguments the runner would pass: one interpreter that imports torch and
    DeepSpeed fewer (benchmarks/bench_ds_startup.py measures what that saves). Terminal commands and the SLURM
    template still use the ``deepspeed`` command."""
    cfg_args = []
    if isinstance(spec.config, dict):
        cfg_file = run_dir / DS_CONFIG_FILE
        cfg_file.write_text(json.dumps(spec.config, indent=2))
        cfg_args = ["--deepspeed_config", str(cfg_file)]
    elif spec.config is not None:
        cfg_args = ["--deepspeed_config", str(spec.config.resolve())]
    log_dir = run_dir / "ds_logs"
    slots = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(spec.nproc))}).encode()).decode()
    cmd = [sys.executable, "-u", "-c", DS_LAUNCH_MAIN, f"--world_info={slots}", "--master_addr=127.0.0.1",
           f"--master_port={port}", f"--enable_each_rank_log={log_dir}", "--log_level=info", str(spec.script),
           *spec.args, *cfg_args]
    return cmd, log_dir


# `python -m deepspeed.launcher.launch`, except that it looks at its ranks every 0.1 s instead of every second (its
# loop's only sleep: a run's last second was spent waiting for the next look) and, like TORCHRUN_MAIN, a launcher
# whose ranks all succeeded leaves with os._exit. A failed rank makes main() kill the others and sys.exit with that
# rank's code, unchanged. tests/test_launch_plain.py pins the loop this relies on.
DS_LAUNCH_MAIN = ("import os, sys, time, types; import deepspeed.launcher.launch as L; "
                  "L.time = types.ModuleType('time'); vars(L.time).update(vars(time)); "
                  "L.time.sleep = lambda s: time.sleep(min(s, 0.1)); "
                  "sys.argv[0] = L.__file__; L.main(); sys.stdout.flush(); sys.stderr.flush(); os._exit(0)")


def _launch(spec: LaunchSpec, command_for) -> Run:
    """Start the run ``spec`` describes, follow it to its end and record the outcome in ``result.json``."""
    run_dir = _new_run_dir(spec.name)
    rank_env_, backend = rank_env(spec.nproc * spec.nnodes, run_dir, spec.env, spec.machine)
    port = free_port(machine=spec.machine)
    cmd, rank_log_dir = command_for(spec, port, run_dir)
    record = {"kind": spec.kind, "script": str(spec.script), "args": list(spec.args), "nproc": spec.nproc,
              "nnodes": spec.nnodes, "backend": backend,
              "port": port, "command": cmd, "omp_num_threads": rank_env_["OMP_NUM_THREADS"],
              "ds_accelerator": rank_env_.get("DS_ACCELERATOR"), "python": sys.executable,
              "gpus": spec.gpus, "cpus": spec.machine.cpus, "started": time.time()}
    (run_dir / "env.json").write_text(json.dumps(record, indent=2))

    session = _Session(cmd, rank_env_, run_dir, spec.nproc, spec.show, rank_log_dir)
    together.follow_here(session)  # side_by_side's threads: the stop button reaches the main thread only
    error = None
    try:
        session.follow(spec.script, spec.timeout, spec.stall_timeout)
    finally:
        together.forget(session)
        duration = session.elapsed()
        session.close()
        if session.status not in ("ok", "running"):
            error = _error_for(session.status, session, spec.script, spec.timeout, spec.stall_timeout)
        returncode = session.proc.returncode if session.proc.returncode is not None else -1
        restarts = max(0, _attempts(run_dir) - 1)
        outcome = {"status": session.status, "returncode": returncode, "duration_s": round(duration, 3),
                   "restarts": restarts, "result": _metrics.results(_metrics.read_metrics(run_dir))}
        if error is not None:
            outcome.update({"failed_rank": error.rank, "exitcode": error.exitcode, "error": str(error)})
        (run_dir / "result.json").write_text(json.dumps(outcome, indent=2, default=str))
        if spec.kind == "deepspeed":
            _remove_shm_buffers(port)
    if error is not None:
        raise error
    return Run(run_dir=run_dir, returncode=returncode, duration_s=duration, command=cmd, nproc=spec.nproc,
               backend=backend, port=port, restarts=restarts, nnodes=spec.nnodes)


def _remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU comm op maps one shared-memory buffer per rank (tens of MB of RAM in /dev/shm, named after the
    master port) and never unlinks it. The course's DeepSpeed scripts unlink their own
    (:func:`helpers.rank.runtime.forget_deepspeed_shm_buffer`); this removes what a run that died earlier, or another
    script, left, once every rank is gone."""
    for path in Path("/dev/shm").glob(f"deepspeed_*_{port}_*"):
        try:
            path.unlink()
        except OSError:
            pass
