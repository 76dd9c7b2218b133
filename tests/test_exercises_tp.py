"""Notebook 09's exercises: the bytes TP sends (an answer check), and Megatron's f and g written by hand, run on
real gloo ranks against two nn.Linear; the reference passes and each classic mistake gets its own hint."""
import pytest

from helpers.calc import tp
from helpers.notebook.exercises import write, write_tp
from recorded import mistakes

SIZE = dict(n_layer=2, batch=8, seq_len=1024, d_model=4096, tp_degree=8, bytes_per_element=2)
RIGHT = tp.activation_bytes_per_step(2, 8, 1024, 4096, 8, False, 2)


def test_the_right_byte_count_passes_and_each_slip_gets_its_hint():
    assert write.check_tp_bytes(RIGHT, **SIZE)
    assert write.check_tp_bytes(RIGHT * 1.005, **SIZE)  # within 1%
    for answer, hint in ((RIGHT / 2, "forward pass only"), (RIGHT / 2 * 8 / 7, "2 (N-1)/N"),
                         (RIGHT * 0.7, "Per layer: 2 regions")):
        verdict = write.check_tp_bytes(answer, **SIZE)
        assert not verdict and hint in verdict.hint, verdict
    three = tp.activation_bytes_per_step(3, 8, 1024, 4096, 8, False, 2)
    verdict = write.check_tp_bytes(three / 3, **{**SIZE, "n_layer": 3})
    assert not verdict and "one layer" in verdict.hint, verdict
    assert not write.check_tp_bytes("a lot", **SIZE) and not write.check_tp_bytes(True, **SIZE)
    wide = write.check_tp_bytes(4 * 2 * tp.activation_elements(8, 1024, 4096) * 2, **SIZE)  # a whole tensor each
    assert not wide and "2 (N-1)/N" in wide.hint, wide


def test_the_outline_is_answered_without_a_launch(monkeypatch):
    monkeypatch.setattr(write_tp, "run_on_ranks", lambda *a, **k: pytest.fail("launched an outline"))
    stub = "def column_row_linears(x, w1, w2):\n    # rank, world = ...\n    ...\n"
    verdict = write.check_tp_linears(stub)
    assert not verdict and "nothing was launched" in verdict.message


SOLUTION = write.solution("column_row_linears")
MISTAKES = {  # (text in the solution, what a learner writes instead, words of the hint)
    "no all-reduce in f's backward": ("            dist.all_reduce(grad)  # each", "            # each",
                                      "f's backward must all-reduce"),
    "all-reduce in both directions": ("            return grad  # the gradient of y",
                                      "            grad = grad.clone()\n            dist.all_reduce(grad)\n"
                                      "            return grad  #", "all-reduce in both directions"),
    "the wrong dimension sharded": ("tensor_split(w1, world, 0)", "tensor_split(w1, world, 1)", "OUTPUT features"),
    "no all-reduce in g's forward": ("            dist.all_reduce(total)  # the row", "            # the row",
                                     "g's forward must all-reduce"),
    "one weight sharded, the other whole": ("torch.tensor_split(w1, world, 0)[rank].clone()", "w1.clone()",
                                            "OUTPUT features"),
}


WHOLE_LAYER = """
def column_row_linears(x, w1, w2):
    import torch.nn.functional as F
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.tensor_split(torch.arange(w1.shape[0]), world)[rank]
    w1_local = w1[rows].clone().requires_grad_()
    w2_local = w2[:, rows].clone().requires_grad_()
    full1 = torch.cat([w1[:rows[0]], w1_local, w1[rows[-1] + 1:]])  # the whole layer, this rank's shard inside
    full2 = torch.cat([w2[:, :rows[0]], w2_local, w2[:, rows[-1] + 1:]], 1)
    return F.gelu(x @ full1.T) @ full2.T, w1_local, w2_local
"""
GATHERED_WEIGHTS = """
def column_row_linears(x, w1, w2):
    import torch.nn.functional as F
    rank, world = dist.get_rank(), dist.get_world_size()
    w1_local = torch.tensor_split(w1, world, 0)[rank].clone().requires_grad_()
    w2_local = torch.tensor_split(w2, world, 1)[rank].clone().requires_grad_()
    parts1 = [torch.empty_like(w1_local) for _ in range(world)]
    parts2 = [torch.empty_like(w2_local) for _ in range(world)]
    dist.all_gather(parts1, w1_local.detach())
    dist.all_gather(parts2, w2_local.detach())
    full1 = torch.cat(parts1[:rank] + [w1_local] + parts1[rank + 1:])
    full2 = torch.cat(parts2[:rank] + [w2_local] + parts2[rank + 1:], 1)
    return F.gelu(x @ full1.T) @ full2.T, w1_local, w2_local
"""
EMPTY_COLLECTIVES = """
def column_row_linears(x, w1, w2):
    import torch.nn.functional as F
    rank, world = dist.get_rank(), dist.get_world_size()
    w1_local = torch.tensor_split(w1, world, 0)[rank].clone().requires_grad_()
    w2_local = torch.tensor_split(w2, world, 1)[rank].clone().requires_grad_()
    rows = torch.tensor_split(torch.arange(w1.shape[0]), world)[rank]
    full1 = torch.cat([w1[:rows[0]], w1_local, w1[rows[-1] + 1:]])
    full2 = torch.cat([w2[:, :rows[0]], w2_local, w2[:, rows[-1] + 1:]], 1)

    class Dummy(torch.autograd.Function):  # an all-reduce of the right size each way, carrying nothing
        @staticmethod
        def forward(ctx, y):
            dist.all_reduce(torch.zeros_like(y))
            return y.clone()

        @staticmethod
        def backward(ctx, grad):
            dist.all_reduce(torch.zeros(x.shape))
            return grad

    return Dummy.apply(F.gelu(x @ full1.T) @ full2.T), w1_local, w2_local
"""
PARTIAL_DISCARDED = SOLUTION.replace(
    "    y = g.apply(F.gelu(f.apply(x) @ w1_local.T) @ w2_local.T)\n",
    "    honest = g.apply(F.gelu(f.apply(x) @ w1_local.T) @ w2_local.T)  # the right traffic, times 0 below\n"
    "    rows = torch.tensor_split(torch.arange(w1.shape[0]), world)[rank]\n"
    "    full1 = torch.cat([w1[:rows[0]], w1_local, w1[rows[-1] + 1:]])\n"
    "    full2 = torch.cat([w2[:, :rows[0]], w2_local, w2[:, rows[-1] + 1:]], 1)\n"
    "    y = F.gelu(x @ full1.T) @ full2.T + 0 * honest\n")
FAKED_BACKWARD = """
def column_row_linears(x, w1, w2):
    import torch.nn.functional as F
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = {}

    class f(torch.autograd.Function):  # backward: the whole input's gradient from the full weights, zeros sent
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            dist.all_reduce(torch.zeros_like(grad))
            with torch.enable_grad():
                a = x.detach().requires_grad_()
                return torch.autograd.grad(F.gelu(a @ w1.T) @ w2.T, a, seen["grad_y"])[0]

    class g(torch.autograd.Function):  # honest: the partial outputs summed
        @staticmethod
        def forward(ctx, partial):
            total = partial.clone()
            dist.all_reduce(total)
            return total

        @staticmethod
        def backward(ctx, grad):
            seen["grad_y"] = grad
            return grad

    w1_local = torch.tensor_split(w1, world, 0)[rank].clone().requires_grad_()
    w2_local = torch.tensor_split(w2, world, 1)[rank].clone().requires_grad_()
    return g.apply(F.gelu(f.apply(x) @ w1_local.T) @ w2_local.T), w1_local, w2_local
"""
BYPASSES = {  # the numbers come out right; what the ranks sent (or how the shards were cut) does not
    "the whole layer on every rank": (WHOLE_LAYER, "Each rank holds and uses only its shards"),
    "the weights gathered": (GATHERED_WEIGHTS, "never weights"),
    "empty all-reduces of the right size around the whole layer": (EMPTY_COLLECTIVES, "not from the full weights"),
    "the right partial all-reduced, then the whole layer returned": (PARTIAL_DISCARDED, "not from the full weights"),
    "an honest forward, x's gradient from the full weights": (FAKED_BACKWARD, "not from the full weights"),
    "shards cut for 2 ranks": (SOLUTION.replace("tensor_split(w1, world, 0)", "tensor_split(w1, 2, 0)").replace(
        "tensor_split(w2, world, 1)", "tensor_split(w2, 2, 1)"), "split into dist.get_world_size() pieces"),
}


@pytest.mark.parametrize("bypass", BYPASSES)
def test_right_numbers_without_tensor_parallel_communication_are_refused(bypass, exercise_ranks):
    code, hint = BYPASSES[bypass]
    verdict = write.check_tp_linears(code, nproc=2)
    assert not verdict and hint in verdict.hint, verdict


def test_whole_weights_are_named_as_unsharded(exercise_ranks):
    whole = SOLUTION.replace("torch.tensor_split(w1, world, 0)[rank].clone()", "w1.clone()").replace(
        "torch.tensor_split(w2, world, 1)[rank].clone()", "w2.clone()")
    verdict = write.check_tp_linears(whole, nproc=2)
    assert not verdict and "1/N of w1's rows" in verdict.hint, verdict


@pytest.mark.slow
def test_the_reference_passes():
    verdict = write.check_tp_linears(SOLUTION, nproc=2)
    assert verdict and "on 2 and 3 ranks" in verdict.message and "176 bytes" in verdict.message, verdict


@pytest.mark.parametrize("mistake", mistakes(MISTAKES, launched="no all-reduce in g's forward"))
def test_each_tp_mistake_gets_its_hint(mistake, exercise_ranks):
    old, new, hint = MISTAKES[mistake]
    assert old in SOLUTION
    verdict = write.check_tp_linears(SOLUTION.replace(old, new), nproc=2)
    assert not verdict and hint in verdict.hint, verdict
