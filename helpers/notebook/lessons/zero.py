"""Notebook 03 (DeepSpeed ZeRO): the verification behind its cells, so that a cell shows a launch or a table and this
module prints the claim lines.

What the chapter claims, and where it is checked here:

* the config builder writes the choices a learner clicks, and the validator accepts what it wrote (:func:`click`);
* DeepSpeed's CPU accelerator trains in bf16, and the course refuses fp16 there whatever oneDNN offers
  (:func:`claim_cpu_precision`);
* the defaults the chapter's table lists are the installed DeepSpeed's (:func:`claim_config_defaults`);
* the four stage runs trained the same model on every rank (:func:`claim_stage_runs`), and each rank's measured model
  states match the ZeRO formula, stage 2 from above (:func:`claim_memory`);
* at stage 2 a rank keeps the whole gradient of every parameter tensor its partition touches, which is why a model
  with one dominant layer (SimpleCNN) keeps nearly the whole gradient (:func:`zero2_gradient_bytes`,
  :func:`claim_zero2_snapshot`);
* DeepSpeed's estimator is 2P + 18P/N (stage 2) and 4 x largest layer + 18P/N (stage 3) (:func:`claim_estimator`,
  in :mod:`helpers.notebook.lessons.zero_estimator` with the ``zero.Init`` claim; re-exported here);
* every rank writes its own shard of a checkpoint, warmup follows the config, and the consolidated fp32 weights score
  what the ranks scored (:func:`claim_checkpoint`, :func:`consolidated_accuracy`).

Example (notebook cells)::

    from helpers.notebook.lessons import zero
    rows = zero.memory_table(stage_runs, params, nproc, DTYPE)
    zero.claim_memory(rows, nproc)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ...calc import memory
from ...rank import metrics
from ..checks import claim
# DeepSpeed's estimators (section 4) live in zero_estimator.py; notebook 03 calls them through this module
from .zero_estimator import (T5_3B, claim_estimator, claim_zero_init, deepspeed_terms,  # noqa: F401
                             estimator_table, zero_init_estimates)

STAGES = (0, 1, 2, 3)


def shown(path) -> str:
    """A path as the course prints it: relative to the course root or the runs folder (no machine prefix)."""
    from ... import launch
    path = Path(path).resolve()
    for root, name in ((launch.PROJECT_ROOT.resolve(), ""), (launch.runs_root().resolve(), "<runs>/")):
        if path.is_relative_to(root):
            return name + str(path.relative_to(root))
    return path.name


# --- section 2: the config ------------------------------------------------------------------------------------------

def click(builder, world_size: int, **choices) -> dict:
    """Set the builder's controls as a learner would click them, press "write", print the file, and claim that the
    file holds the choices and that the validator accepts it. Returns the config written."""
    from ...calc import dsconfig
    from ...rank.deepspeed_facts import validate_config
    for name, value in choices.items():
        builder.controls[name].value = value
    written = builder.write()
    print(f"written to {shown(written)}:")
    print(Path(written).read_text())
    config = dsconfig.load(written)
    zero_section = config["zero_optimization"]
    offload = {"optimizer": {"offload_optimizer": {"device": "cpu"}}}.get(choices.get("offload"), {})
    claim("the builder wrote the non-default choices",
          zero_section["stage"] == choices["stage"]
          and config.get(choices["dtype"], {}).get("enabled") is True
          and config["gradient_accumulation_steps"] == choices["accumulation"]
          and all(zero_section.get(k) == v for k, v in offload.items())
          and config["scheduler"]["params"]["warmup_num_steps"] == choices["warmup_steps"])
    claim("written and accepted by the validator", validate_config(config, world_size) == [])
    return config


def claim_cpu_precision() -> None:
    """Ask DeepSpeed's CPU accelerator (in a subprocess: this kernel imports no accelerator) whether it supports
    fp16 and bf16, and claim bf16 is supported and the course refuses fp16 on the CPU either way."""
    from ...rank.deepspeed_facts import validate_config
    probe = subprocess.run([sys.executable, "-c", "from deepspeed.accelerator import get_accelerator as g; "
                            "print(g().is_fp16_supported(), g().is_bf16_supported())"],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    cpu_fp16, cpu_bf16 = probe.stdout.split()[-2:]
    claim("DeepSpeed's CPU accelerator supports bf16 here", cpu_bf16 == "True")
    claim("the course validator refuses fp16 on the CPU accelerator, whatever oneDNN offers",
          any("fp16" in problem for problem in validate_config(
              {"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True}}, 2, accelerator="cpu")),
          measured=f"is_fp16_supported() = {cpu_fp16}")


ZERO_DEFAULTS = {"overlap_comm": None, "contiguous_gradients": True, "allgather_partitions": True,
                 "allgather_bucket_size": 5e8, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                 "use_multi_rank_bucket_allreduce": True}
FP16_DEFAULTS = {"loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
BLOG_ZERO = {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
             "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True}


def claim_config_defaults() -> None:
    """Read the table's defaults off the installed DeepSpeed's config models, print them, and claim the table."""
    from deepspeed.runtime import constants
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from ...rank.deepspeed_facts import validate_config
    zero_fields, fp16_fields = DeepSpeedZeroConfig.model_fields, DeepSpeedFP16Config.model_fields
    read = {k: zero_fields[k].default for k in ZERO_DEFAULTS} | \
        {f"fp16.{k}": fp16_fields[k].default for k in FP16_DEFAULTS}
    read["steps_per_print"] = constants.STEPS_PER_PRINT_DEFAULT
    for key, value in read.items():
        print(f"{key:34s} {value!r}")
    claim("the zero_optimization defaults in the table are the installed DeepSpeed's",
          all(zero_fields[k].default == v for k, v in ZERO_DEFAULTS.items()))
    claim("overlap_comm's default resolves to false at stages 1-2 and true at stage 3",
          [DeepSpeedZeroConfig(stage=s).overlap_comm for s in (1, 2, 3)] == [False, False, True])
    claim("the fp16 loss-scaler defaults in the table are the installed DeepSpeed's",
          all(fp16_fields[k].default == v for k, v in FP16_DEFAULTS.items()))
    claim("steps_per_print is off (None) unless set", constants.STEPS_PER_PRINT_DEFAULT is None)
    claim("gradient_clipping defaults to 1.0: without the key, DeepSpeed clips",
          constants.GRADIENT_CLIPPING_DEFAULT == 1.0)
    claim("the blog's zero_optimization section is valid for the installed DeepSpeed",
          DeepSpeedZeroConfig(**BLOG_ZERO).reduce_bucket_size == 2e8 and validate_config(
              {"train_micro_batch_size_per_gpu": 16, "zero_optimization": BLOG_ZERO, "steps_per_print": 10},
              None) == [])


# --- sections 3 and 4: the stage runs and their memory --------------------------------------------------------------

def final_loss(run) -> float:
    """Rank 0's loss at its last step."""
    return metrics.steps(run.metrics, 0)[-1]["loss"]


def claim_stage_runs(stage_runs: dict, nproc: int) -> None:
    """The stage runs trained the same model, on every rank, at the stage each was asked for."""
    claim("every stage trained the same model", len({run.result["params"] for run in stage_runs.values()}) == 1)
    claim("every stage ran on every rank",
          all(sorted(run.results_by_rank()) == list(range(nproc)) for run in stage_runs.values()))
    claim("every stage reported the stage it was asked for",
          all(run.result["zero_stage"] == s for s, run in stage_runs.items()))


def memory_rows(stage_runs: dict, params: int, nproc: int, dtype: str) -> list[dict]:
    """One row per stage and rank: the measured model-state bytes beside the formula's
    (:func:`helpers.calc.memory.compare_to_formula`)."""
    rows = []
    for stage, run in stage_runs.items():
        for rank, res in sorted(run.results_by_rank().items()):
            cmp = memory.compare_to_formula(res["model_state_bytes"], params, nproc, stage, dtype)
            rows.append({"stage": stage, "rank": rank, "measured": res["model_state_bytes"], **cmp})
    return rows


def memory_table(stage_runs: dict, params: int, nproc: int, dtype: str) -> list[dict]:
    """Print :func:`memory_rows` in MiB (measured / formula) and plot the rank holding most per stage."""
    from .. import plots
    rows = memory_rows(stage_runs, params, nproc, dtype)
    print(f"{params:,} parameters, {nproc} ranks, {dtype}; MiB per rank (measured / formula)")
    print("stage rank    params            grads             optimizer          total            ratio")
    for row in rows:
        m, f = row["measured"], row["formula"]
        cells = "  ".join(f"{m[k] / 2**20:7.1f}/{f[k] / 2**20:7.1f}" for k in ("params", "grads", "optimizer", "total"))
        print(f"{row['stage']:>5} {row['rank']:>4}  {cells}  {row['ratio']['total']:.3f}")
    fig = plots.memory_by_stage(rows)
    fig.axes[0].set_xlabel("ZeRO stage (the rank holding most; left bar measured, right bar formula)")
    return rows


def within_formula(row: dict) -> bool:
    """Stages 0, 1, 3: measured / formula within 5%, for the total and for each part (parameters, gradients,
    optimizer states: each partitioned as the paper says). Stage 2: at least the formula (a rank also keeps the
    whole gradient of every parameter straddling its partition: :func:`zero2_gradient_bytes` predicts it)."""
    ratio = row["ratio"]
    if row["stage"] == 2:
        return ratio["total"] >= 0.99
    return all(abs(ratio[part] - 1) <= 0.05 for part in ("total", "params", "grads", "optimizer"))


def claim_memory(rows: list[dict], nproc: int) -> None:
    """Every rank within the formula (:func:`within_formula`); each stage holds less than the one before (with one
    rank, stages 1-3 hold the same: there is nothing to partition across)."""
    stages = sorted({r["stage"] for r in rows})
    claim("measured / formula within 5% at stages 0, 1 and 3, and at least the formula at stage 2, for every rank",
          all(within_formula(row) for row in rows),
          measured=", ".join(f"stage {s} up to {max(r['ratio']['total'] for r in rows if r['stage'] == s):.3f}"
                             for s in stages))
    totals = {s: max(r["measured"]["total"] for r in rows if r["stage"] == s) for s in stages}
    if nproc > 1:
        ordered = all(totals[a] > totals[b] for a, b in zip(stages, stages[1:]))
    else:
        ordered = max(totals[s] for s in (1, 2, 3)) <= 1.01 * min(totals[s] for s in (1, 2, 3))
    claim("with more than one rank each stage holds less than the one before; with one rank, stages 1-3 hold the same",
          stages == list(STAGES) and ordered,
          measured=" > ".join(f"{totals[s] / 2**20:.1f}" for s in stages) + " MiB")


# --- section 4: the ZeRO-2 snapshot ---------------------------------------------------------------------------------

def zero2_gradient_bytes(sizes: list[int], world_size: int, rank: int, bytes_per_grad: int) -> int:
    """Gradient bytes a ZeRO-2 rank keeps: every parameter tensor (``sizes``: their element counts, in the engine's
    order) that overlaps the rank's 1/N of the flat parameters, whole, not just the overlapping slice.

    Example::

        zero2_gradient_bytes([10, 90], world_size=2, rank=0, bytes_per_grad=2)  # 200: the 90 straddles the middle
    """
    part = -(-sum(sizes) // world_size)
    lo, hi, start, held = rank * part, (rank + 1) * part, 0, 0
    for n in sizes:
        held += n if start < hi and start + n > lo else 0
        start += n
    return held * bytes_per_grad


def zero2_snapshot(models: dict, nproc: int, dtype: str) -> dict:
    """``{label: (model, run)}`` (models on the meta device will do: shapes only) -> per-parameter bytes of rank 0
    and whether each rank's gradients are what :func:`zero2_gradient_bytes` predicts. Prints one line per rank."""
    grad_bytes = 4 if dtype == "fp32" else 2
    per_param, matches = {}, []
    for label, (model, run) in models.items():
        n_params = run.result["params"]
        sizes = [p.numel() for p in model.parameters()]
        share = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) / n_params
        for rank, res in sorted(run.results_by_rank().items()):
            measured = res["model_state_bytes"]
            predicted = zero2_gradient_bytes(sizes, nproc, rank, grad_bytes)
            matches.append(abs(measured["grads"] - predicted) <= 0.01 * predicted)
            print(f"{label:24s} rank {rank}: bytes per parameter: weights {measured['params'] / n_params:.2f}, "
                  f"gradients {measured['grads'] / n_params:.2f} (predicted {predicted / n_params:.2f}), "
                  f"optimizer {measured['optimizer'] / n_params:.2f}, total {measured['total'] / n_params:.2f}; "
                  f"largest layer {share:.0%} of the parameters")
        rank0 = run.results_by_rank()[0]["model_state_bytes"]
        per_param[label] = {k: rank0[k] / n_params for k in ("params", "grads", "optimizer", "total")}
    return {"per_param": per_param, "matches": matches,
            "buffers": [res["model_state_bytes"].get("buffers") for _, run in models.values()
                        for res in run.results_by_rank().values()]}


def claim_zero2_snapshot(snapshot: dict, cnn_fc1_share: float, nproc: int, dtype: str) -> None:
    """The ZeRO-2 claims: ``snapshot`` from :func:`zero2_snapshot` with the MLP first and the CNN second;
    ``cnn_fc1_share`` the fraction of SimpleCNN's parameters in ``fc1``."""
    mlp, cnn = snapshot["per_param"].values()
    matches = snapshot["matches"]
    claim("each rank's measured gradient bytes are the gradients of the parameter tensors its partition touches "
          "(within 1%), in both models", bool(matches) and all(matches),
          measured=f"{sum(matches)}/{len(matches)} ranks")
    claim("weights and optimizer state per parameter are the same in both models (within 2%)",
          all(abs(mlp[k] - cnn[k]) <= 0.02 * cnn[k] for k in ("params", "optimizer")),
          measured=f"MLP {mlp['params']:.2f} + {mlp['optimizer']:.2f}, "
                   f"CNN {cnn['params']:.2f} + {cnn['optimizer']:.2f}")
    claim("SimpleCNN's largest layer (fc1) holds over 90% of its parameters", cnn_fc1_share > 0.9)
    claim("so the CNN holds at least as many bytes per parameter as the MLP, and the difference is gradients",
          cnn["total"] >= mlp["total"] - 0.01
          and abs((cnn["total"] - mlp["total"]) - (cnn["grads"] - mlp["grads"])) <= 0.05,
          measured=f"CNN {cnn['total']:.2f}, MLP {mlp['total']:.2f} bytes per parameter (rank 0)")
    w = g = 4 if dtype == "fp32" else 2  # bytes of a weight and of a gradient
    whole, formula = w + g + 12 / nproc, w + (g + 12) / nproc
    claim("the CNN's ZeRO-2 snapshot comes to about w + g + 12/N bytes per parameter (within 3%): nearly the whole "
          "gradient", abs(cnn["total"] - whole) <= 0.03 * whole,
          measured=f"{cnn['total']:.2f} vs {whole:.2f} at N={nproc}, {dtype}")
    claim("the MLP's comes to at least the formula w + (g + 12)/N and no more than the CNN's",
          0.99 * formula <= mlp["total"] <= cnn["total"] + 0.01, measured=f"{mlp['total']:.2f}, formula {formula:.2f}")
    claim("no communication buckets are held at the snapshot (buffers = 0 on every rank, both models)",
          all(b == 0 for b in snapshot["buffers"]))


# --- section 5: checkpoints, warmup -----------------------------------------------------------------------------------

def show_run(run, ckpt_dir) -> None:
    """Rank 0's own lines of a run (DeepSpeed's start-up warnings left out) and the checkpoint folder."""
    for line in run.log(0).splitlines():
        if line.startswith(("Dataset:", "world_size=", "epoch ", "test accuracy")):
            print(line)
    print(f"{shown(ckpt_dir)}:", sorted(p.name for p in Path(ckpt_dir).iterdir()))


def warmup_then_flat(lr: list[float], warmup: int, peak: float) -> bool:
    """True when ``lr`` starts below ``peak``, never falls during the ``warmup`` steps, then holds at ``peak``."""
    return (len(lr) > warmup + 1 and lr[0] < peak and all(a <= b for a, b in zip(lr[:warmup + 1], lr[1:warmup + 2]))
            and all(abs(x - peak) < 1e-12 for x in lr[warmup + 1:]))


def claim_checkpoint(ckpt_dir, run, config: dict, nproc: int) -> None:
    """One model-state and one optimizer shard per rank in the latest checkpoint; the rate warmed up as configured."""
    ckpt_dir = Path(ckpt_dir)
    shards = sorted(p.name for p in (ckpt_dir / (ckpt_dir / "latest").read_text().strip()).iterdir())
    claim("one model-state shard and one optimizer shard per rank",
          len([s for s in shards if s.endswith("model_states.pt")]) == nproc
          == len([s for s in shards if s.endswith("optim_states.pt")]))
    lr = [r["lr"] for r in metrics.steps(run.metrics, 0)]
    warmup, peak = config["scheduler"]["params"]["warmup_num_steps"], config["optimizer"]["params"]["lr"]
    claim("learning rate rose from 0 during warmup, never falling, and then held at the configured value",
          warmup_then_flat(lr, warmup, peak), measured=f"{len(lr)} steps, warmup {warmup}")


def consolidated_accuracy(ckpt_dir, train_size: int, run) -> float:
    """Gather the checkpoint's shards into one fp32 ``state_dict`` with ``course/ds_consolidate.py`` (a separate
    process: it imports DeepSpeed), load it into a plain SimpleCNN and score it on the run's test set; prints it
    beside the accuracy the ranks of ``run`` reported."""
    import torch
    from torch.utils.data import DataLoader

    from ... import launch
    from ...rank.data import get_datasets
    from ...rank.models import SimpleCNN
    consolidated = Path(ckpt_dir) / "consolidated_fp32.pt"
    out = subprocess.run([sys.executable, "course/ds_consolidate.py", os.path.relpath(ckpt_dir, launch.PROJECT_ROOT),
                          os.path.relpath(consolidated, launch.PROJECT_ROOT)], capture_output=True, text=True,
                         timeout=300, cwd=launch.PROJECT_ROOT, check=True)
    print(out.stdout.strip().splitlines()[-1])
    model = SimpleCNN()
    model.load_state_dict(torch.load(consolidated, map_location="cpu"))
    model.eval()
    _, test_ds, _ = get_datasets("synthetic", launch.PROJECT_ROOT / "data", train_size=train_size, test_size=1000)
    with torch.no_grad():
        correct = sum((model(x).argmax(1) == y).sum().item() for x, y in DataLoader(test_ds, batch_size=500))
    accuracy = correct / len(test_ds)
    print(f"accuracy of the consolidated weights {accuracy:.4f}, "
          f"reported by the ranks {run.result['test_accuracy']:.4f}")
    return accuracy


def claim_consolidated(accuracy: float, run) -> None:
    """The consolidated weights score what the ranks reported."""
    claim("consolidated fp32 weights load into the plain model and reproduce the ranks' accuracy",
          abs(accuracy - run.result["test_accuracy"]) < 1e-6)
