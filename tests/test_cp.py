"""Context parallelism: the formulas (helpers/calc/cp.py), the layouts and the log-sum-exp merge on one process
(helpers/rank/cp.py: the ring simulated block by block, the reference the notebook's exercise is held to), the degree
rules course/gpt_cp.py declares. The real launches are notebook 12's, under nbval: ring (both layouts), Ulysses and
CP x DP on 4 ranks, each claimed against one process, the byte formula and the work pairs on every rank
(helpers/notebook/lessons/cp.py; tests/test_lessons_cp.py holds those claims to their faults)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import launch
from helpers.calc import cp as calc
from helpers.calc import mesh
from helpers.launch import Machine
from helpers.launch.spec import _launch_defaults, _launch_rules
from helpers.rank import cp
from helpers.rank.gpt import attention_core

SCRIPT = launch.PROJECT_ROOT / "course" / "gpt_cp.py"
CPU = Machine(gpus=0, cpus=8)


# ---------------------------------------------------------------------------------------------- formulas


def test_ring_sends_w_minus_1_kv_blocks_forward_and_twice_that_backward():
    block = 8 * 12 * 96 * 4  # b x s/W x h x fp32
    assert calc.ring_bytes_per_layer(8, 48, 96, 4) == {"forward": 3 * 2 * block, "backward": 3 * 4 * block}
    assert calc.ring_bytes_per_layer(8, 48, 96, 1) == {"forward": 0, "backward": 0}


def test_ulysses_sends_four_all_to_alls_each_way_and_w_over_2_less_than_the_ring():
    local = 8 * 12 * 96 * 4
    assert calc.ulysses_bytes_per_layer(8, 48, 96, 4) == {"forward": 4 * local * 3 / 4, "backward": 4 * local * 3 / 4}
    for w in (2, 4, 8):
        ring, uly = calc.bytes_per_step("ring", 2, 8, 48, 96, w), calc.bytes_per_step("ulysses", 2, 8, 48, 96, w)
        assert ring["forward"] / uly["forward"] == pytest.approx(w / 2)
        assert ring["backward"] / uly["backward"] == pytest.approx(w)


def test_contiguous_causal_work_grows_with_the_rank_and_zigzag_is_balanced_with_the_same_total():
    for w in (2, 3, 4, 8):
        contiguous, zigzag = calc.causal_work_pairs(48, w, "contiguous"), calc.causal_work_pairs(48, w, "zigzag")
        assert sum(contiguous) == sum(zigzag) == (w + 1) * 48 * 48 // (2 * w)
        assert calc.imbalance(contiguous) == pytest.approx(2 * w / (w + 1)) and calc.imbalance(zigzag) == 1
    assert calc.ulysses_work_pairs(48, 4) == [48 * 48 / 4] * 4


def test_activations_per_rank_are_chapter_08s_formula_at_s_over_w():
    from helpers.calc.activations import layer_bytes

    ring = calc.activation_bytes_per_rank(48, 8, 96, 12, 4, n_layer=2, vocab=29)
    assert ring["layers"] == 2 * layer_bytes(12, 8, 96, 12, "fp32", "sdpa")
    # Ulysses' attention sees the whole sequence for 12 / 4 heads: its s^2 softmax divides by cp, not cp^2
    terms = calc.layer_terms_per_rank(48, 8, 96, 12, 4, attention="ulysses")
    assert terms["softmax output (a / cp heads, whole sequence)"] == 4 * 3 * 48 * 48 * 8 and "logsumexp" not in terms
    assert calc.layer_terms_per_rank(48, 8, 96, 12, 4, attention="ulysses", core="sdpa") == \
        calc.layer_terms_per_rank(48, 8, 96, 12, 4)
    with pytest.raises(ValueError, match="does not split"):
        calc.ring_bytes_per_layer(8, 50, 96, 4)


# ---------------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_layout_indices_round_trip_and_cover_every_position_once(layout):
    x = torch.arange(2 * 48).view(2, 48)
    parts = [cp.shard_sequence(x, layout, 4, r) for r in range(4)]
    assert sorted(torch.cat(parts, 1)[0].tolist()) == list(range(48))
    assert torch.equal(cp.unshard_sequence(parts, layout), x)
    assert cp.zigzag_positions(16, 4, 1) == [2, 3, 12, 13]  # chunks 1 and 2W-1-1 = 6 of 8


def test_merging_blocks_by_log_sum_exp_equals_one_softmax_over_all_keys():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, dtype=torch.float64) for _ in range(3))
    q = q * 30  # large scores: exp would overflow without the running max
    pos = torch.arange(8)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for cols in (slice(0, 3), slice(3, 8)):
        rows, bo, bl, _ = cp.block_attention(q, k[..., cols, :], v[..., cols, :], pos, pos[cols], causal=False)
        out, lse = cp.merge_blocks(out, lse, bo, bl)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-12)
    assert torch.allclose(lse, torch.logsumexp(q @ k.transpose(-2, -1) / 2, -1), atol=1e-12)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_simulated_ring_equals_causal_attention_and_its_work_the_formula(layout, world):
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 16, 8, dtype=torch.float64) for _ in range(3))
    out, work = cp.simulate_ring(q, k, v, world, layout)
    assert torch.allclose(out, attention_core(q, k, v, "math"), atol=1e-12)
    assert work == calc.causal_work_pairs(16, world, layout)


def test_blocks_wholly_in_the_future_are_skipped_and_half_visible_ones_cut():
    pos = [cp.contiguous_positions(16, 4, r) for r in range(4)]
    assert cp.visible_block(pos[0], pos[1], causal=True) is None
    assert cp.visible_block(pos[2], pos[1], causal=True) == (slice(0, 4), slice(0, 4), False)
    zz = [cp.zigzag_positions(16, 4, r) for r in range(4)]
    assert cp.visible_block(zz[1], zz[3], causal=True) == (slice(2, 4), slice(0, 4), False)  # 2nd chunk sees all
    assert cp.visible_block(zz[3], zz[1], causal=True) == (slice(0, 4), slice(0, 2), False)  # all see its 1st chunk


# ---------------------------------------------------------------------------------------------- rules


def test_the_cp_script_declares_its_rules_and_its_defaults_match_its_parser(monkeypatch):
    import course.gpt_cp as script

    assert _launch_rules(SCRIPT) == script.LAUNCH_RULES and _launch_defaults(SCRIPT) == script.LAUNCH_DEFAULTS
    assert all(rule in mesh.RULES for rule in script.LAUNCH_RULES.values())
    monkeypatch.setattr("sys.argv", ["gpt_cp.py"])
    args = script.parse_args()
    assert {f: str(getattr(args, f[2:].replace("-", "_"))) for f in script.LAUNCH_DEFAULTS} == script.LAUNCH_DEFAULTS


@pytest.mark.parametrize("nproc, args, problem", [
    (4, ["--seq-len", "60"], "--seq-len 60 does not split into 2 x --cp 4 = 8 zigzag chunks"),
    (4, ["--seq-len", "50", "--layout", "contiguous"], "--seq-len 50 does not split into --cp 4 contiguous parts"),
    (4, ["--attn", "ulysses", "--n-head", "2"], "--n-head 2 heads do not split over --cp 4 ranks under --attn ulysses"),
    (4, ["--attn", "ulysses", "--n-head", "6"], "--n-head 6 heads do not split over --cp 4"),
    (4, ["--dp", "2", "--cp", "4"], "--dp 2 x --cp 4 = 8 ranks, but the job has 4"),
    (4, ["--cp", "3"], "--cp 3 does not divide the 4 ranks"),
    (4, ["--dp", "2", "--seq-len", "50"], "--seq-len 50 does not split into 2 x --cp 2 = 4 zigzag chunks"),
    (4, [], None), (3, [], None), (4, ["--dp", "2"], None), (4, ["--attn", "ulysses"], None),
    (4, ["--n-head", "2"], None), (4, ["--seq-len", "60", "--layout", "contiguous"], None),
])
def test_bad_cp_input_is_refused_before_launch_and_good_input_passes(nproc, args, problem):
    if problem is None:
        assert launch.LaunchSpec.check("torchrun", SCRIPT, nproc, args, machine=CPU).nproc == nproc
        return
    with pytest.raises(launch.LaunchError, match=problem) as e:
        launch.LaunchSpec.check("torchrun", SCRIPT, nproc, args, machine=CPU)
    assert " use " in str(e.value)


def test_the_script_refuses_the_same_input_inside_its_ranks_from_a_terminal(refused_in_rank):
    message = refused_in_rank(SCRIPT, ["--seq-len", "50", "--steps", "1"], world_size=4)
    assert "--seq-len 50 does not split into 2 x --cp 4 = 8 zigzag chunks" in message


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A gloo group of one rank in this process (nothing launched): the ring's own block, and torch's CP refusing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    dist.destroy_process_group()


def test_the_rings_hand_written_backward_passes_gradcheck_on_one_rank(one_rank_group):
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    group = one_rank_group.get_group()
    assert torch.autograd.gradcheck(lambda *t: cp.ring_attention(*t, group, layout="zigzag"), (q, k, v))
    assert torch.allclose(cp.ring_attention(q, k, v, group), attention_core(q, k, v, "math"), atol=1e-12)


def test_torchs_own_context_parallel_is_refused_on_cpu_with_the_reason(one_rank_group):
    with pytest.raises(RuntimeError, match=r"CUDA kernels .* on cpu causal SDPA runs aten\._scaled_dot_product_flash"
                                           r".* Use --attn ring or --attn ulysses on CPU"):
        cp.torch_context_parallel(one_rank_group, torch.device("cpu"))


def test_activation_bytes_wait_for_a_buffer_another_thread_lets_go_of_late(monkeypatch):
    """gloo's worker thread can hold a collective's buffer a moment past the call (ranks sharing cores): the count
    is the settled one. Here the "worker" lets go of a 4 KiB buffer while the rank waits between two reads. The
    fault: one read only, which counts the late buffer."""
    torch.manual_seed(0)
    model, held = torch.nn.Linear(8, 8), {}

    def forward():
        held["buffer"] = torch.empty(1024)  # 4 KiB that another thread still holds when the forward ends
        return model(torch.randn(4, 8))

    plain = cp.forward_activation_bytes(model, lambda: model(torch.randn(4, 8)))
    monkeypatch.setattr(cp.time, "sleep", lambda seconds: held.clear())  # the worker runs while this rank waits
    assert cp.forward_activation_bytes(model, forward) == plain
    monkeypatch.setattr(cp, "SETTLE_READS", 1)
    assert cp.forward_activation_bytes(model, forward) == plain + 4096
