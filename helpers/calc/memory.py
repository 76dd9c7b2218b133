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
* :func:`parse_estimate` -- the table DeepSpeed's own ``estimate_zero{2,3}_model_states_mem_needs_all_cold``
  prints, as rows (:func:`helpers.rank.deepspeed_facts.deepspeed_estimate` runs the estimator and captures it).
* :func:`compare_to_formula` -- what a rank measured (:func:`helpers.rank.state.model_state_bytes`) against the
  formula.

Example::

    zero_model_state_bytes(7.5e9, 64, stage=1)["total"] / 1e9     # 31.4 (GB; Fig. 1 of the paper)
"""
from __future__ import annotations

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
