"""helpers.notebook.lessons.cp: notebook 12's settings refuse what cannot run, and its claims say False when the
measurements contradict the prose (fake runs built from the formulas, then broken). The refusals run in-process."""
from __future__ import annotations

import re

import pytest

from helpers.calc import cp as calc
from helpers.notebook import checks
from helpers.notebook.lessons import cp as lesson

B, S, H, A, L, V = 8, lesson.SEQ_LEN, lesson.D_MODEL, lesson.HEADS, lesson.N_LAYER, 29


def verdicts(capsys) -> dict[str, bool]:
    return dict(checks.parse(capsys.readouterr().out))


class FakeRun:
    def __init__(self, by_rank: dict, result: dict):
        self._by_rank, self.result, self.nproc = by_rank, result, len(by_rank)

    def results_by_rank(self):
        return self._by_rank


def cp_run(w: int, attention="ring", layout="zigzag", dp=1, *, ok=True, extra_bytes=0, act=1.0) -> FakeRun:
    """What course/gpt_cp.py reports on each of dp x w ranks, as the formulas say it should."""
    sent = calc.bytes_per_step(attention, L, B, S, H, w)
    work = calc.causal_work_pairs(S, w, layout) if attention == "ring" else calc.ulysses_work_pairs(S, w)
    act_bytes = calc.activation_bytes_per_rank(S, B, H, A, w, L, V, attention=attention)["total"] * act
    by_rank = {}
    for rank in range(dp * w):
        c = rank % w
        per_step = {p: {"sent_bytes": sent[p] + extra_bytes, "recv_bytes": sent[p] + extra_bytes,
                        "work_pairs": work[c] * L * B * A, "compute_s": 0.001} for p in ("forward", "backward")}
        by_rank[rank] = {"cp_parity": {"ok": ok, "loss_gap": 1e-7, "grad_gap": 1e-8, "loss_bound": 1e-6,
                                       "grad_bound": 1e-7},
                         "cp_per_step": per_step, "cp_formula": {**sent, "work_pairs": work[c] * L * B * A},
                         "cp_act_bytes": act_bytes, "dp_rank": rank // w, "cp_rank": c,
                         "cp_positions": list(range(c * S // w, (c + 1) * S // w))}
    return FakeRun(by_rank, {"vocab_size": V, "cp_attention": attention, "gpt": {"attention": "math"}})


def runs(w: int, **broken) -> dict:
    out = {"ring, zig-zag": cp_run(w), "ring, contiguous": cp_run(w, layout="contiguous"),
           "Ulysses": cp_run(w, "ulysses")}
    for label, run in broken.items():
        out[label.replace("_", ", ").replace("ring, zigzag", "ring, zig-zag")] = run
    return out


@pytest.mark.parametrize("w", [1, 2, 3, 4])
def test_runs_as_the_formulas_say_make_every_claim_true_at_every_offered_degree(w, capsys):
    cfg = lesson.resolve("smoke", 0, w)
    r = runs(w)
    lesson.show_parity(r)
    lesson.show_balance(r)
    lesson.claim_parity(r)
    lesson.claim_bytes(r, cfg)
    lesson.claim_balance(r, cfg)
    lesson.claim_activations(r, cfg)
    lesson.claim_2d(cp_run(2, dp=2))
    got = verdicts(capsys)
    assert len(got) == 5 and all(got.values()), got


def test_what_compared_cells_print_does_not_depend_on_the_machine(capsys):
    """nbval compares the claims' cells: a machine's rounding gaps and attention times (which differ from CI's) may
    change only the masked ``(measured: ...)`` part of what they print; the tables that show them are not compared."""
    cfg = lesson.resolve("smoke", 0, 4)

    def printed(scale: float) -> str:
        r = runs(4)
        for run in r.values():
            for rank in run.results_by_rank().values():
                rank["cp_parity"].update(loss_gap=1e-7 * scale, grad_gap=1e-8 * scale)
                rank["cp_per_step"]["forward"]["compute_s"] *= scale * (1 + rank["cp_rank"])
        lesson.claim_parity(r)
        lesson.claim_balance(r, cfg)
        out = capsys.readouterr().out
        return re.sub(r"\(measured: [^\n]*\)", "(measured: <MEASURED>)", out)  # tests/nbval_sanitize.cfg's

    assert printed(1.0) == printed(3.7)


def test_each_contradiction_prints_false(capsys):
    cfg = lesson.resolve("smoke", 0, 4)
    lesson.claim_parity({**runs(4), "Ulysses": cp_run(4, "ulysses", ok=False)})
    lesson.claim_bytes({**runs(4), "ring, contiguous": cp_run(4, layout="contiguous", extra_bytes=4)}, cfg)
    lesson.claim_balance({**runs(4), "ring, contiguous": cp_run(4, layout="zigzag")}, cfg)  # balanced: not 1.6
    lesson.claim_activations({**runs(4), "ring, zig-zag": cp_run(4, act=1.02)}, cfg)
    two = cp_run(2, dp=2)
    two._by_rank[3]["dp_rank"] = 0  # two ranks on one mesh point
    lesson.claim_2d(two)
    got = verdicts(capsys)
    assert len(got) == 5 and not any(got.values()), got


def test_settings_offer_only_degrees_that_split_the_sequence_and_the_heads():
    assert lesson.offered() == [1, 2, 3, 4, 6, 12]
    assert lesson.resolve("smoke", 0).nproc == 4 and lesson.resolve("smoke", 2).nproc == 2
    with pytest.raises(ValueError, match="use one of 1, 2, 3, 4, 6, 12"):
        lesson.resolve("smoke", 0, 5)


def test_layouts_table_counts_the_formulas_pairs():
    text = lesson.layout_lines(4).render("en")
    assert "0-5, 42-47" in text and "1.600" in text and "1.000" in text


def test_bad_input_is_refused_in_process_with_the_value_to_change(capsys):
    found = lesson.refusals()
    assert len(found) == 4 and all(m != "accepted" and " use " in m for _, m in found), found
    lesson.claim_refusals()
    assert all(verdicts(capsys).values())


def test_torch_context_parallel_claim_holds_only_for_torchs_reason(capsys):
    cfg = lesson.resolve("smoke", 0, 2)
    reason = ("    raise RuntimeError(f\"--attn torch: torch.distributed.tensor.experimental.context_parallel shards only "
              "SDPA's \"\nrank 0: RuntimeError: --attn torch: torch.distributed.tensor.experimental.context_parallel shards only "
              "SDPA's CUDA kernels; on cpu causal SDPA runs aten._scaled_dot_product_flash_attention_for_cpu, for "
              "which it has no sharding strategy (NotImplementedError).")
    lesson.claim_torch_cp((None, reason), cfg)
    lesson.claim_torch_cp((None, "rank 1: connection reset by peer"), cfg)
    lesson.claim_torch_cp((object(), None), cfg)
    assert [v for _, v in checks.parse(capsys.readouterr().out)] == [True, False, False]
