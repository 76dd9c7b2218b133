"""Notebook 13's exercises: an MoE layer's dispatch and combine written by hand, checked on 3 and 2 real gloo ranks
against one process (outputs and the gradient of the rows), and the bytes of one dispatch. The reference passes,
other right forms pass, and the catalogue of wrong answers fails, each with the hint for its own mistake. One
mistake launches for real (slow tier); the others replay their recorded per-rank outcomes (`make record`)."""
import fractions

import pytest
import torch

from helpers.notebook.exercises import write
from recorded import mistakes

SOLUTION = write.solution("dispatch_combine")
COUNTS = ("    dist.all_to_all_single(incoming, counts, group=group)  # [i * per + j]: rows rank i sends to my j-th "
          "expert\n")
ORDER = "order = kept[torch.argsort(expert[kept], stable=True)]"
KEPT = "kept = (expert >= 0).nonzero().flatten()"
ARRIVED = "arrived = all_to_all_rows(rows[order], send, recv, group)"
BACK = "return torch.zeros_like(rows).index_add(0, order, back)"

CATALOGUE = {  # what a learner writes, the words of the hint it must get
    "no counts exchange: the local counts as receive sizes": (
        SOLUTION.replace(COUNTS, "    incoming = counts.clone()\n"),
        "all-to-all the per-expert counts"),
    "rows sent in token order": (SOLUTION.replace(ORDER, "order = kept"), "Sort the kept rows by expert"),
    "sorted by expert, descending": (SOLUTION.replace(ORDER, "order = kept[torch.argsort(-expert[kept])]"),
                                     "Sort the kept rows by expert"),
    "combine without un-permuting": (SOLUTION.replace(BACK, "return torch.zeros_like(rows).index_add(0, "
                                                            "torch.sort(order).values, back)"), "Put each one back"),
    "outputs concatenated, not scattered": (SOLUTION.replace(BACK, "return torch.cat([back, rows.new_zeros("
                                                                   "len(rows) - len(back), rows.shape[1])])"),
                                            "Put each one back"),
    "dropped rows counted (bincount of -1)": (SOLUTION.replace(KEPT, "kept = torch.arange(len(expert))"),
                                              "A dropped row (expert -1) goes to no expert"),
    "dropped rows sent to expert 0": (SOLUTION.replace(KEPT, "kept = torch.arange(len(expert))").replace(
        "expert[kept]", "expert[kept].clamp(min=0)").replace("torch.bincount(expert[order]",
                                                               "torch.bincount(expert[order].clamp(min=0)"),
        "A dropped row (expert -1) goes to no expert"),
    "the exchange autograd cannot see": (SOLUTION.replace(ARRIVED, "arrived = rows.new_empty(sum(recv), rows.shape[1]);"
                                                                   " dist.all_to_all_single(arrived, rows[order], "
                                                                   "recv, send, group=group)"),
                                         "all_to_all_rows(x, send, recv, group)"),
    "written for 3 ranks": (SOLUTION.replace("world, me = dist.get_world_size(group), dist.get_rank(group)",
                                             "world, me = 3, dist.get_rank(group)"), "one rank count only"),
    "every row computed here, nothing sent": (SOLUTION.replace(ARRIVED, "arrived = rows[order]").replace(
        "ids = torch.arange(me * per, (me + 1) * per).repeat(world).repeat_interleave(incoming)",
        "ids = expert[order]").replace("back = all_to_all_rows(out, recv, send, group)", "back = out"),
        "must travel to the rank that holds its expert"),
}


@pytest.mark.parametrize("mistake", mistakes(CATALOGUE, launched="combine without un-permuting"))
def test_each_dispatch_mistake_gets_its_hint(mistake, exercise_ranks):
    code, hint = CATALOGUE[mistake]
    assert code != SOLUTION, mistake
    verdict = write.check_dispatch(code)
    assert not verdict and hint in verdict.hint, (mistake, verdict)


RIGHT_FORMS = {
    "the reference": SOLUTION,
    "a helper in the cell, index assignment, stable sort by a key": SOLUTION.replace(
        BACK, "out = torch.zeros_like(rows)\n    out[order] = back\n    return out").replace(
        ORDER, "order = kept[sort_by(expert[kept])]")
    + "\n\ndef sort_by(key):\n    return torch.sort(key, stable=True).indices\n",
}


@pytest.mark.parametrize("form", mistakes(RIGHT_FORMS, launched="the reference"))
def test_right_answers_in_any_form_pass_on_real_ranks(form, exercise_ranks):
    verdict = write.check_dispatch(RIGHT_FORMS[form])
    assert verdict and "on 2 and 3 real ranks" in verdict.message, verdict


def test_the_outline_is_answered_without_a_launch(monkeypatch):
    from helpers.notebook.exercises import write_moe

    monkeypatch.setattr(write_moe, "run_on_ranks", lambda *a, **k: pytest.fail("launched an outline"))
    verdict = write.check_dispatch("def dispatch_combine(rows, expert, n_experts, run_experts, group):\n    ...\n")
    assert not verdict and "nothing was launched" in verdict.message


SIZE = dict(tokens=4096, top_k=8, d_model=7168, ep=64, bytes_per_element=2)
RIGHT = 4096 * 8 * 7168 * 2 * 63 / 64


@pytest.mark.parametrize("answer,hint", [
    (RIGHT / 8, "k rows leave for every token"),
    (4096 * 8 * 7168 * 2, "(W-1)/W of them leave"),
    (2 * RIGHT, "dispatch and the combine together"),
    (RIGHT / 2, "That counts elements"),
    (4 * RIGHT, "four all-to-alls"),
    (RIGHT / 3, "every token sends k rows"),
])
def test_the_dispatch_byte_count_names_each_slip(answer, hint):
    verdict = write.check_dispatch_bytes(answer, **SIZE)
    assert not verdict and hint in verdict.hint, verdict


def test_the_right_dispatch_byte_count_passes_in_any_number_form():
    for answer in (RIGHT, int(RIGHT), fractions.Fraction(RIGHT), torch.tensor(RIGHT), RIGHT * 1.005):
        assert write.check_dispatch_bytes(answer, **SIZE), answer
    assert not write.check_dispatch_bytes("4e9", **SIZE) and not write.check_dispatch_bytes(None, **SIZE)
