"""helpers.calc.memory: the ZeRO paper's formulas, DeepSpeed's printed estimate parsed (run by the rank-side adapter,
helpers.rank.deepspeed_facts), and measured bytes per rank."""
import pytest
import torch

from helpers.calc import memory
from helpers.calc.memory import parse_estimate, zero_model_state_bytes
from helpers.rank.deepspeed_facts import deepspeed_estimate

GB = 1e9  # the paper's GB


# --------------------------------------------------------------------------------------------- formula


def test_paper_figure_1_headline_numbers():
    """Fig. 1 of arXiv:1910.02054: Psi = 7.5B parameters, N_d = 64, K = 12: 120, 31.4, 16.6 and 1.9 GB per device."""
    got = [round(zero_model_state_bytes(7.5e9, 64, stage)["total"] / GB, 1) for stage in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_paper_formulas_term_by_term():
    p, n = 1000.0, 4
    assert zero_model_state_bytes(p, n, 0) == {"params": 2 * p, "grads": 2 * p, "optimizer": 12 * p, "total": 16 * p}
    assert zero_model_state_bytes(p, n, 1)["total"] == 4 * p + 12 * p / n
    assert zero_model_state_bytes(p, n, 2)["total"] == 2 * p + 14 * p / n
    assert zero_model_state_bytes(p, n, 3)["total"] == 16 * p / n


def test_fp32_variant_has_4_byte_weights_and_gradients_and_k_8():
    p, n = 1000.0, 4
    assert [zero_model_state_bytes(p, n, s, "fp32")["total"] for s in range(4)] == [
        16 * p, 8 * p + 8 * p / n, 4 * p + 12 * p / n, 16 * p / n]


def test_one_rank_gains_nothing_from_any_stage():
    assert {zero_model_state_bytes(1e6, 1, s)["total"] for s in range(4)} == {16e6}


def test_deepspeed_k_is_12_except_fp32_at_stage_0():
    assert [memory.deepspeed_k(s, "fp32") for s in range(4)] == [8, 12, 12, 12]
    assert [memory.deepspeed_k(s, "mixed") for s in range(4)] == [12] * 4
    assert zero_model_state_bytes(100, 2, 1, "fp32", k=12)["optimizer"] == 600


@pytest.mark.parametrize("bad", [dict(stage=4), dict(precision="fp8"), dict(world_size=0)])
def test_formula_refuses_bad_input(bad):
    kw = dict(params=10, world_size=2, stage=1, precision="mixed") | bad
    with pytest.raises(ValueError):
        zero_model_state_bytes(**kw)


# --------------------------------------------------------------------------------------------- DeepSpeed's estimate

PRINTED = """Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 1 node, 2 GPUs per node.
SW: Model with 19M total params, 6M largest layer params.
  per CPU  |  per GPU |   Options
    0.50GB |   0.02GB | offload_param=OffloadDeviceEnum.cpu, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1
    0.17GB |   0.19GB | offload_param=none, offload_optimizer=none, zero_init=0
    0.20GB |   0.19GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0
"""


def test_printed_estimate_table_is_parsed_into_rows():
    rows = parse_estimate(PRINTED)
    assert rows == [
        {"per_cpu_gib": 0.50, "per_gpu_gib": 0.02,
         "options": {"offload_param": "cpu", "offload_optimizer": "cpu", "zero_init": 1}},
        {"per_cpu_gib": 0.17, "per_gpu_gib": 0.19,
         "options": {"offload_param": "none", "offload_optimizer": "none", "zero_init": 0}},
        {"per_cpu_gib": 0.20, "per_gpu_gib": 0.19,  # how Python < 3.11 prints the enum
         "options": {"offload_param": "cpu", "offload_optimizer": "cpu", "zero_init": 0}}]


def test_deepspeed_zero2_estimate_is_captured_and_matches_its_formula():
    p = 19_899_274
    est = deepspeed_estimate(p, num_gpus_per_node=2, stage=2)
    assert "Estimated memory needed" in est["text"]
    rows = {r["options"]["offload_optimizer"]: r for r in est["rows"]}
    assert set(rows) == {"cpu", "none"}
    assert rows["none"]["per_gpu_bytes"] == 2 * p + int(18 * p / 2)  # DeepSpeed's 18 = paper's 2 + 12, + 4
    for row in est["rows"]:
        assert row["per_gpu_gib"] == pytest.approx(row["per_gpu_bytes"] / 2**30, abs=0.006)
        assert row["per_cpu_gib"] == pytest.approx(row["per_cpu_bytes"] / 2**30, abs=0.006)


def test_deepspeed_zero3_estimate_has_six_option_rows_and_needs_the_largest_layer():
    with pytest.raises(ValueError, match="largest_layer_params"):
        deepspeed_estimate(10**9, 8, stage=3)
    est = deepspeed_estimate(10**9, 8, num_nodes=2, stage=3, largest_layer_params=10**7)
    assert len(est["rows"]) == 6
    no_offload = [r for r in est["rows"] if r["options"]["offload_optimizer"] == "none"]
    assert {r["per_gpu_bytes"] for r in no_offload} == {4 * 10**7 + int(18 * 10**9 / 16)}


def test_largest_layer_is_the_biggest_single_module():
    from helpers.rank.models import SimpleCNN
    assert memory.largest_layer_params(SimpleCNN()) == 64 * 8 * 8 * 128 + 128


# --------------------------------------------------------------------------------------------- measured


def test_tally_counts_each_storage_once_and_whole():
    from helpers.rank.state import _Tally
    tally = _Tally()
    flat = torch.zeros(100)
    tally.add("params", flat[:10], "view")       # a view costs its whole storage...
    tally.add("params", flat[50:], "other view")  # ...once
    tally.add("grads", torch.zeros(5, dtype=torch.bfloat16), "grad")
    tally.add("grads", torch.empty(3, device="meta"), "meta")  # no memory
    tally.add("grads", None, "absent")
    assert dict(tally.bytes) == {"params": 400, "grads": 10}
