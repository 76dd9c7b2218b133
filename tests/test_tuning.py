"""The tuning chapter's measurements: helpers.calc.schedules/comm, helpers.rank.state, helpers.notebook.results, and
gradient clipping in course/ddp_tuning.py and course/ds_tuning.py (the latter under the `deepspeed` CLI) launched for
real on two CPU ranks (the slow tests). Notebook 05 claims the rest of what those scripts do, under nbval."""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import launch
from helpers.rank import metrics
from helpers.calc import comm, parity, schedules
from helpers.notebook import results
from helpers.rank import state
from helpers.rank.models import SimpleCNN, count_parameters

DATA = ["--dataset", "synthetic", "--train-size", "1000", "--batch-size", "16"]
TIMEOUT_S = 600  # the first DeepSpeed launch on a machine JIT-builds its CPU communication op


# --------------------------------------------------------------------------------------------- fast


def test_torch_warmup_formula_matches_lambdalr():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / 4))
    seen = []
    for _ in range(7):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([schedules.torch_warmup_lr(k, 0.3, 4) for k in range(7)])
    assert seen[0] == 0.0 and seen[4:] == pytest.approx([0.3] * 3)


def test_deepspeed_warmup_formula_matches_warmuplr_stepped_like_the_engine():
    from deepspeed.runtime.lr_schedules import WarmupLR
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.3, warmup_num_steps=4, warmup_type="linear")
    seen = []
    for _ in range(8):  # the engine reads the rate, steps the optimizer, then steps the scheduler
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([schedules.deepspeed_warmup_lr(k, 0.3, 4) for k in range(8)])
    assert seen[:2] == [0.0, 0.0], "with warmup_min_lr 0, WarmupLR's first two steps change nothing"


def test_warmup_formulas_without_warmup_are_constant():
    assert schedules.torch_warmup_lr(0, 0.1, 0) == schedules.deepspeed_warmup_lr(0, 0.1, 0) == 0.1


@pytest.mark.parametrize("op, message, expected", [
    ("all_reduce", 1000, 1000.0),                    # 2 S (N-1)/N at N=2
    ("reduce_scatter_tensor", 1000, 500.0),          # S (N-1)/N
    ("all_gather_into_tensor", 500, 500.0),          # shard s, (N-1) s
    ("broadcast", 7, 7.0),
])
def test_bytes_sent_per_rank_uses_ring_costs(op, message, expected):
    assert comm.bytes_sent_per_rank(op, message, 2) == expected


def test_bytes_sent_per_rank_grows_towards_twice_the_buffer_for_all_reduce():
    assert comm.bytes_sent_per_rank("all_reduce", 1000, 8) == pytest.approx(1750.0)


def test_model_state_bytes_counts_params_grads_and_adamw_state_once():
    torch.manual_seed(0)
    model = SimpleCNN()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    p, tensors = count_parameters(model), len(list(model.parameters()))
    states = state.model_state_bytes(model, optimizer)
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a 4-byte fp32 step counter per tensor
    assert states == {"params": 4 * p, "grads": 4 * p, "optimizer": 8 * p + 4 * tensors, "total": 16 * p + 4 * tensors,
                      "buffers": 0}  # a torch optimizer keeps no communication buffers


def test_model_state_bytes_counts_a_shared_storage_once():
    flat = torch.zeros(10)
    a, b = torch.nn.Parameter(flat[:5]), torch.nn.Parameter(flat[5:])  # views of one buffer, like DDP's buckets
    module = torch.nn.Module()
    module.a, module.b = a, b
    a.grad, b.grad = torch.zeros(5), torch.zeros(5)
    states = state.model_state_bytes(module, torch.optim.SGD(module.parameters(), lr=0.1))
    assert states["params"] == 40 and states["grads"] == 40 and states["optimizer"] == 0


def test_dir_bytes_sums_files_of_a_folder_and_reads_one_file(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 5)
    assert state.dir_bytes(tmp_path) == 15 and state.dir_bytes(tmp_path / "a") == 10


def test_table_leaves_out_columns_no_row_has():
    text = results.table([{"label": "DDP", "model_states_mib": 304.2, "final_loss": 1.5},
                         {"label": "ZeRO-3", "model_states_mib": 190.0, "final_loss": None}])
    header, rule, *rows = text.splitlines()
    assert "model states MiB/rank" in header and "final loss" in header and "samples/s" not in header
    assert rows[0].split() == ["DDP", "304", "1.5000"] and rows[1].split() == ["ZeRO-3", "190", "-"]


# --------------------------------------------------------------------------------------------- launched

slow = pytest.mark.slow


def _ddp(args, **kw):
    return launch.torchrun("course/ddp_tuning.py", nproc=2, args=[*DATA, *args], timeout=TIMEOUT_S, show="none", **kw)


def _ds(args):
    return launch.deepspeed("course/ds_tuning.py", nproc=2, args=[*DATA, *args], timeout=TIMEOUT_S, show="none")


def _clip_floor(max_norm: float, batches: int = 3) -> float:
    """How far fp32 rounding moves ``||one clipped SGD step (lr 1)||`` from ``max_norm`` in this computation: the
    same step of SimpleCNN in fp32 and in fp64, in this process, on a few random batches of the tests' size; the
    largest gap, at least one fp32 unit of ``max_norm`` (helpers/calc/parity.py: the floor, measured)."""
    gaps = []
    for seed in range(batches):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        moved = {}
        for dtype in (torch.float32, torch.float64):
            torch.manual_seed(0)
            model = SimpleCNN().to(dtype)
            before = [p.detach().clone() for p in model.parameters()]
            F.cross_entropy(model(x.to(dtype)), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-1.0)
            moved[dtype] = math.sqrt(sum(((p.detach() - b) ** 2).sum().item() for p, b in zip(model.parameters(), before)))
        gaps.append(abs(moved[torch.float32] - moved[torch.float64]))
    return max(max(gaps), parity.FP32_EPS * max_norm)


def _update_norm(run, save_dir, load):
    """||weights after one step - initial weights||, the initial ones rebuilt from the same seed."""
    torch.manual_seed(0)
    before = SimpleCNN().state_dict()
    after = load(save_dir)
    return math.sqrt(sum(((after[k].float() - before[k]) ** 2).sum().item() for k in before))


@slow
def test_clip_grad_norm_bounds_the_applied_update(module_runs_root):
    """Plain SGD (no momentum) at lr 1: the update IS the clipped gradient, so its norm must equal the clip."""
    save = module_runs_root / "ddp_clip"
    run = _ddp(["--steps", "1", "--optimizer", "sgd", "--momentum", "0", "--lr", "1.0", "--clip", "0.5",
                "--save-dir", save])
    reported = metrics.steps(run.metrics, 0)[0]["grad_norm"]
    assert reported > 0.5, "the test needs a gradient larger than the clip"
    moved = _update_norm(run, save, lambda d: torch.load(d / "ddp_checkpoint.pt", map_location="cpu")["model"])
    floor = _clip_floor(0.5)
    assert abs(moved - 0.5) <= parity.K * floor, f"moved {moved} vs 0.5: {abs(moved - 0.5) / floor:.3g} floors"
    assert run.result["checkpoint_bytes"] == state.dir_bytes(save)


@slow
def test_deepspeed_gradient_clipping_bounds_the_applied_update(module_runs_root):
    save = module_runs_root / "ds_clip"
    run = _ds(["--steps", "1", "--optimizer", "sgd", "--momentum", "0", "--lr", "1.0", "--clip", "0.5",
               "--stage", "1", "--save-dir", save])

    def load(d):
        tag = (d / "latest").read_text().strip()
        return torch.load(d / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]

    assert metrics.steps(run.metrics, 0)[0]["grad_norm"] > 0.5
    moved, floor = _update_norm(run, save, load), _clip_floor(0.5)
    assert abs(moved - 0.5) <= parity.K * floor, f"moved {moved} vs 0.5: {abs(moved - 0.5) / floor:.3g} floors"
