"""Notebook 07 (FSDP2): the settings, tables, plots and claim lines the notebook's cells call.

The loss parity is in :mod:`helpers.notebook.lessons.fsdp2_parity`, the figures in
:mod:`helpers.notebook.lessons.fsdp2_plots`; this module re-exports both.

Speed is the median, with min-max, of ``windows`` consecutive timed windows inside each run
(:func:`helpers.calc.throughput.window_samples_per_s`): one launch per system, not one per repeat.

Example (notebook cells)::

    cfg = lesson.settings(PROFILE, NPROC, RESUME_NPROC, STEPS, SKIP_STEPS, WINDOWS, GLOBAL_BATCH)
    ...  # the launches, in the notebook
    lesson.claim_losses(runs, cfg)
    speed = lesson.claim_speed(runs, cfg)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...calc import memory
from ...calc.throughput import median_spread, window_samples_per_s
from ...rank import metrics
from ..checks import claim
from ..scripts import COURSE, script_diff
# the loss parity and the figures live in fsdp2_parity.py and fsdp2_plots.py; notebook 07 calls them through here
from .fsdp2_parity import claim_same_losses, global_losses
from .fsdp2_plots import plot_comparison, plot_losses  # noqa: F401

SYSTEMS = ("DDP", "ZeRO-3", "FSDP2")
SCRIPTS = {"DDP": "ddp_cifar10.py", "ZeRO-3": "ds_cifar10.py", "FSDP2": "fsdp2_cifar10.py"}
# (ZeRO stage, optimizer bytes per parameter K): DeepSpeed keeps an fp32 master copy even in fp32 (notebook 04)
ZERO = {"DDP": (0, 8), "ZeRO-3": (3, 12), "FSDP2": (3, 8)}
THEORY_P = {"DDP": 2, "ZeRO-3": 3, "FSDP2": 3}
CKPT_FORMAT = {"DDP": "1 torch.save file (rank 0)", "ZeRO-3": "DeepSpeed folder, 1 shard per rank",
               "FSDP2": "DCP folder, 1 shard per rank"}


# ------------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Settings:
    profile: str
    gpus: int
    nproc: int
    resume_nproc: int
    steps: int
    skip_steps: int
    windows: int
    global_batch: int

    def __str__(self) -> str:
        return (f"profile={self.profile} nproc={self.nproc} resume_nproc={self.resume_nproc} steps={self.steps} "
                f"skip_steps={self.skip_steps} windows={self.windows} global_batch={self.global_batch} "
                f"gpus={self.gpus}")


def resolve(profile: str, gpus: int, default_nproc: int, nproc=None, resume_nproc=None, steps=None,
            skip_steps=None, windows=3, global_batch=48) -> Settings:
    """The notebook's parameters with their defaults filled in, refused with what to change when they do not fit.

    The resume runs on GPUs on ``nproc // 2`` ranks (at least 1); on a CPU (ranks are processes) on ``nproc + 1``
    where that count divides the global batch, else on ``nproc - 1``: with 48, NPROC 1, 2, 3 resume on 2, 3, 4
    and NPROC 4 on 3 (48 samples do not split over 5 ranks). The global batch must divide by both counts."""
    nproc = nproc or default_nproc
    if not resume_nproc:
        resume_nproc = max(1, nproc // 2) if gpus else (nproc + 1 if global_batch % (nproc + 1) == 0 else nproc - 1)
    steps = steps or (12 if profile == "smoke" else 40)
    skip_steps = skip_steps or (2 if profile == "smoke" else 5)
    if windows < 3:
        raise ValueError(f"WINDOWS={windows}: a speed worth comparing is a median of at least 3 timed windows")
    if steps - skip_steps < windows:
        raise ValueError(f"STEPS={steps} leaves {steps - skip_steps} timed steps after SKIP_STEPS={skip_steps}, "
                         f"fewer than WINDOWS={windows}: raise STEPS")
    for n, name in ((nproc, "NPROC"), (resume_nproc, "RESUME_NPROC")):
        if n < 1 or global_batch % n:
            raise ValueError(f"GLOBAL_BATCH={global_batch} is not a multiple of {name}={n}: every rank count must "
                             f"get the same global batches (e.g. GLOBAL_BATCH=48 with NPROC 1-4 and its resume)")
    return Settings(profile, gpus, nproc, resume_nproc, steps, skip_steps, windows, global_batch)


def settings(profile="auto", nproc=None, resume_nproc=None, steps=None, skip_steps=None, windows=3,
             global_batch=48) -> Settings:
    """:func:`resolve` with this machine's profile, GPU count and default rank count; prints the result."""
    from .. import env

    cfg = resolve(env.profile(profile), env.gpu_count(), env.default_nproc(), nproc, resume_nproc, steps,
                  skip_steps, windows, global_batch)
    print(cfg)
    return cfg


def fresh_dir(path):
    """``path``, emptied: the checkpoints of an earlier run of the notebook are not read by this one."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    return path


# ---------------------------------------------------------------------------------------- 1. the scripts


def _code_lines(script: str) -> list[str]:
    """``course/<script>`` below its module docstring (what :func:`helpers.notebook.scripts.script_diff` compares)."""
    text = (COURSE / script).read_text()
    return (text.split('"""', 2)[2] if text.lstrip().startswith('"""') else text).splitlines()


def script_lines() -> dict[str, int]:
    """Code lines of each system's lesson script, without the docstring, comments and blank lines."""
    return {label: len([l for l in _code_lines(name) if l.strip() and not l.strip().startswith("#")])
            for label, name in SCRIPTS.items()}


ADDED = ("init_device_mesh(", "fully_shard(block", "fully_shard(model", "MixedPrecisionPolicy(", "dcp.save(",
         "dcp.load(", "get_state_dict(", "dcp_to_torch_save(")


def claim_script_changes(old: str = "ddp_cifar10.py", new: str = "fsdp2_cifar10.py") -> None:
    """Three claim lines about the diff from the DDP script to the FSDP2 script."""
    diff = script_diff(old, new, context=0)
    added = [l[1:] for l in diff if l.startswith("+")]
    before, after = _code_lines(old), _code_lines(new)
    claim("each FSDP2 step named above is written in the FSDP2 script and in no line of the DDP script",
          all(any(m in l for l in added) for m in ADDED) and not any(m in l for m in ADDED for l in before))
    claim("the FSDP2 script wraps nothing in DDP(...)", not any("DDP(" in l for l in after))
    optim = [i for i, l in enumerate(after) if "torch.optim.Adam(" in l]
    shard = [i for i, l in enumerate(after) if "fully_shard(model" in l]
    claim("its optimizer is built after the last fully_shard call", bool(optim and shard) and min(optim) > max(shard))


# ---------------------------------------------------------------------------------------- 2. sharding units


def layer_table(model) -> dict[str, int]:
    """Print each parameter-holding child's size (one sharding unit each in the script); return name -> count."""
    layers = {name: sum(p.numel() for p in m.parameters()) for name, m in model.named_children()
              if any(True for _ in m.parameters())}
    total = sum(layers.values())
    for name, n in layers.items():
        print(f"{name:6s} {n:>8,} parameters  {n / total:6.1%} of the model  gathered in fp32: {4 * n / 2**20:5.2f} MiB")
    print(f"all    {total:>8,} parameters")
    return layers


def claim_meta_init(model, make_model, *, was_meta: bool, seed: int = 0) -> None:
    """``model`` was built under ``torch.device("meta")`` (``was_meta``: every parameter was meta then), then
    materialised with ``to_empty`` and each module's ``reset_parameters()`` after ``torch.manual_seed(seed)``: it must
    hold the initial weights of ``make_model()`` built normally after the same seed."""
    import torch

    torch.manual_seed(seed)
    built = make_model()
    same = model.state_dict().keys() == built.state_dict().keys() and all(
        torch.equal(a, built.state_dict()[k]) for k, a in model.state_dict().items())
    claim("built under torch.device('meta') the model held no data; after to_empty + reset_parameters it holds "
          "the initial weights of the same model built normally with the same seed", was_meta and same)


# ---------------------------------------------------------------------------------------- 4. the same losses


def launch_more(script: str, more: dict, **kw) -> dict:
    """Section 3's other runs of ``script``, ``{label: (nproc, args)}``: ``{label: Run}`` in the order given. Nobody
    reads their timings, so on a CPU they go two at a time (:func:`helpers.launch.side_by_side`); a run that resumes
    (``--load-dir``) starts after every run that does not, so the checkpoint it reads exists."""
    from ... import launch

    def start(label):
        n, args = more[label]
        return lambda: launch.torchrun(script, nproc=n, args=args, name="07_" + label.replace(" ", "_"), **kw)

    done = {}
    resumes = [label for label, (_, args) in more.items() if "--load-dir" in map(str, args)]
    for batch in ([label for label in more if label not in resumes], resumes):
        done.update(zip(batch, launch.side_by_side(*map(start, batch))))
    return {label: done[label] for label in more}


def claim_losses(runs: dict, cfg: Settings) -> dict:
    """:func:`claim_same_losses` for the notebook's runs (labels of the notebook's launch cells); returns the curves
    by label, for the plot."""
    curves = {label: global_losses(run) for label, run in runs.items()}
    claim_same_losses(curves["one process"], curves["one process fp64"], {l: curves[l] for l in SYSTEMS},
                      curves["resumed"], first64=curves["FSDP2 fp64"], again64=curves["resumed fp64"],
                      resumed_from=runs["resumed"].result["resumed_from"], nproc=cfg.nproc,
                      resume_nproc=cfg.resume_nproc)
    return curves


# ---------------------------------------------------------------------------------------- memory


def state_ratios(run, label: str, n: int, params: int) -> dict[int, float]:
    """Per rank: measured model-state bytes over the ZeRO formula for ``label``'s stage and K at ``n`` ranks."""
    stage, k = ZERO[label]
    formula = memory.zero_model_state_bytes(params, n, stage, "fp32", k=k)["total"]
    by_rank = run.results_by_rank()
    if sorted(by_rank) != list(range(n)):
        raise ValueError(f"{run.run_dir}: ranks {sorted(by_rank)} reported, expected 0-{n - 1}")
    return {rank: r["model_state_bytes"]["total"] / formula for rank, r in by_rank.items()}


def claim_memory(runs: dict, cfg: Settings, params: int) -> dict:
    """Measured over formula on every rank of the comparison, the resumed and the bf16 runs, and two claims on
    how they order; returns the ratios by label."""
    mem = {label: state_ratios(runs[label], label, cfg.nproc, params) for label in SYSTEMS}
    mem[f"FSDP2 on {cfg.resume_nproc}"] = state_ratios(runs["resumed"], "FSDP2", cfg.resume_nproc, params)
    mem["FSDP2 bf16"] = state_ratios(runs["bf16"], "FSDP2", cfg.nproc, params)
    for label, by_rank in mem.items():
        print(f"{label:14s} measured/formula: " + ", ".join(f"rank {r} {v:.4f}" for r, v in by_rank.items()))
    values = [v for by_rank in mem.values() for v in by_rank.values()]
    claim("on every rank of every run, measured model states are within 5% of the formula",
          all(0.95 <= v <= 1.05 for v in values), measured=f"{min(values):.4f}-{max(values):.4f}")
    held = {label: runs[label].result["model_state_bytes"]["total"] for label in SYSTEMS}
    if cfg.nproc > 1:
        claim("FSDP2 holds fewer model-state bytes per rank than DeepSpeed ZeRO-3, and both fewer than DDP",
              held["FSDP2"] < held["ZeRO-3"] < held["DDP"],
              measured=", ".join(f"{l} {b / 2**20:.2f} MiB" for l, b in held.items()))
    claim("bf16 MixedPrecisionPolicy holds the same model-state bytes as fp32 (fp32 shards, fp32 gradients)",
          runs["bf16"].result["model_state_bytes"] == runs["FSDP2"].result["model_state_bytes"])
    return mem


# ---------------------------------------------------------------------------------------- communication


def sent_multiple(run, n: int, params: int) -> float:
    """Bytes one rank sends per step, as a multiple of P = 4 x params x (N-1)/N (nan on one rank: nothing sent)."""
    from .. import results

    return results.comm_per_step(run)["total_sent_bytes"] / (4 * params * (n - 1) / n) if n > 1 else math.nan


def _gathers(run) -> dict:
    return run.results_by_rank()[0]["comm_per_step"].get("all_gather_into_tensor", {"calls": 0, "bytes": 0})


def claim_comm(runs: dict, cfg: Settings, params: int) -> dict:
    """The bytes sent per step of each run against the theory (2P, 3P, bf16 gathers, no reshard); returns the
    multiples by label."""
    n, m = cfg.nproc, cfg.resume_nproc
    no_reshard = f"FSDP2 on {m}, no reshard"
    sent = {label: sent_multiple(runs[label], n, params) for label in SYSTEMS}
    sent[no_reshard] = sent_multiple(runs["resumed"], m, params)
    sent["FSDP2 bf16"] = sent_multiple(runs["bf16"], n, params)
    for label, v in sent.items():
        print(f"{label:28s} {v:5.2f} P per step")
    near = lambda v, target: abs(v - target) <= 0.05 * target  # noqa: E731
    if n > 1:
        claim("DDP sends 2P per step: one all-reduce of every gradient", near(sent["DDP"], 2),
              measured=f"{sent['DDP']:.3f} P")
        claim("FSDP2 with reshard_after_forward=True sends the ZeRO paper's 3P: all-gather in forward and again in "
              "backward, reduce-scatter in backward", near(sent["FSDP2"], 3), measured=f"{sent['FSDP2']:.3f} P")
        claim("FSDP2 issues 2 all-gathers per sharding unit per step (4 units: 8)",
              _gathers(runs["FSDP2"])["calls"] == 8)
        claim("bf16 halves what FSDP2 all-gathers (2P -> 1P) and leaves the fp32 reduce-scatter as it is (1P): 2P",
              near(sent["FSDP2 bf16"], 2) and _gathers(runs["bf16"])["bytes"] * 2 == _gathers(runs["FSDP2"])["bytes"],
              measured=f"{sent['FSDP2 bf16']:.3f} P")
        claim("DeepSpeed ZeRO-3 sends 2P here, not 3P (it does not gather again in backward: notebook 04)",
              near(sent["ZeRO-3"], 2), measured=f"{sent['ZeRO-3']:.3f} P")
    if m > 1:
        claim("with reshard_after_forward=False FSDP2 gathers once per unit per step (4 all-gathers) and sends 2P",
              _gathers(runs["resumed"])["calls"] == 4 and near(sent[no_reshard], 2),
              measured=f"{sent[no_reshard]:.3f} P")
    return sent


# ---------------------------------------------------------------------------------------- 5. table, speed


def window_rates(run, cfg: Settings) -> list[float]:
    """samples/s of each of ``cfg.windows`` timed windows of one run (each step timed on its slowest rank)."""
    by_rank: dict[int, list[float]] = {}
    for r in metrics.steps(run.metrics):  # sorted by (rank, step)
        by_rank.setdefault(r["rank"], []).append(r["step_s"])
    return window_samples_per_s(by_rank, cfg.global_batch, cfg.skip_steps, cfg.windows)


def speeds(runs: dict, cfg: Settings) -> dict[str, tuple[float, float, float]]:
    """(median, min, max) of the windows' samples/s per system."""
    return {label: median_spread(window_rates(runs[label], cfg)) for label in SYSTEMS}


def comparison_rows(runs: dict, cfg: Settings, params: int, sent: dict, speed: dict) -> list[dict]:
    """One row per system: :func:`helpers.notebook.results.summary` plus formula, speed, traffic, format, lines."""
    from .. import results

    lines = script_lines()
    rows = []
    for label in SYSTEMS:
        stage, k = ZERO[label]
        median, low, high = speed[label]
        rows.append(dict(results.summary(runs[label], label), samples_per_s=median, spread=f"{low:.0f}-{high:.0f}",
                         formula_mib=memory.zero_model_state_bytes(params, cfg.nproc, stage, "fp32", k=k)["total"]
                         / 2**20, comm_p=sent[label], theory_p=THEORY_P[label], format=CKPT_FORMAT[label],
                         loc=lines[label]))
    return rows


COLUMNS = (("label", "system", "{}"), ("model_states_mib", "model states MiB/rank", "{:.2f}"),
           ("formula_mib", "formula MiB/rank", "{:.2f}"), ("samples_per_s", "samples/s (median)", "{:.0f}"),
           ("spread", "min-max", "{}"), ("comm_p", "sent P/step", "{:.2f}"), ("theory_p", "theory P", "{}"),
           ("checkpoint_mib", "checkpoint MiB", "{:.1f}"), ("format", "checkpoint format", "{}"),
           ("loc", "script code lines", "{}"))


def print_table(rows: list[dict], cfg: Settings, params: int) -> None:
    from .. import results

    print(f"{cfg.nproc} ranks, {params:,} parameters, fp32, global batch {cfg.global_batch}, {cfg.steps} steps, "
          f"samples/s over {cfg.windows} timed windows per run (P = {4 * params / 2**20:.2f} MiB x (N-1)/N)")
    print(results.table(rows, COLUMNS))


def claim_speed(runs: dict, cfg: Settings, speed: dict) -> None:
    """The windows are all there; on a CPU with more than one rank neither sharded system beats DDP beyond noise:
    its median is at most DDP's fastest window times its own max/min window ratio (the spread measured in this
    run, no fixed range: how far below DDP they land depends on the cores, the rank count and the load)."""
    timed = cfg.steps - cfg.skip_steps
    claim(f"every system's run timed {cfg.windows} windows of {timed // cfg.windows} steady-state steps",
          all(runs[l].result["timed_steps"] == timed and len(window_rates(runs[l], cfg)) == cfg.windows
              for l in SYSTEMS))
    if not cfg.gpus and cfg.nproc > 1:
        ddp_median, _, ddp_fastest = speed["DDP"]
        allowed = {l: ddp_fastest * speed[l][2] / speed[l][1] for l in ("ZeRO-3", "FSDP2")}
        claim("on this CPU neither FSDP2 nor DeepSpeed ZeRO-3 is faster than DDP beyond the spread of the timed "
              "windows", all(speed[l][0] <= allowed[l] for l in allowed),
              measured=", ".join(f"{l} {m:.0f} ({lo:.0f}-{hi:.0f}) samples/s, {m / ddp_median:.2f}x DDP"
                                 for l, (m, lo, hi) in speed.items()))


# ---------------------------------------------------------------------------------------- 6, 7. checkpoints, offload


def claim_checkpoints(runs: dict, cfg: Settings, params: int, exported_file) -> None:
    """The exported plain file loads strictly into an unwrapped SimpleCNN and records its step; every system's
    checkpoint holds about 12 bytes per parameter."""
    import torch

    from ...rank import models

    exported = torch.load(exported_file, map_location="cpu", weights_only=False)
    print("keys:", sorted(exported), "| model:", ", ".join(exported["model"]))
    missing, unexpected = models.SimpleCNN().load_state_dict(exported["model"], strict=True)
    claim("the exported file loads into a plain SimpleCNN with strict=True: every key and shape, no DTensor left",
          not missing and not unexpected and all(type(t) is torch.Tensor for t in exported["model"].values()))
    claim(f"it records the step it was saved at ({cfg.steps})", int(exported["step"]) == cfg.steps)
    per_param = {label: runs[label].result["checkpoint_bytes"] / params for label in SYSTEMS}
    claim("the DCP checkpoint holds 12 bytes per parameter, within 5%: fp32 weights and Adam's two moments, once "
          "across all shards; so do DDP's and ZeRO-3's", all(abs(v / 12 - 1) < 0.05 for v in per_param.values()),
          measured=", ".join(f"{l} {v:.2f}" for l, v in per_param.items()) + " B/param")


def claim_offload(offload, base) -> None:
    """GPU runs only: CPUOffloadPolicy lowers the ranks' CUDA high-water mark below the same run without it."""
    low, high = offload.result["cuda_peak_mib"], base.result["cuda_peak_mib"]
    claim("with CPUOffloadPolicy the ranks' CUDA high-water mark is lower", low < high,
          measured=f"{low:.0f} vs {high:.0f} MiB")
