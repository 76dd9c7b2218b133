"""helpers.notebook.lessons.moe: notebook 13's settings refuse what cannot run, and its claims say False when the
measurements contradict the prose (fake runs built from the formulas, then broken). The refusals run in-process."""
from __future__ import annotations

import re

import pytest

from helpers.calc import moe as calc
from helpers.notebook import checks
from helpers.notebook.lessons import moe as lesson

E, K, H, L, T = lesson.EXPERTS, lesson.TOP_K, lesson.D_MODEL, lesson.N_LAYER, 8 * lesson.SEQ_LEN
DENSE = 84864


def verdicts(capsys) -> dict[str, bool]:
    return dict(checks.parse(capsys.readouterr().out))


class FakeRun:
    def __init__(self, by_rank: dict, result: dict | None = None):
        self._by_rank, self.nproc = by_rank, len(by_rank)
        self.result = {**by_rank[0], **(result or {})}

    def results_by_rank(self):
        return self._by_rank


def routing(tokens, dropped):
    return {"moe_per_step": {"tokens_per_expert": tokens, "dropped": dropped}}


def one_process(**broken) -> dict:
    """The five one-process runs: the balancing loss evens the load, the capacity factor sets the drops."""
    even, skew = [T * K * L / E] * E, [T * K * L / E * f for f in (1.6, 0.4, 1.2, 0.8, 1.0, 1.0, 1.3, 0.7)]
    runs = {"aux 0": routing(skew, 300.0), "aux 0.01": routing(even, 200.0), "aux 0.1": routing(even, 150.0),
            "capacity 0.5": routing(skew, 1000.0), "capacity 4": routing(skew, 0.0)}
    runs.update(broken)
    return {k: FakeRun({0: v}) for k, v in runs.items()}


def ep_run(w: int, dp: int = 1, *, ok=True, extra_bytes=0, params=None, grad_skew=1.0) -> FakeRun:
    """What course/gpt_moe.py reports on each of dp x w ranks, as the formulas say it should."""
    per, by_rank = E // w, {}
    counts = calc.parameters(DENSE, L, H, E, K, w)
    for rank in range(dp * w):
        c = rank % w
        sent_rows, recv_rows = 900.0 if w > 1 else 0.0, 900.0 if w > 1 else 0.0
        formula = calc.measured_bytes_per_layer(sent_rows, recv_rows, H, 4)
        sent = {x: {p: v + extra_bytes for p, v in d.items()} for x, d in formula.items()}
        experts = list(range(c * per, (c + 1) * per))
        by_rank[rank] = {
            "moe_parity": {"ok": ok, "loss_gap": 1e-7, "grad_gap": 1e-8, "loss_bound": 1e-6, "grad_bound": 1e-7},
            "moe_per_step": {"sent_bytes": sent, "count_bytes": L * calc.count_bytes_per_layer(E, w),
                             "tokens_per_expert": [T * K * L / E] * E, "dropped": 100.0,
                             "processed": {str(e): (T * K * L - 100.0) / per for e in experts},
                             "rows": {"sent": sent_rows, "received": recv_rows}},
            "moe_formula": formula, "moe_uniform": formula, "moe_local_experts": experts, "moe_params": counts,
            "moe_grad_norms": {"dense": 1.5, "experts": {str(e): 0.1 * (e + 1) * (grad_skew if rank >= w else 1)
                                                         for e in experts}}}
    return FakeRun(by_rank, {"params": counts["per_rank"] if params is None else params, "samples_per_s": 100.0})


def deepspeed_run(own_rules_gap=0.4, top1_gap=0.0) -> FakeRun:
    rows = [{"top_k": k, "out_gap": top1_gap if k == 1 else 0.0, "out_floor": 1e-7, "grad_gap": 1e-6,
             "grad_floor": 1e-6, "aux_gap": 0.0, "aux_floor": 1e-8, "out_gap_own_rules": 0.0 if k == 1 else own_rules_gap}
            for k in (1, 2)]
    return FakeRun({r: {"compared": rows} for r in range(2)}, {"deepspeed": "0.19.8", "ep": 2})


@pytest.mark.parametrize("w", lesson.offered())
def test_runs_as_the_formulas_say_make_every_claim_true_at_every_offered_degree(w, capsys):
    cfg = lesson.resolve("smoke", 0, w)
    one, ep = one_process(), ep_run(w)
    lesson.show_load({k: v for k, v in one.items() if k.startswith("aux")})
    lesson.show_traffic(ep)
    lesson.show_balance(ep)
    lesson.show_sizes(ep, cfg)
    lesson.show_deepspeed(deepspeed_run())
    lesson.claim_aux(one)
    lesson.claim_capacity(one, cfg)
    lesson.claim_parity({"EP": ep})
    lesson.claim_traffic(ep, cfg)
    lesson.claim_2d(ep_run(2, dp=2))
    lesson.claim_deepspeed(deepspeed_run())
    got = verdicts(capsys)
    assert len(got) == 7 and all(got.values()), got


def test_each_contradiction_prints_false(capsys):
    cfg = lesson.resolve("smoke", 0, 4)
    lesson.claim_aux(one_process(**{"aux 0.1": routing([T * K * L / E * 1.7] + [T * K * L / E * 0.9] * 7, 150.0)}))
    lesson.claim_capacity(one_process(**{"capacity 0.5": routing([T * K * L / E] * E, 500.0)}), cfg)  # below 768
    lesson.claim_capacity(one_process(**{"capacity 4": routing([T * K * L / E] * E, 2.0)}), cfg)
    lesson.claim_parity({"EP": ep_run(4, ok=False)})
    lesson.claim_traffic(ep_run(4, extra_bytes=4), cfg)
    lesson.claim_2d(ep_run(2, dp=2, grad_skew=1.01))  # replicas that disagree: reduced over the wrong group
    lesson.claim_deepspeed(deepspeed_run(top1_gap=1e-3))
    lesson.claim_deepspeed(deepspeed_run(own_rules_gap=1e-6))  # the two rules would not matter
    got = checks.parse(capsys.readouterr().out)
    assert len(got) == 9 and [ok for _, ok in got].count(True) == 1, got  # claim_traffic's second line still holds


def test_a_rank_holding_the_wrong_parameter_count_is_named(capsys):
    lesson.claim_traffic(ep_run(4, params=DENSE), lesson.resolve("smoke", 0, 4))
    got = checks.parse(capsys.readouterr().out)
    assert [ok for _, ok in got] == [True, False]


def test_what_compared_cells_print_does_not_depend_on_the_machine(capsys):
    """nbval compares the claims' cells: routing and rounding that differ by machine may change only the masked
    ``(measured: ...)`` part of what they print."""
    cfg = lesson.resolve("smoke", 0, 4)

    def printed(scale: float) -> str:
        one = one_process(**{"aux 0": routing([T * K * L / E * f for f in (1.5 * scale,) + (0.9,) * 7], 300 * scale)})
        lesson.claim_aux(one)
        lesson.claim_capacity(one, cfg)
        lesson.claim_parity({"EP": ep_run(4)})
        return re.sub(r"\(measured: [^\n]*\)", "(measured: <MEASURED>)", capsys.readouterr().out)

    assert printed(1.0) == printed(1.3)


@pytest.mark.parametrize("nproc", [3, 5, 8])
def test_a_degree_that_does_not_split_the_experts_or_fit_a_laptop_is_refused(nproc):
    with pytest.raises(ValueError, match="NPROC="):
        lesson.resolve("smoke", 0, nproc)


def test_every_bad_input_of_the_chapter_is_refused_before_launch_with_a_fix(capsys):
    lesson.claim_refusals()
    assert list(verdicts(capsys).values()) == [True]
