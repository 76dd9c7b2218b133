"""Notebook 03's claims on DeepSpeed's own memory estimators (:mod:`helpers.notebook.lessons.zero` re-exports
them, so a cell calls ``zero.claim_estimator``): the estimate beside the ZeRO formula and the measured runs, its
terms (2P + 18P/N at stage 2, 4 x largest layer + 18P/N at stage 3) against the paper's formula and the t5-3b
figures of its documentation, and the host memory ``deepspeed.zero.Init`` saves.
"""
from __future__ import annotations

from ...calc import memory
from ..checks import claim

T5_3B = 2_851_000_000  # t5-3b as DeepSpeed's memory documentation prints it: "Model with 2851M total params"


# --- section 4: DeepSpeed's estimator -------------------------------------------------------------------------------

def estimator_table(params: int, largest: int, nproc: int, dtype: str, rows: list[dict]) -> dict:
    """DeepSpeed's own estimate (no offload) at stages 2 and 3 beside the formula and the rank measured holding
    most; returns ``{stage: per-GPU bytes}``."""
    from ...rank.deepspeed_facts import deepspeed_estimate
    estimates = {}
    precision = memory.precision_of(dtype)
    for stage in (2, 3):
        est = deepspeed_estimate(params, num_gpus_per_node=nproc, stage=stage, largest_layer_params=largest)
        plain = next(r for r in est["rows"] if r["options"].get("offload_optimizer") == "none"
                     and r["options"].get("offload_param", "none") == "none")
        estimates[stage] = plain["per_gpu_bytes"]
        formula = memory.zero_model_state_bytes(params, nproc, stage, precision,
                                                k=memory.deepspeed_k(stage, precision))["total"]
        measured = max(r["measured"]["total"] for r in rows if r["stage"] == stage)
        print(f"stage {stage}: formula ({dtype}) {formula / 2**20:7.1f} MiB | DeepSpeed estimate "
              f"{estimates[stage] / 2**20:7.1f} MiB | measured {measured / 2**20:7.1f} MiB per rank")
    return estimates


def deepspeed_terms(params: int, largest: int, nproc: int) -> dict:
    """DeepSpeed's estimator's terms: 2P + 18P/N at stage 2, 4 x largest layer + 18P/N at stage 3."""
    return {2: 2 * params + int(18 * params / nproc), 3: 4 * largest + int(18 * params / nproc)}


def claim_estimator(estimates: dict, params: int, largest: int, nproc: int) -> None:
    """The estimator is its terms exactly, larger than the paper's formula; the t5-3b figures, then and now."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    terms = deepspeed_terms(params, largest, nproc)
    claim("DeepSpeed's ZeRO-2 estimate for this model is exactly 2P + 18P/N bytes", estimates[2] == terms[2],
          measured=f"{estimates[2]:,} bytes")
    claim("its ZeRO-3 estimate is exactly 4 x largest layer + 18P/N bytes", estimates[3] == terms[3],
          measured=f"{estimates[3]:,} bytes")
    paper = {s: memory.zero_model_state_bytes(params, nproc, s, "mixed")["total"] for s in (2, 3)}
    claim("DeepSpeed's estimates are larger than the paper's mixed-precision formula at stages 2 and 3",
          all(estimates[s] > paper[s] for s in (2, 3)),
          measured=", ".join(f"stage {s}: {estimates[s] / paper[s]:.2f}x" for s in (2, 3)))
    installed = estimate_zero2_model_states_mem_needs(T5_3B, num_gpus_per_node=8, cpu_offload=False)[1]
    documented = 4 * T5_3B + int(16 * T5_3B / 8)
    print(f"t5-3b, ZeRO-2, 8 GPUs: installed estimator {installed / 2**30:.2f} GiB = 2P + 18P/N; "
          f"documentation {documented / 2**30:.2f} GiB = 4P + 16P/N")
    claim("the installed estimator gives 11.28 GiB for t5-3b (2P + 18P/N)",
          f"{installed / 2**30:.2f}" == "11.28" and installed == deepspeed_terms(T5_3B, 0, 8)[2])
    claim("the documentation's 15.93 is 4P + 16P/N in GiB", f"{documented / 2**30:.2f}" == "15.93")


# --- section 4: deepspeed.zero.Init ---------------------------------------------------------------------------------

def zero_init_estimates(params: float, largest: float, gpus_per_node: int, nodes: int) -> dict:
    """DeepSpeed's ZeRO-3 estimator without offload, ``{zero_init: (host bytes per node, bytes per GPU)}``."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    out = {}
    for zero_init in (False, True):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(int(params), int(largest), gpus_per_node, nodes,
                                                           cpu_offload=False, cpu_offload_params=False,
                                                           zero_init=zero_init)
        out[zero_init] = (cpu, gpu)
    return out


def claim_zero_init(params: float = 7.5e9, largest: float = 225e6, gpus_per_node: int = 8, nodes: int = 8,
                    estimates: dict | None = None) -> None:
    """DeepSpeed's ZeRO-3 estimator (no offload) with and without ``zero.Init``: host memory per node is every
    process's whole fp32 model (4 bytes x P x GPUs per node) without it, only the largest layer (4 bytes x largest x
    GPUs per node) with it, both times DeepSpeed's 1.5 buffer factor; the GPU figure is the same. Prints both and
    claims those terms (``estimates``: :func:`zero_init_estimates`'s, computed when not given)."""
    out = estimates or zero_init_estimates(params, largest, gpus_per_node, nodes)
    for zero_init, (cpu, gpu) in out.items():
        print(f"zero.Init {'on ' if zero_init else 'off'}: host memory {cpu / 2**30:7.1f} GiB per node, "
              f"{gpu / 2**30:5.2f} GiB per GPU")
    claim(f"without zero.Init each of a node's {gpus_per_node} processes builds the whole fp32 model in host memory; "
          "with it, only the largest layer (DeepSpeed's estimator, x1.5 buffer factor), same GPU memory",
          out[False][0] == int(4 * int(params) * gpus_per_node * 1.5)
          and out[True][0] == int(4 * int(largest) * gpus_per_node * 1.5) and out[False][1] == out[True][1],
          measured=f"{out[False][0] / out[True][0]:.0f}x less host memory")
