"""Notebook 12's exercise: one hop of ring attention (the causal skip and the log-sum-exp merge) written by hand.
Probes in this process name each classic mistake without a launch; an answer that passes them runs in a real ring
on 3 and 2 gloo ranks against one process. The reference passes, other right forms pass, and the catalogue of wrong
answers below fails, each with the hint for its own mistake."""
import pytest

from helpers.notebook.exercises import write, write_cp
from recorded import mistakes

SOLUTION = write.solution("ring_step")
MERGE = ("    m = torch.maximum(lse, block_lse)  # the running max: every exponent below is <= 0\n"
         "    new = m + torch.log(torch.exp(lse - m) + torch.exp(block_lse - m))\n"
         "    out = out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1)\n"
         "    return out, new\n")
SKIP = "    if k_pos.min() > q_pos.max():"
BLOCK = "    block_out, block_lse = block_softmax(q, k, v, q_pos, k_pos)  # this block alone\n"


def merged(body: str) -> str:
    assert MERGE in SOLUTION
    return SOLUTION.replace(MERGE, body)


OWN_SOFTMAX = ("    s = (q @ k.transpose(-2, -1)) / q.size(-1) ** 0.5\n{mask}"
               "    block_lse = torch.logsumexp(s, -1)\n"
               "    block_out = torch.softmax(s, -1) @ v\n")
MASK = "    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float('-inf'))\n"
CATALOGUE = {  # what a learner writes, the words of the hint it must get
    "the outputs averaged": (merged("    if torch.isinf(lse).all():\n        return block_out, block_lse\n"
                                    "    return (out + block_out) / 2, torch.maximum(lse, block_lse)\n"),
                             "You average the two outputs"),
    "added without rescaling": (merged("    return out + block_out, torch.logaddexp(lse, block_lse)\n"),
                                "without rescaling"),
    "e^lse without the running max": (merged(
        "    new = torch.log(torch.exp(lse) + torch.exp(block_lse))\n"
        "    return out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None], new\n"),
        "running max"),
    "the lse not carried on": (merged(
        "    new = torch.logaddexp(lse, block_lse)\n"
        "    out = out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None]\n"
        "    return out, torch.where(torch.isinf(lse), block_lse, lse)\n"), "Return the new lse"),
    "only the new block kept": (merged("    return block_out, block_lse\n"), "lost"),
    "skipped by the first query": (SOLUTION.replace(SKIP, "    if k_pos[0] > q_pos[0]:"), "You skipped it"),
    "skipped when any key is in the future": (SOLUTION.replace(SKIP, "    if k_pos.max() > q_pos.max():"),
                                              "You skipped a block"),
    "never skipped": (SOLUTION.replace(SKIP, "    if False:"), "unchanged before computing anything"),
    "no causal mask": (SOLUTION.replace(BLOCK, OWN_SOFTMAX.format(mask="")), "without the causal mask"),
    "a masked row's softmax left NaN": (SOLUTION.replace(BLOCK, OWN_SOFTMAX.format(mask=MASK)), "0/0"),
    "mask by index in the block": (SOLUTION.replace(BLOCK, OWN_SOFTMAX.format(
        mask="    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float('-inf'))\n")
        .replace("torch.softmax(s, -1)", "torch.softmax(s, -1).nan_to_num(0.0)")), "Mask by positions"),
    "lse - lse on the first block": (merged(
        "    new = lse + torch.log(1 + torch.exp(block_lse - lse))\n"
        "    return out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None], new\n"),
        "NaN"),
    "returns only out": (merged("    return out\n"), "not (out, lse)"),
}


@pytest.mark.parametrize("mistake", CATALOGUE)
def test_each_mistake_is_named_without_a_launch(mistake, monkeypatch):
    monkeypatch.setattr(write_cp, "run_on_ranks", lambda *a, **k: pytest.fail("launched a probed mistake"))
    code, hint = CATALOGUE[mistake]
    verdict = write.check_ring_step(code)
    assert not verdict and hint in verdict.hint + verdict.message, (mistake, verdict)


def test_an_error_in_the_learners_line_is_theirs_and_one_in_torch_is_called_from_it(monkeypatch):
    monkeypatch.setattr(write_cp, "run_on_ranks", lambda *a, **k: pytest.fail("launched"))
    theirs = write.check_ring_step(merged("    return out * lse, lse\n"))
    assert not theirs and "raised by line" in theirs.hint, theirs
    inside = write.check_ring_step(SOLUTION.replace("block_softmax(q, k, v, q_pos, k_pos)",
                                                    "block_softmax(q, k[..., :2, :], v, q_pos, k_pos)"))
    assert not inside and "called from line" in inside.hint, inside


def test_the_outline_is_answered_without_a_launch(monkeypatch):
    monkeypatch.setattr(write_cp, "run_on_ranks", lambda *a, **k: pytest.fail("launched an outline"))
    verdict = write.check_ring_step("def ring_step(q, k, v, q_pos, k_pos, out, lse):\n    # 1. skip\n    ...\n")
    assert not verdict and "nothing was launched" in verdict.message


RIGHT_FORMS = {  # each passes the probes and the ring
    "the reference": SOLUTION,
    "torch.logaddexp, a list, indexing with None": merged(
        "    new = torch.logaddexp(lse, block_lse)\n"
        "    return [out * (lse - new).exp()[..., None] + block_out * (block_lse - new).exp()[..., None], new]\n"),
    "out updated in place, its own masked softmax": SOLUTION.replace(BLOCK, OWN_SOFTMAX.format(mask=MASK).replace(
        "torch.softmax(s, -1) @ v", "torch.exp(s - block_lse[..., None]).nan_to_num(0.0) @ v")).replace(
        "    out = out * torch.exp", "    out.mul_(torch.exp(lse - new).unsqueeze(-1))\n    out += 0 * torch.exp").replace(
        "    if k_pos.min() > q_pos.max():", "    if bool((k_pos > q_pos.max()).all()):"),
}


@pytest.mark.parametrize("form", mistakes(RIGHT_FORMS, launched="the reference"))
def test_right_answers_in_any_form_pass_in_a_real_ring(form, exercise_ranks):
    verdict = write.check_ring_step(RIGHT_FORMS[form])
    assert verdict and "inside a real ring on 2 (contiguous) and 3 (zigzag) ranks" in verdict.message, verdict


def test_an_answer_that_communicates_is_refused_here_and_in_the_ring(monkeypatch, exercise_ranks):
    talk = "    torch.distributed.all_reduce(torch.zeros(1))\n    if k_pos.min()"
    here = write.check_ring_step(SOLUTION.replace("    if k_pos.min()", talk))
    assert not here and "must not call collectives" in here.hint, here
    only_in_a_group = "    if torch.distributed.is_initialized():\n        torch.distributed.all_reduce(torch.zeros(1))\n"
    verdict = write.check_ring_step(SOLUTION.replace("    if k_pos.min()", only_in_a_group + "    if k_pos.min()"))
    assert not verdict and "called all_reduce" in verdict.message and "no send" in verdict.hint, verdict


SIZE = dict(b=1, s=131072, h=8192, cp=16, bytes_per_element=2)
BLOCK = 131072 // 16 * 8192 * 2  # one K (or V) block of one rank, bf16


@pytest.mark.parametrize("answer,hint", [
    (2 * 16 * BLOCK, "W - 1 hops, not W"),
    (2 * 15 * BLOCK * 16, "s / W positions"),
    (6 * 15 * BLOCK, "forward and backward together"),
    (15 * BLOCK, "Two different slips"),  # K alone, and elements instead of bytes: both x 1/2 in bf16
    (4 * 15 / 16 * BLOCK, "Ulysses"),
    (3 * 15 * BLOCK, "W - 1 hops in the forward pass"),
])
def test_the_ring_byte_count_names_each_slip(answer, hint):
    verdict = write.check_ring_bytes(answer, **SIZE)
    assert not verdict and hint in verdict.hint, verdict


def test_the_right_ring_byte_count_passes_in_any_number_form():
    import fractions

    import torch

    right = 2 * 15 * BLOCK
    for answer in (right, float(right), fractions.Fraction(right), torch.tensor(right), right * 1.005):
        assert write.check_ring_bytes(answer, **SIZE), answer
    assert not write.check_ring_bytes("4e9", **SIZE) and not write.check_ring_bytes(True, **SIZE)
    fp32 = write.check_ring_bytes(right, **{**SIZE, "bytes_per_element": 4})  # the same number in fp32 is half
    assert not fp32 and "That is K or V alone" in fp32.hint, fp32
