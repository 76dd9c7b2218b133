"""What to launch, checked once before anything starts: :class:`LaunchSpec` and the :class:`LaunchError` it raises.

A refused launch leaves nothing behind: no run directory, no process, no waiting. Every check happens in
:meth:`LaunchSpec.check`, against an explicit :class:`~helpers.launch.machine.Machine`; the rest of the launcher
reads the spec and never checks again.

The launcher knows no course script by name. A script that wants its own flags checked before launch declares
the rules at module level, as a literal dict the launcher reads without importing or running the script::

    LAUNCH_RULES = {"--shard-size": "divides_world_size"}

Rule names are the keys of :data:`helpers.calc.mesh.RULES`.
"""
from __future__ import annotations

import ast
import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from ..calc import mesh
from .machine import Machine

PROJECT_ROOT = Path(__file__).resolve().parents[2]
_SHOW_CHOICES = ("rank0", "all", "none")


class LaunchError(Exception):
    """A launched run failed, timed out, stalled or could not start.

    Attributes: ``rank`` (the failing rank, or None when the whole run was stopped),
    ``exitcode`` (that rank's exit code, or None), ``run_dir`` (where its logs are),
    ``reason`` ("failed", "timeout", "stalled", "invalid").
    """

    def __init__(self, message: str, *, rank: int | None = None, exitcode: int | None = None,
                 run_dir: Path | None = None, reason: str = "failed"):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.run_dir = run_dir
        self.reason = reason


@dataclass(frozen=True)
class LaunchSpec:
    """One launch, every argument checked: build it with :meth:`check`, which refuses bad input."""

    kind: str                      # "torchrun" or "deepspeed"
    script: Path                   # resolved, an existing file
    nproc: int                     # ranks per node
    nnodes: int
    args: tuple[str, ...]
    env: Mapping[str, str]         # the caller's extra variables for the ranks
    gpus: int                      # GPUs the ranks will see
    timeout: float | None
    stall_timeout: float | None
    show: str
    name: str                      # the run directory's parent under runs_root()
    machine: Machine               # what the checks and defaults were decided for
    max_restarts: int = 0
    config: Path | dict | None = None  # deepspeed: an existing JSON file or a dict

    @classmethod
    def check(cls, kind: str, script, nproc=None, args=(), *, env=None, timeout=None, stall_timeout=None,
              name=None, show="rank0", max_restarts=0, nnodes=1, config=None,
              machine: Machine | None = None) -> LaunchSpec:
        """The launch these arguments ask for on ``machine`` (None: this one, :meth:`Machine.detect`), or a
        :class:`LaunchError` with ``reason="invalid"`` naming the first problem found and what to change."""
        if machine is None:
            machine = Machine.detect()
        elif not isinstance(machine, Machine):
            raise LaunchError(f"machine must be a helpers.launch.Machine or None, got {type(machine).__name__}",
                              reason="invalid")
        config = _check_config(config)
        _check_whole("max_restarts", max_restarts, 0)
        arg_list = _check_args(args)
        if kind == "torchrun":
            _check_script_flags(arg_list)
        _check_whole("nnodes", nnodes, 1)
        extra_env = _check_env(env)
        gpus = _visible_gpus(extra_env, machine)
        if nnodes > 1 and gpus:
            raise LaunchError("nnodes>1 rehearses several nodes on ONE machine, where the 'nodes' would share GPUs; "
                              "pass env={'CUDA_VISIBLE_DEVICES': ''} for CPU ranks, or run one torchrun per real "
                              "node (the SLURM templates in course/ do)", reason="invalid")
        script_path = _resolve_script(script)
        nproc = _check_nproc(nproc, gpus, machine)
        if nnodes > 1 and nproc * nnodes > 8 * machine.cpus:
            raise LaunchError(f"{nnodes} nodes x {nproc} ranks on {machine.cpus} cores would thrash",
                              reason="invalid")
        if config is not None:
            _check_config_fits(config, nproc * nnodes, gpus, machine)
        _check_script_rules(script_path, arg_list, nproc * nnodes)
        _check_timeouts(timeout, stall_timeout)
        if show not in _SHOW_CHOICES:
            raise LaunchError(f"show must be one of {_SHOW_CHOICES}, got {show!r}", reason="invalid")
        return cls(kind=kind, script=script_path, nproc=nproc, nnodes=nnodes, args=tuple(arg_list),
                   env=MappingProxyType(extra_env), gpus=gpus, timeout=timeout, stall_timeout=stall_timeout,
                   show=show, name=name or script_path.stem, machine=machine, max_restarts=max_restarts,
                   config=config)


def _check_whole(label: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LaunchError(f"{label} must be a whole number >= {minimum}, got {value!r}", reason="invalid")


def _resolve_script(script) -> Path:
    if not isinstance(script, (str, os.PathLike)):
        raise LaunchError(f"script must be a path, got {type(script).__name__}", reason="invalid")
    path = Path(script)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, PROJECT_ROOT / path]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise LaunchError(f"script not found: {script} (looked at {tried}). Paths are relative to the "
                      f"current directory or the course root {PROJECT_ROOT}.", reason="invalid")


def _visible_gpus(extra_env: Mapping[str, str], machine: Machine) -> int:
    """GPUs the ranks will see: none when the caller hides them with ``env={"CUDA_VISIBLE_DEVICES": ""}``."""
    return 0 if extra_env.get("CUDA_VISIBLE_DEVICES", None) == "" else machine.gpus


def _check_nproc(nproc, gpus: int, machine: Machine) -> int:
    if nproc is None:  # GPUs hidden: CPU ranks, as on a CPU machine
        return machine.default_nproc if gpus == machine.gpus else 2
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise LaunchError(f"nproc must be a whole number of processes, got {nproc!r} "
                          f"({type(nproc).__name__})", reason="invalid")
    if nproc < 1:
        raise LaunchError(f"nproc must be at least 1, got {nproc}", reason="invalid")
    if gpus and nproc > gpus:
        raise LaunchError(f"nproc={nproc} but this machine has {gpus} GPU(s): one rank per GPU. "
                          f"Use nproc<={gpus}, or hide the GPUs (CUDA_VISIBLE_DEVICES='') to run "
                          f"{nproc} CPU ranks with gloo.", reason="invalid")
    cpus = machine.cpus
    if not gpus and nproc > 8 * cpus:
        raise LaunchError(f"nproc={nproc} CPU ranks on {cpus} cores would thrash; "
                          f"use at most {8 * cpus}.", reason="invalid")
    return nproc


def _check_args(args) -> list[str]:
    if isinstance(args, (str, bytes)):
        raise LaunchError(f"args must be a list such as ['--epochs', '1'], not one string {args!r} "
                          f"(use shlex.split if you have a command line)", reason="invalid")
    if isinstance(args, Mapping):
        raise LaunchError("args must be a list of strings; turn a dict into ['--key', 'value', ...]",
                          reason="invalid")
    try:
        items = list(args)
    except TypeError:
        raise LaunchError(f"args must be a list of strings, got {type(args).__name__}", reason="invalid") from None
    out = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, (str, int, float, os.PathLike)):
            raise LaunchError(f"each argument must be a string, number or path; got {a!r} "
                              f"({type(a).__name__})", reason="invalid")
        out.append(os.fspath(a) if isinstance(a, os.PathLike) else str(a))
    return out


def _check_script_flags(arg_list: list[str]) -> None:
    """torchrun's parser accepts abbreviations of its own options even after the script name, so a script flag
    such as ``--n`` or ``--nproc`` is taken as an ambiguous torchrun option and the launch dies. Refuse it here."""
    from torch.distributed.run import get_args_parser

    options = {o for action in get_args_parser()._actions for o in action.option_strings if o.startswith("--")}
    for a in arg_list:
        flag = a.split("=", 1)[0]
        if flag.startswith("--") and flag not in options and any(o.startswith(flag) for o in options):
            clash = sorted(o for o in options if o.startswith(flag))[:3]
            raise LaunchError(f"script flag {flag} is the start of torchrun's own option(s) {', '.join(clash)}; "
                              f"torchrun would take it as an abbreviation and fail. Rename the flag in the script "
                              f"(e.g. --num-samples instead of --n).", reason="invalid")


def _module_literal(script_path: Path, name: str):
    """The node assigned to ``name`` at the script's module level (the last assignment wins, as it would when the
    script runs), or None; None too when the script does not parse (the ranks will report that themselves)."""
    try:
        tree = ast.parse(script_path.read_text(), filename=str(script_path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    node = None
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets = [stmt.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            node = stmt.value
    return node


def _flag_dict(script_path: Path, name: str, example: str, what: str) -> tuple[dict[str, str], int]:
    """The script's literal dict ``name`` of flag -> string, and its line; ({}, 0) when it declares none."""
    node = _module_literal(script_path, name)
    if node is None:
        return {}, 0
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value = None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.startswith("-") and isinstance(v, str)
                                              for k, v in value.items()):
        raise LaunchError(f"{script_path.name} line {node.lineno}: {name} must be a literal dict of flag -> "
                          f"{what}, such as {example}", reason="invalid")
    return value, node.lineno


def _launch_defaults(script_path: Path) -> dict[str, str]:
    """The script's ``LAUNCH_DEFAULTS`` (flag -> its default, a string), read like ``LAUNCH_RULES``: the values a
    rule checks when the command line does not give the flag."""
    return _flag_dict(script_path, "LAUNCH_DEFAULTS", "LAUNCH_DEFAULTS = {'--n-head': '12'}", "default string")[0]


def _given_flags(arg_list: list[str]) -> dict[str, str]:
    """Every ``--flag`` of the command line with its value (``--flag V`` or ``--flag=V``, the last one wins, as
    argparse does; a switch followed by another flag, or last, maps to ``""``; a flag that takes several values,
    ``--schedule gpipe 1f1b``, maps to them joined by spaces, each checked by the rules in turn)."""
    given = {}
    for i, a in enumerate(arg_list):
        if not a.startswith("--"):
            continue
        if "=" in a:
            flag, value = a.split("=", 1)
        else:
            values = list(itertools.takewhile(lambda v: not v.startswith("--"), arg_list[i + 1:]))
            flag, value = a, " ".join(values)
        given[flag] = value
    return given


def _launch_rules(script_path: Path) -> dict[str, str]:
    """The script's ``LAUNCH_RULES`` (flag -> rule name), read from its source without importing or running it; {}
    when it declares none. A declaration that is not a literal dict of flag -> known rule name is refused."""
    example = "LAUNCH_RULES = {'--shard-size': 'divides_world_size'}"
    rules, lineno = _flag_dict(script_path, "LAUNCH_RULES", example, "rule name")
    if not rules:
        return {}
    unknown = {flag: rule for flag, rule in rules.items() if rule not in mesh.RULES}
    if unknown:
        flag, rule = next(iter(unknown.items()))
        raise LaunchError(f"{script_path.name} line {lineno}: LAUNCH_RULES gives {flag} the rule {rule!r}, "
                          f"which is not one of helpers.calc.mesh.RULES ({', '.join(sorted(mesh.RULES))})",
                          reason="invalid")
    return rules


def _check_script_rules(script_path: Path, arg_list: list[str], world_size: int) -> None:
    """Mistakes in a script's own arguments that are visible before anything starts, by the rules the script
    declares (``LAUNCH_RULES``, with ``LAUNCH_DEFAULTS`` for flags not given); the script applies the same rules
    inside each rank when started from a terminal (:func:`helpers.calc.mesh.script_problem`)."""
    rules = _launch_rules(script_path)
    if not rules:
        return
    flags = {**_launch_defaults(script_path), **_given_flags(arg_list)}
    problem = mesh.script_problem(rules, flags, world_size)
    if problem:
        raise LaunchError(problem, reason="invalid")


def _check_env(env) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise LaunchError(f"env must be a dict of strings, got {type(env).__name__}", reason="invalid")
    return {str(k): str(v) for k, v in env.items()}


def _check_timeouts(timeout, stall_timeout) -> None:
    for label, value in (("timeout", timeout), ("stall_timeout", stall_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise LaunchError(f"{label} must be a positive number of seconds or None, got {value!r}",
                              reason="invalid")


def _check_config(config) -> Path | dict | None:
    """A DeepSpeed config as the launcher keeps it: a copy of a dict, or the path of an existing file."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise LaunchError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}",
                          reason="invalid")
    path = Path(config)
    if not path.is_absolute() and not path.exists():
        path = PROJECT_ROOT / path
    if not path.is_file():
        raise LaunchError(f"DeepSpeed config not found: {config}", reason="invalid")
    return path


def _check_config_fits(config: Path | dict, world_size: int, gpus: int, machine: Machine) -> None:
    """The config against this world size and device, with messages that say what to change, before
    DeepSpeed's own assertions could be the first thing a learner sees."""
    from ..calc import dsconfig
    from ..rank.deepspeed_facts import facts
    on_gpus = machine.backend == "nccl" and gpus
    # bf16 needs compute capability 8.0+; asked of a subprocess, the kernel never touches CUDA
    capabilities = machine.cuda_capabilities() if on_gpus else None
    try:
        dsconfig.check(config, world_size, accelerator="cuda" if on_gpus else "cpu", capabilities=capabilities,
                       facts=facts())
    except dsconfig.ConfigError as err:
        raise LaunchError(str(err), reason="invalid") from None
