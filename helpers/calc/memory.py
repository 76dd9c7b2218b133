"""Model-state memory per rank under ZeRO: the paper's formula, DeepSpeed's estimate, and what a rank really holds.

"Model states" are the parameters, their gradients and the optimizer state (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", arXiv:1910.02054, Sec. 3.1). With mixed-precision Adam
each parameter costs 2 bytes (fp16/bf16 weight) + 2 (its gradient) + K = 12 (fp32 master weight, momentum and
variance). ZeRO splits them over the N data-parallel ranks, one more kind per stage (Fig. 1):

    stage 0 (plain data parallel)       (2 + 2 + K) P
    stage 1 (optimizer state split)      4 P + K P / N
    stage 2 (+ gradients split)          2 P + (2 + K) P / N
    stage 3 (+ parameters split)         (4 + K) P / N

Pure calculations (no process group, no subprocess); the measured column lives on the rank side:

* :func:`zero_model_state_bytes` -- the formula (``precision="mixed"`` as above; ``"fp32"``: 4 + 4 + K = 8).
* :func:`deepspeed_estimate` -- DeepSpeed's own ``estimate_zero{2,3}_model_states_mem_needs_all_cold``, whose
  printed table is captured and parsed.
* :func:`compare_to_formula` -- what a rank measured (:func:`helpers.rank.state.model_state_bytes`) against the
  formula.

Example::

    zero_model_state_bytes(7.5e9, 64, stage=1)["total"] / 1e9     # 31.4 (GB; Fig. 1 of the paper)
"""
from __future__ import annotations

import contextlib
import io
import os
import re

PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}  # bytes per parameter: (weight, gradient, optimizer K)
STAGES = (0, 1, 2, 3)


def precision_of(dtype: str) -> str:
    """The formula's precision for a training dtype: "fp32" -> "fp32", "bf16"/"fp16" -> "mixed"."""
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype must be fp32, bf16 or fp16, got {dtype!r}")
    return "fp32" if dtype == "fp32" else "mixed"


def zero_model_state_bytes(params: float, world_size: int, stage: int, precision: str = "mixed", *,
                           k: float | None = None) -> dict:
    """Bytes of model states per rank by the ZeRO paper's formula: ``params``, ``grads``, ``optimizer``, ``total``.

    ``precision``: "mixed" (2-byte weights and gradients, K = 12: fp32 master copy + Adam m and v) or "fp32"
    (4-byte weights and gradients, K = 8: Adam m and v; the weights are their own master copy). ``k`` overrides K,
    e.g. ``k=deepspeed_k(stage, "fp32")`` for what DeepSpeed actually keeps in fp32.

    Example::

        zero_model_state_bytes(7.5e9, 64, stage=0)["total"]   # 1.2e11 = 120 GB, the paper's baseline
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if world_size < 1 or params < 0:
        raise ValueError(f"need world_size >= 1 and params >= 0, got {world_size} and {params}")
    weight, grad, default_k = PRECISIONS[precision]
    k = default_k if k is None else k
    n = world_size
    out = {"params": weight * params / (n if stage >= 3 else 1),
           "grads": grad * params / (n if stage >= 2 else 1),
           "optimizer": k * params / (n if stage >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def deepspeed_k(stage: int, precision: str) -> int:
    """The K (optimizer bytes per parameter) DeepSpeed 0.19 keeps: 12, except 8 for fp32 at stage 0.

    Stage 0 in fp32 hands the parameters to plain ``torch.optim.AdamW`` (m and v only). DeepSpeed's ZeRO
    optimizers (stages 1-3) always keep an fp32 master copy of their partition, even when the model is fp32
    (``single_partition_of_fp32_groups``, ``fp32_partitioned_groups_flat``), so K is 12 there as with mixed precision.
    """
    return 8 if precision == "fp32" and stage == 0 else 12


def largest_layer_params(model) -> int:
    """Parameters of the largest single module (what DeepSpeed's ZeRO-3 estimate calls the largest layer)."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


# --------------------------------------------------------------------------------------------- DeepSpeed's estimate

_ROW = re.compile(r"^\s*([\d.]+)GB\s*\|\s*([\d.]+)GB\s*\|\s*(.*?)\s*$")


def parse_estimate(text: str) -> list[dict]:
    """Rows of a printed DeepSpeed estimate: ``per_cpu_gib``, ``per_gpu_gib`` (as printed) and ``options``.

    Example::

        parse_estimate("    1.23GB |   0.45GB | offload_optimizer=OffloadDeviceEnum.cpu")
        # [{'per_cpu_gib': 1.23, 'per_gpu_gib': 0.45, 'options': {'offload_optimizer': 'cpu'}}]
    """
    rows = []
    for line in text.splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        options = {}
        for part in filter(None, (p.strip() for p in m[3].split(","))):
            key, _, value = part.partition("=")
            value = value.strip().removeprefix("OffloadDeviceEnum.")  # how Python 3.11+ formats DeepSpeed's enum
            options[key.strip()] = int(value) if value.isdigit() else value
        rows.append({"per_cpu_gib": float(m[1]), "per_gpu_gib": float(m[2]), "options": options})
    return rows


def deepspeed_estimate(params: int, num_gpus_per_node: int, num_nodes: int = 1, stage: int = 2, *,
                       largest_layer_params: int | None = None, additional_buffer_factor: float = 1.5) -> dict:
    """DeepSpeed's own model-state estimate for ZeRO stage 2 or 3, one row per offload option.

    Runs ``estimate_zero2_model_states_mem_needs_all_cold`` / ``estimate_zero3_..._all_cold`` (they print),
    captures the table, and returns ``{"text": <what it printed>, "rows": [...]}``. Each row has ``options``
    (offload_optimizer, and for stage 3 offload_param and zero_init), the printed ``per_cpu_gib``/``per_gpu_gib``,
    and the unrounded ``per_cpu_bytes``/``per_gpu_bytes`` from the same DeepSpeed function the printer calls.

    DeepSpeed's GPU column is not the paper's: without offload it charges 2P + 18P/N at stage 2 (the 18 adds an fp32
    gradient copy, 4 bytes, to the paper's 2 + 12) and 4 x largest layer + 18P/N at stage 3 (room to gather the
    biggest layer). Its CPU column is host memory for loading/offload, scaled by ``additional_buffer_factor``.

    Example::

        est = deepspeed_estimate(20_000_000, num_gpus_per_node=2, stage=3, largest_layer_params=6_500_000)
        print(est["text"]); est["rows"][-1]["per_gpu_bytes"]
    """
    if stage not in (2, 3):
        raise ValueError(f"DeepSpeed has estimators for stage 2 and 3 only, got stage={stage!r}")
    if stage == 3 and largest_layer_params is None:
        raise ValueError("stage 3 needs largest_layer_params (parameters of the biggest module; "
                         "helpers.calc.memory.largest_layer_params(model) counts them)")
    kw = dict(total_params=params, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes,
              additional_buffer_factor=additional_buffer_factor)
    buf = io.StringIO()
    # The estimators are arithmetic. Importing DeepSpeed picks an accelerator, and in a notebook kernel that must not
    # be CUDA (the kernel never touches the GPU; every rank is a subprocess, and helpers.launch sets the ranks' own).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs as exact,
                                                          estimate_zero2_model_states_mem_needs_all_cold as show)
        with contextlib.redirect_stdout(buf):
            show(**kw)
    else:
        from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs as exact,
                                                   estimate_zero3_model_states_mem_needs_all_cold as show)
        kw["largest_layer_params"] = largest_layer_params
        with contextlib.redirect_stdout(buf):
            show(**kw)
    rows = parse_estimate(buf.getvalue())
    for row in rows:
        opts = row["options"]
        extra = {"cpu_offload": opts.get("offload_optimizer") == "cpu"}
        if stage == 3:
            extra.update(cpu_offload_params=opts.get("offload_param") == "cpu", zero_init=bool(opts.get("zero_init")))
        cpu, gpu = exact(**kw, **extra)[:2]
        row.update(per_cpu_bytes=cpu, per_gpu_bytes=gpu)
    return {"text": buf.getvalue(), "rows": rows}


def compare_to_formula(measured: dict, params: int, world_size: int, stage: int, dtype: str) -> dict:
    """Measured bytes against the formula with DeepSpeed's K: ``formula`` (dict) and ``ratio`` (measured/formula).

    Example::

        compare_to_formula(run.results_by_rank()[1]["model_state_bytes"], 19_899_274, 2, stage=3, dtype="bf16")
    """
    precision = precision_of(dtype)
    formula = zero_model_state_bytes(params, world_size, stage, precision, k=deepspeed_k(stage, precision))
    ratio = {k: (measured[k] / formula[k] if formula[k] else float("nan")) for k in ("params", "grads",
                                                                                      "optimizer", "total")}
    return {"formula": formula, "ratio": ratio}
