"""Notebook 02 (DDP on CIFAR-10): what its cells claim about the runs, and the small tables and plots they show.

Every function here reads launches the notebook made (a :class:`helpers.launch.Run`, a ``LaunchError``, a finished
subprocess) and prints the chapter's claim lines with :func:`helpers.notebook.checks.claim`, phrased so that they
hold at every value the parameters cell offers (1-4 ranks, either profile, generated data or CIFAR-10):

* the training run: every rank reported, same step count, loss down, accuracy above chance, global batch;
* the checkpoint reloads into a plain model with the ranks' accuracy;
* scaling: one launch per world size, its steady state timed in equal windows inside the launch
  (:func:`helpers.calc.throughput.window_samples_per_s`), stated as median and spread;
* how DDP groups SimpleCNN's gradients into buckets (DDP's own assignment function, no process group needed);
* the pitfalls: a parameter that gets no gradient, the blog's self-relaunch (notebook 06 runs the rank-0-only
  collective and the fixed port), and the installed DeepSpeed's facts behind errata rows 8, 9 and 13 (and row 18's arithmetic).

Example (a notebook cell)::

    from helpers.notebook.lessons import ddp as lesson
    lesson.claim_training(train, nproc=2, batch_size=32)
"""
from __future__ import annotations

import ast
import collections
import importlib.util
import inspect
import json
import re
from pathlib import Path

from ...calc import memory
from ...calc.throughput import median_spread, window_samples_per_s
from ...launch import PROJECT_ROOT
from ...rank import metrics
from ..checks import claim
from ..i18n import say
from ..scripts import COURSE

SCALE_SKIP = 5  # warm-up steps left out of every timing (allocator, DDP's bucket rebuild, lazy initialisation)
SCALE_WINDOWS = 3  # timed windows per launch: the spread of the steady state without a launch per repeat


def without_root(text: str) -> str:
    """``text`` with this checkout's absolute path removed (outputs must not hold machine paths)."""
    return text.replace(str(PROJECT_ROOT) + "/", "")


def train_args(epochs, batch_size, dataset, train_size, test_size) -> list:
    """The flags of the training run, as a terminal would take them."""
    return (["--epochs", epochs, "--batch-size", batch_size, "--dataset", dataset, "--data-root", "data",
             "--test-size", test_size or 10000] + (["--train-size", train_size] if train_size else []))


def typed_command(run) -> str:
    """The torchrun command a learner would type for ``run``: the rank count, the script and its flags, none of
    the launcher's own (log directory, rendezvous, tee, monitor interval)."""
    script = next(i for i, a in enumerate(run.command) if str(a).endswith(".py"))
    return " ".join(["torchrun", "--nproc-per-node", str(run.nproc), without_root(str(run.command[script])),
                     *map(str, run.command[script + 1:])])


# -- the blog's two bugs ---------------------------------------------------------------------------------------

def claim_mp_spawn() -> None:
    """``mp.spawn``, which the blog does not use, starts fresh interpreters (its default start method)."""
    import torch.multiprocessing

    claim("torch.multiprocessing.spawn starts fresh interpreters by default (start_method='spawn')",
          inspect.signature(torch.multiprocessing.spawn).parameters["start_method"].default == "spawn")


def show_self_relaunch(relaunch) -> None:
    """Count the generations of ``course/pitfall_self_relaunch.py`` in its output (a ``PlainRun``) and claim that
    main() never ran, that each copy started two more, and that the course's cap ended it."""
    launched = collections.Counter(re.findall(r"\[generation (\d+)[^\]]*\] launching torchrun", relaunch.output))
    capped = len(re.findall(r"\[generation 2[^\]]*\] safety cap reached", relaunch.output))
    for g in sorted(launched):
        say(f"generation {g}: {launched[g]} process(es), each launched torchrun on the same file")
    say(f"generation 2: {capped} processes, stopped by the course's cap (without it: 8 in generation 3, 16 in 4, ...)")
    say(f"{sum(launched.values()) + capped} copies of this file ran, started by {sum(launched.values())} torchrun "
          "launches; the whole log is in runs/02_self_relaunch/<run>/output.log")
    claim("main() never ran", "main() ran" not in relaunch.output)
    claim("each copy started 2 more: 1, 2 and 4 processes in generations 0, 1 and 2",
          dict(launched) == {"0": 1, "1": 2} and capped == 4)
    claim("the course's cap ended it, well inside the timeout", not relaunch.timed_out)


# -- training and reload ---------------------------------------------------------------------------------------

def headline(run) -> None:
    """Rank 0's data announcement and the run's result in one line each."""
    result = run.result
    announcement = next((line for line in run.log(0).splitlines() if line.startswith("Dataset")), "Dataset: ?")
    print(without_root(announcement))
    memory_mib = result.get("cuda_peak_mib", result["peak_rss_mib"])
    print(f"test accuracy {result['test_accuracy']:.3f} | {result['samples_per_s']:.0f} samples/s (steps 6+) | "
          f"global batch {result['global_batch']} | peak memory/rank {memory_mib:.0f} MiB")


def claim_training(run, *, nproc: int, batch_size: int) -> None:
    """The claims of section 2: the launcher's port, every rank's losses, the loss going down, the accuracy."""
    claim("training ran on a port the launcher picked, not the blog's fixed 29500", run.port != 29500 and run.returncode == 0)
    steps = metrics.steps(run.metrics)
    if nproc > 1:
        per_rank = {k: {r["step"]: r["loss"] for r in steps if r["rank"] == k} for k in range(nproc)}
        shared = sorted(set.intersection(*(set(v) for v in per_rank.values())))
        differing = sum(len({per_rank[k][s] for k in range(nproc)}) > 1 for s in shared)
        claim("the ranks' losses differ at every step (each rank's loss is on its own shard)",
              differing == len(shared) > 0, measured=f"{differing} of {len(shared)} steps")
    else:
        print("one rank: there is no other rank's loss to compare")
    ranks = sorted({r["rank"] for r in steps})
    loss0 = [r["loss"] for r in steps if r["rank"] == 0]
    k = max(1, len(loss0) // 10)
    claim("every rank reported its loss", ranks == list(range(nproc)))
    claim("every rank took the same number of steps", len({sum(r["rank"] == q for r in steps) for q in ranks}) == 1)
    claim("loss decreased (mean of first vs last tenth of steps)", sum(loss0[-k:]) / k < sum(loss0[:k]) / k)
    claim("test accuracy above chance (10 classes -> 0.1)", run.result["test_accuracy"] > 0.1)
    claim("global batch = per-rank batch x ranks", run.result["global_batch"] == batch_size * nproc)


def accuracy(model, dataset, batch_size: int = 500) -> float:
    """Top-1 accuracy of ``model`` on ``dataset``, on the CPU, in this process."""
    import torch
    from torch.utils.data import DataLoader

    model.eval()
    correct = 0
    with torch.no_grad():
        for images, labels in DataLoader(dataset, batch_size=batch_size):
            correct += (model(images).argmax(1) == labels).sum().item()
    return correct / len(dataset)


def claim_reload(model, reloaded: float, result: dict) -> None:
    """The reloaded plain model reproduces the ranks' accuracy, and its keys carry no DDP prefix."""
    claim("the reloaded model reproduces the ranks' accuracy", abs(reloaded - result["test_accuracy"]) < 1e-6)
    claim("keys have no 'module.' prefix", not any(k.startswith("module.") for k in model.state_dict()))


# -- scaling ---------------------------------------------------------------------------------------------------

def scale_args(dataset, *, steps: int, global_batch: int, world_size: int) -> list:
    """Flags for one scaling launch: ``steps`` steps of ``global_batch`` samples on ``world_size`` ranks."""
    return ["--epochs", 1, "--dataset", dataset, "--data-root", "data", "--train-size", steps * global_batch,
            "--test-size", 256, "--skip-steps", SCALE_SKIP, "--batch-size", global_batch // world_size]


def scaling_table(runs: dict, windows: int = SCALE_WINDOWS, skip: int = SCALE_SKIP) -> dict:
    """``{world size: run}`` -> per world size: the OpenMP threads and cores the launcher set, the samples/s of
    each timed window, their median and spread, the peak memory per rank and the global batch."""
    table = {}
    for n, run in runs.items():
        env = json.loads((run.run_dir / "env.json").read_text())
        step_s = {k: [r["step_s"] for r in metrics.steps(run.metrics, k)] for k in range(n)}
        result = run.result
        rates = window_samples_per_s(step_s, result["global_batch"], skip=skip, windows=windows)
        table[n] = {"threads": int(env["omp_num_threads"]), "cpus": int(env["cpus"]), "rates": rates,
                    "median_spread": median_spread(rates), "window_steps": (len(step_s[0]) - skip) // windows,
                    "memory_mib": result.get("cuda_peak_mib", result["peak_rss_mib"]),
                    "on_gpus": "cuda_peak_mib" in result, "global_batch": result["global_batch"],
                    "train_samples": result["train_samples"]}
    return table


def print_scaling(table: dict) -> None:
    """One line per world size and the ratio of the medians with its range across windows."""
    for n, row in table.items():
        med, lo, hi = row["median_spread"]
        print(f"{n} rank(s) x {row['threads']} thread(s): samples/s per window "
              f"{', '.join(f'{x:.0f}' for x in row['rates'])} | median {med:.0f} (spread {lo:.0f}-{hi:.0f}) | "
              f"peak memory per rank {row['memory_mib']:.0f} MiB | global batch {row['global_batch']}")
    n = max(table)
    if n > 1:
        (m1, lo1, hi1), (mn, lon, hin) = table[1]["median_spread"], table[n]["median_spread"]
        print(f"median ratio: {n} ranks process {mn / m1:.2f}x the samples/s of 1 rank "
              f"(from {lon / hi1:.2f}x to {hin / lo1:.2f}x across the windows)")


def plot_scaling(table: dict):
    """Throughput (bar: median, dots: windows) and peak memory per rank, per world size."""
    import matplotlib.pyplot as plt

    configs = sorted(table)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    for i, n in enumerate(configs):
        a.bar(i, table[n]["median_spread"][0], color="tab:blue", alpha=0.6)
        a.plot([i] * len(table[n]["rates"]), table[n]["rates"], "k.", label="one window" if i == 0 else None)
        b.bar(i, table[n]["memory_mib"], color="tab:orange", alpha=0.6)
    for ax, label in ((a, "training throughput (samples/s, all ranks)"), (b, "peak memory per rank (MiB)")):
        ax.set_xticks(range(len(configs)), [f"{n} rank{'s' if n > 1 else ''}" for n in configs])
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel(label)
    a.set_title("throughput, steady state (bar: median)")
    b.set_title("peak GPU memory" if table[configs[0]]["on_gpus"] else "peak process memory (RSS)")
    a.legend(loc="lower right")
    fig.suptitle(f"1 vs {configs[-1]} ranks, same data and global batch, {len(table[configs[0]]['rates'])} timed "
                 "windows in one launch each")
    fig.tight_layout()
    return fig


def claim_scaling(table: dict, nproc: int) -> None:
    """The claims of section 4 (see the notebook's prose for why the CPU bounds are what they are)."""
    rows = list(table.values())
    claim("both configurations used the same global batch and samples",
          len({(r["global_batch"], r["train_samples"]) for r in rows}) == 1)
    claim(f"each configuration's steady state was timed in {SCALE_WINDOWS} equal windows inside one launch",
          all(len(r["rates"]) == SCALE_WINDOWS and r["window_steps"] >= 5 for r in rows),
          measured=f"{rows[0]['window_steps']} steps per window")
    claim("every rank got max(1, cores // ranks) OpenMP threads (the launcher's rule)",
          all(r["threads"] == max(1, r["cpus"] // n) for n, r in table.items()),
          measured=str({n: r["threads"] for n, r in table.items()}))
    if nproc == 1:
        print("NPROC = 1: one configuration only, so there is no ratio to state; set NPROC to 2 or more")
        return
    ratio = table[nproc]["median_spread"][0] / table[1]["median_spread"][0]
    mem_ratio = table[nproc]["memory_mib"] / table[1]["memory_mib"]
    if table[nproc]["on_gpus"]:
        claim(f"on GPUs: {nproc} ranks reach 0.5x to {1.1 * nproc:.1f}x the samples/s of 1 rank",
              0.5 <= ratio <= 1.1 * nproc, measured=f"{ratio:.2f}x")
        claim("on GPUs: peak memory per rank is 0.3x to 1.25x the single rank's", 0.3 <= mem_ratio <= 1.25,
              measured=f"{mem_ratio:.2f}x")
    else:
        claim(f"on CPU: {nproc} ranks sharing the cores keep at least 0.25x the samples/s of 1 rank", ratio >= 0.25,
              measured=f"{ratio:.2f}x")
        claim("on CPU: peak memory per rank within 0.75x-1.25x of the single process (so N ranks hold about N "
              "times as much)", 0.75 <= mem_ratio <= 1.25, measured=f"{mem_ratio:.2f}x")


# -- inside DDP: buckets ---------------------------------------------------------------------------------------

def buckets(model, bucket_cap_mb: float | None = None) -> list[list[str]]:
    """The parameter names of each of DDP's gradient buckets for ``model``, in all-reduce order, as the installed
    DDP assigns them once it has seen a backward (the first step uses one bucket; then DDP rebuilds them in the
    order the gradients arrived, which for a plain feed-forward model is the reverse of registration): DDP's own
    ``_compute_bucket_assignment_by_size`` over the parameters in reverse order, with its default caps (the first
    bucket 1 MiB, the others ``bucket_cap_mb``, 25 MiB). Needs no process group."""
    import torch.distributed as dist
    from torch.nn.parallel import distributed as ddp_module

    cap = int((bucket_cap_mb or ddp_module._DEFAULT_BUCKET_CAP_MB) * 1024 * 1024)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    names, params = zip(*reversed(list(model.named_parameters())))
    assignment, _ = dist._compute_bucket_assignment_by_size(list(params), [first, cap], [False] * len(params))
    return [[names[i] for i in bucket] for bucket in assignment]


def show_buckets(model) -> None:
    """Print DDP's buckets for ``model`` (names and MiB) and DDP's defaults, and claim the order."""
    from torch.nn.parallel import DistributedDataParallel

    sizes = dict((name, p.numel() * p.element_size()) for name, p in model.named_parameters())
    layout = buckets(model)
    for i, bucket in enumerate(layout):
        print(f"bucket {i} ({sum(sizes[n] for n in bucket) / 2**20:.2f} MiB): {', '.join(bucket)}")
    defaults = {k: v.default for k, v in inspect.signature(DistributedDataParallel.__init__).parameters.items()}
    print("DDP's defaults: " + ", ".join(f"{k}={defaults[k]}" for k in
                                         ("bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters",
                                          "static_graph")) + " (bucket_cap_mb None = 25 MiB)")
    registered = list(sizes)
    claim("DDP all-reduces the last layer's gradients first: bucket 0 starts with the last parameter registered",
          layout[0][0] == registered[-1] and layout[-1][-1] == registered[0])
    lesson_script, tuning_script = ((COURSE / name).read_text() for name in ("ddp_cifar10.py", "ddp_tuning.py"))
    claim("course/ddp_cifar10.py keeps DDP's default gradient_as_bucket_view=False (a second copy of the gradients, "
          "in the buckets); course/ddp_tuning.py sets it True",
          defaults["gradient_as_bucket_view"] is False and "gradient_as_bucket_view" not in lesson_script
          and "gradient_as_bucket_view=True" in tuning_script)


def unused_parameter_demo(train, nproc: int = 2) -> None:
    """Run ``train(model, dataset, epochs)`` on ``nproc`` gloo ranks with the exercise's task (each rank's
    ``dataset.x``/``.y`` a small two-class problem), expecting it to train with ``find_unused_parameters=True`` and
    with ``static_graph=True`` (printing ``trained 2 steps with {...}`` after each) and then to fail with DDP's
    defaults; print DDP's message and claim both."""
    from ..exercises.ranks import function_source, run_on_ranks

    outcomes, error = run_on_ranks("ddp_train", function_source(train, "train"), "train", nproc)
    logs = [(error.run_dir / f"rank{k}.log").read_text() if error and error.run_dir else "" for k in range(nproc)]
    failed = [o["error"] for o in outcomes.values() if "error" in o]
    message = failed[0]["message"] if failed else ""
    first = message.split(". ")[0] + "." if message else "(no error)"
    print(f"DDP's defaults, step 2: {failed[0]['type'] if failed else 'no error'}: {first}")
    advice = re.search(r"You can enable unused parameter detection by passing the keyword argument `[^`]+`", message)
    if advice:
        print(f"  ... {advice.group(0)} ...")
    claim("with find_unused_parameters=True and with static_graph=True, every rank trained 2 steps of the model "
          "whose spare parameter gets no gradient",
          all("trained 2 steps with {'find_unused_parameters': True}" in log
              and "trained 2 steps with {'static_graph': True}" in log for log in logs))
    claim("with DDP's defaults, the next forward stopped with its RuntimeError: the previous step's reduction never "
          "finished, and it names find_unused_parameters",
          bool(failed) and all(e["type"] == "RuntimeError" and "Expected to have finished reduction" in e["message"]
                               and "find_unused_parameters" in e["message"] for e in failed))


# -- pitfalls --------------------------------------------------------------------------------------------------

def warmup_lr_default_type(lr_schedules_source: str) -> str | None:
    """The default of ``warmup_type`` in ``WarmupLR.__init__`` of DeepSpeed's ``runtime/lr_schedules.py`` (read
    from the source, resolving a module-level constant)."""
    tree = ast.parse(lr_schedules_source)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
    init = next((f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "WarmupLR"
                 for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is None:
        return None
    defaults = dict(zip([a.arg for a in init.args.args[-len(init.args.defaults):]], init.args.defaults))
    value = defaults.get("warmup_type")
    if isinstance(value, ast.Name):
        return constants.get(value.id)
    return value.value if isinstance(value, ast.Constant) else None


def claim_errata_facts() -> None:
    """Rows 8, 9 and 13 read off the installed DeepSpeed's source files (without importing it, so the kernel stays
    light), and row 18 from the ZeRO formula."""
    ds_dir = Path(importlib.util.find_spec("deepspeed").submodule_search_locations[0])
    warmup_type = warmup_lr_default_type((ds_dir / "runtime" / "lr_schedules.py").read_text())
    print(f"WarmupLR's default warmup_type: {warmup_type!r}")
    claim("row 13: WarmupLR's default warmup_type is 'log', not linear", warmup_type == "log")
    claim("row 8: DeepSpeed's engine has no data_iterator",
          "data_iterator" not in (ds_dir / "runtime" / "engine.py").read_text())
    claim("row 9: the deepspeed launcher passes --local_rank=N to each rank",
          "--local_rank=" in (ds_dir / "launcher" / "launch.py").read_text())
    claim("row 18: the bf16 weights alone fit (16 GB < 80 GB), training's model states do not (~128 GB)",
          2 * 8.03e9 < 80e9 < memory.zero_model_state_bytes(8.03e9, world_size=1, stage=0)["total"])
