"""Mixture of experts and expert parallelism: the formulas (helpers/calc/moe.py), the router, capacity and
load-balancing loss on one process (helpers/rank/moe.py), the EP path on a one-rank group against the one-process
layer, the degree rules course/gpt_moe.py declares, and real launches at 2 and 4 ranks held to one process, to the
byte formula, and to where each gradient is averaged (dense over every rank, an expert's over its dp replicas)."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import launch
from helpers.calc import mesh
from helpers.calc import moe as calc
from helpers.launch import Machine
from helpers.launch.spec import _launch_defaults, _launch_rules
from helpers.rank import moe
from helpers.rank.gpt import GPT, GPTConfig

SCRIPT = launch.PROJECT_ROOT / "course" / "gpt_moe.py"
CPU = Machine(gpus=0, cpus=8)


# ---------------------------------------------------------------------------------------------- formulas


def test_capacity_rounds_up_and_the_rank_and_calc_agree():
    assert calc.capacity(384, 2, 4, 1.25) == 240 and calc.capacity(10, 1, 4, 1.0) == 3
    for t, k, e, f in [(384, 2, 8, 1.25), (7, 1, 3, 0.5), (100, 3, 5, 2.0)]:
        assert calc.capacity(t, k, e, f) == moe.capacity(t, k, e, f) == math.ceil(f * t * k / e)
    with pytest.raises(ValueError, match="> 0"):
        calc.capacity(10, 1, 4, 0)


def test_uniform_routing_sends_w_minus_1_over_w_of_the_assignments_in_each_of_four_all_to_alls():
    one = 384 * 2 * 96 * 4
    out = calc.uniform_bytes_per_layer(384, 2, 96, 4)
    assert out == {x: {"forward": one * 3 / 4, "backward": one * 3 / 4} for x in ("dispatch", "combine")}
    assert calc.uniform_bytes_per_layer(384, 2, 96, 1)["dispatch"]["forward"] == 0


def test_measured_bytes_pair_the_dispatch_forward_with_the_combine_backward():
    counts = [[3, 1, 2, 0], [0, 4, 1, 1]]  # rank 0 and rank 1's kept assignments per expert, 2 experts per rank
    assert calc.rows_exchanged(counts, 0, 2) == (2, 4) and calc.rows_exchanged(counts, 1, 2) == (4, 2)
    b = calc.measured_bytes_per_layer(2, 4, 96, 4)
    assert b["dispatch"]["forward"] == b["combine"]["backward"] == 2 * 96 * 4
    assert b["combine"]["forward"] == b["dispatch"]["backward"] == 4 * 96 * 4
    assert calc.count_bytes_per_layer(8, 4) == 8 * 8 * 3 // 4


def test_parameters_total_active_and_per_rank_match_the_built_model():
    cfg = GPTConfig(vocab_size=29, seq_len=16, n_layer=2, n_head=4, d_model=32)
    model = moe.moeify(GPT(cfg), 8, 2, 1.25, seed=0)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".mlp." not in n)
    counts = calc.parameters(dense, 2, 32, 8, 2, ep=4)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["active"] == dense + 2 * (32 * 8 + 2 * 8 * 32 * 32)
    assert counts["total"] - counts["per_rank"] == 2 * 6 * calc.expert_parameters(32)
    assert calc.imbalance([1, 1, 1, 1]) == 1 and calc.imbalance([4, 0, 0, 0]) == 4


# ---------------------------------------------------------------------------------------------- one process


def test_first_choices_are_served_before_second_ones_and_the_rest_dropped():
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [2.0, 3.0, 0.0], [3.0, 2.0, 0.0]])
    _, gates, ids, keep, routed, _ = moe.route(logits, 2, capacity_factor=0.75)  # capacity ceil(0.75 4 2 / 3) = 2
    assert ids[:, 0].tolist() == [0, 0, 1, 0] and routed.tolist() == [4, 3, 1]
    # expert 0: tokens 0 and 1's first choices fit, token 3's first choice is over, token 2's second choice too
    assert keep.tolist() == [[True, True], [True, True], [True, False], [False, False]]
    assert torch.allclose(gates, logits.softmax(-1).topk(2).values)


def test_the_load_balancing_loss_is_1_when_uniform_and_e_when_one_expert_takes_everything():
    uniform = torch.eye(4).repeat(2, 1) * 50.0  # each expert the choice of 2 of the 8 tokens, P_e = 1/4
    assert moe.route(uniform, 1, 10.0)[-1].item() == pytest.approx(1.0, abs=1e-5)
    collapsed = torch.zeros(8, 4).index_fill_(1, torch.tensor([0]), 50.0)
    assert moe.route(collapsed, 1, 10.0)[-1].item() == pytest.approx(4.0, abs=1e-5)


def test_the_moe_output_is_the_gated_sum_of_kept_experts_and_dropped_tokens_get_zero():
    torch.manual_seed(0)
    layer = moe.MoE(16, 4, top_k=2, capacity_factor=0.25, groups=2).double()  # 1 slot per expert and group
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    moe.STATS.reset()
    y = layer(x).reshape(-1, 16)
    expected, skipped = torch.zeros_like(y), []
    for g, rows in enumerate(x.reshape(-1, 16).chunk(2)):  # capacity per group of 6 tokens
        _, gates, ids, keep, _, _ = moe.route(layer.router(rows), 2, 0.25)
        skipped += [g * 6 + t for t in range(6) if not keep[t].any()]
        for t in range(6):
            for c in range(2):
                if keep[t, c]:
                    expected[g * 6 + t] += gates[t, c] * layer.experts[str(int(ids[t, c]))](rows[t])
    assert torch.allclose(y, expected, atol=1e-12)
    dropped = moe.STATS.dropped
    assert dropped >= 2 * (12 - 4) and sum(moe.STATS.processed.values()) == 2 * 6 * 2 - dropped
    assert sum(moe.STATS.routed) == 2 * 6 * 2 and all(n <= 2 for n in moe.STATS.processed.values())  # 1 per group
    assert len(skipped) >= 2 * 2 and (y[skipped] == 0).all()  # 4 slots for 6 tokens: their residual alone carries them


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A gloo group of one rank in this process (nothing launched): the EP path's exchanges run, to itself."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_the_expert_parallel_path_equals_the_one_process_layer_forward_and_backward(one_rank_group):
    cfg = GPTConfig(vocab_size=29, seq_len=16, n_layer=2, n_head=4, d_model=32)
    one, ep = (moe.moeify(torch.manual_seed(0) and GPT(cfg).double(), 4, 2, 1.0, seed=0, group=group)
               for group in (None, one_rank_group))  # the same dense weights (seeded), the same experts
    x, y = torch.randint(0, 29, (3, 16)), torch.randint(0, 29, (3, 16))
    losses = [moe.loss_of(m, x, y, 0.01) for m in (one, ep)]
    for loss in losses:
        loss.backward()
    assert losses[0].item() == pytest.approx(losses[1].item(), abs=1e-12)
    for (name, a), (_, b) in zip(one.named_parameters(), ep.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-12), name
    assert set(moe.grad_norms(ep)["experts"]) == {"0", "1", "2", "3"}


# ---------------------------------------------------------------------------------------------- rules


def test_the_moe_script_declares_its_rules_and_its_defaults_match_its_parser(monkeypatch):
    import course.gpt_moe as script

    assert _launch_rules(SCRIPT) == script.LAUNCH_RULES and _launch_defaults(SCRIPT) == script.LAUNCH_DEFAULTS
    assert all(rule in mesh.RULES for rule in script.LAUNCH_RULES.values())
    monkeypatch.setattr("sys.argv", ["gpt_moe.py"])
    args = script.parse_args()
    assert {f: str(getattr(args, f[2:].replace("-", "_"))) for f in script.LAUNCH_DEFAULTS} == script.LAUNCH_DEFAULTS


@pytest.mark.parametrize("nproc, args, problem", [
    (4, ["--experts", "6"], "--experts 6 do not split over --ep 4 ranks"),
    (4, ["--experts", "6", "--ep", "4"], "--experts 6 do not split over --ep 4 ranks"),
    (4, ["--top-k", "3", "--experts", "2", "--dp", "2"], "--top-k 3 exceeds the 2 experts"),
    (4, ["--capacity-factor", "0"], "--capacity-factor 0 leaves the experts no room"),
    (4, ["--capacity-factor", "-1"], "--capacity-factor -1 leaves the experts no room"),
    (4, ["--dp", "2", "--ep", "4"], "--dp 2 x --ep 4 = 8 ranks, but the job has 4"),
    (4, ["--ep", "3"], "--ep 3 does not divide the 4 ranks"),
    (4, [], None), (2, [], None), (4, ["--dp", "2"], None), (4, ["--experts", "6", "--dp", "2"], None),
    (4, ["--top-k", "1", "--capacity-factor", "0.5"], None),
])
def test_bad_moe_input_is_refused_before_launch_and_good_input_passes(nproc, args, problem):
    if problem is None:
        assert launch.LaunchSpec.check("torchrun", SCRIPT, nproc, args, machine=CPU).nproc == nproc
        return
    with pytest.raises(launch.LaunchError, match=problem) as e:
        launch.LaunchSpec.check("torchrun", SCRIPT, nproc, args, machine=CPU)
    assert " use " in str(e.value)


def test_the_moe_script_refuses_the_same_input_inside_its_ranks_from_a_terminal(refused_in_rank):
    message = refused_in_rank(SCRIPT, ["--experts", "6", "--steps", "1"], world_size=4)
    assert "--experts 6 do not split over --ep 4 ranks" in message


# The real ranks (EP on 1-4 ranks: parity, bytes against the formula, experts and parameters per rank; EP x DP's
# gradients; DeepSpeed's layer beside the course's) are proven once, by notebook 13's claims under nbval
# (helpers/notebook/lessons/moe.py), which tests/test_lessons_moe.py holds to the formulas.


def test_renormalized_gates_of_a_token_sum_to_one_as_deepspeeds_top2_does():
    """``renormalize=True`` (DeepSpeed's and Mixtral's top-2): with every expert the same function, each token's output
    is that function's (its kept gates sum to 1); without it, the output is scaled by the sum of the top-2
    probabilities, below 1 with 4 experts."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8)
    for renormalize in (True, False):
        layer = moe.MoE(8, experts=4, top_k=2, capacity_factor=4.0, renormalize=renormalize)
        with torch.no_grad():
            for e in layer.experts.values():
                for p, q in zip(e.parameters(), layer.experts["0"].parameters()):
                    p.copy_(q)
        same = torch.allclose(layer(x), layer.experts["0"](x), atol=1e-6)
        assert same == renormalize
