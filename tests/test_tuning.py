"""The tuning chapter's measurements: helpers.calc.schedules/comm, helpers.rank.state, helpers.notebook.results, and course/ddp_tuning.py, course/ds_tuning.py and
course/ddp_accumulation_check.py launched for real on two CPU ranks (the slow tests)."""
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


def _losses(run, rank=0):
    return [r["loss"] for r in metrics.steps(run.metrics, rank)]


@slow
def test_n_micro_batches_with_no_sync_give_the_big_batch_gradient_with_one_all_reduce(module_runs_root):
    run = launch.torchrun("course/ddp_accumulation_check.py", nproc=2, timeout=TIMEOUT_S, show="none",
                          args=["--micro-batches", "4", "--batch-size", "8"])
    results = run.results_by_rank()
    assert set(results) == {0, 1}
    for r in results.values():
        tol = parity.K * r["fp32_floor"]  # the big batch's fp32 gradient against its fp64 twin, in the same rank
        assert 0 < r["fp32_floor"] < 1e-3 * r["grad_max_abs"]
        assert r["no_sync_max_abs_diff"] <= tol and r["every_step_max_abs_diff"] <= tol
        comm = r["comm"]
        assert comm["no_sync"]["calls"] == comm["big batch"]["calls"] >= 1
        assert comm["no_sync"]["bytes"] == comm["big batch"]["bytes"] == 4 * r["params"]  # fp32 gradients, once
        assert comm["every step"]["bytes"] == 4 * comm["big batch"]["bytes"]


def _one_process_losses(dtype, steps=5, accumulation=2, world=2, batch=16, lr=1e-3):
    """Rank 0's losses of the 2-rank DDP run of course/ddp_tuning.py (AdamW, ``accumulation`` micro batches),
    computed in one process on both ranks' batches: the same computation, in ``dtype``."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from helpers.rank import harness
    from helpers.rank.data import get_datasets

    torch.manual_seed(0)  # as the script: seed, data, model, then the loaders' first batch
    train_ds = get_datasets("synthetic", "data", 1000, 100, 0)[0]
    samplers = [DistributedSampler(train_ds, num_replicas=world, rank=r, shuffle=True, seed=0, drop_last=True)
                for r in range(world)]
    loaders = [harness.batches(DataLoader(train_ds, batch_size=batch, sampler=s), s) for s in samplers]
    model = SimpleCNN().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        rank0 = 0.0
        for _micro in range(accumulation):
            for r, loader in enumerate(loaders):
                x, y = next(loader)
                loss = F.cross_entropy(model(x.to(dtype)), y) / accumulation
                (loss / world).backward()  # DDP averages the ranks' gradients
                rank0 += loss.item() if r == 0 else 0.0
        optimizer.step()
        losses.append(rank0)
    return losses


@slow
def test_ddp_and_deepspeed_fp32_runs_compute_the_same_losses(module_runs_root):
    """Same seed, data, order and optimizer: only the engine differs (and DeepSpeed's default clipping is off).
    Within parity.K floors, the floor being how far fp32 rounding moves the one-process replica from its fp64 twin."""
    ddp = _ddp(["--steps", "5", "--accumulation", "2"])
    ds = _ds(["--steps", "5", "--accumulation", "2", "--stage", "2", "--count-comms"])
    one32, one64 = _one_process_losses(torch.float32), _one_process_losses(torch.float64)
    floor = parity.floor(one32, one64)
    for label, curve, reference in (("DDP vs one process", _losses(ddp), one32),
                                    ("DeepSpeed ZeRO-2 vs DDP", _losses(ds), _losses(ddp))):
        result = parity.check(curve, reference, floor)
        print(f"{label}: {parity.describe(result)}")
        assert result["ok"], f"{label}: {parity.describe(result)}"
    assert ddp.result["global_batch"] == ds.result["global_batch"] == 16 * 2 * 2
    # what each rank sends per optimizer step: DDP all-reduces the gradients once (no_sync on the first micro batch)
    params = ddp.result["params"]
    assert results.comm_per_step(ddp)["all_reduce"]["bytes"] == 4 * params
    assert results.comm_per_step(ds)["total_sent_bytes"] > 0


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


@slow
def test_warmup_rates_in_real_runs_follow_the_formulas(module_runs_root):
    ddp = _ddp(["--steps", "6", "--warmup-steps", "3", "--lr", "0.01"])
    ds = _ds(["--steps", "6", "--warmup-steps", "3", "--lr", "0.01", "--stage", "1"])
    for run, formula in ((ddp, schedules.torch_warmup_lr), (ds, schedules.deepspeed_warmup_lr)):
        lrs = [r["lr"] for r in metrics.steps(run.metrics, 0)]
        assert lrs == pytest.approx([formula(k, 0.01, 3) for k in range(6)])


@slow
def test_bf16_runs_on_cpu_autocast_keeps_fp32_states_and_deepspeed_stores_bf16_weights(module_runs_root):
    ddp = _ddp(["--steps", "3", "--bf16"])
    ds = _ds(["--steps", "3", "--bf16", "--stage", "2"])
    assert ddp.result["dtype"] == "bf16-autocast" and ds.result["dtype"] == "bf16"
    for run in (ddp, ds):
        assert all(math.isfinite(x) for x in _losses(run))
    p = ddp.result["params"]
    assert ddp.result["model_state_bytes"]["params"] == 4 * p  # autocast: the weights stay fp32
    assert ds.result["model_state_bytes"]["params"] == pytest.approx(2 * p, rel=1e-3)  # bf16 weights


@slow
def test_every_rank_reports_memory_and_step_time_each_step(module_runs_root):
    run = _ddp(["--steps", "3", "--model", "memory", "--params", "1000000"])
    for rank in (0, 1):
        records = metrics.steps(run.metrics, rank)
        assert [r["step"] for r in records] == [1, 2, 3]  # steps are numbered from 1 (helpers.rank.metrics)
        assert all(r["rss_mib"] > 0 and r["step_s"] > 0 for r in records)
    row = results.summary(run, "DDP")
    assert row["model_states_mib"] * 2**20 == pytest.approx(16 * run.result["params"], rel=1e-3)
    assert set(row["max_rss_mib_by_rank"]) == {0, 1}


@slow
def test_compiled_ddp_trains_like_eager(module_runs_root):
    eager = _ddp(["--steps", "4"])
    compiled = _ddp(["--steps", "4", "--compile"])
    assert compiled.result["compiled"] is True
    floor = parity.floor(_one_process_losses(torch.float32, steps=4, accumulation=1),
                         _one_process_losses(torch.float64, steps=4, accumulation=1))
    result = parity.check(_losses(compiled), _losses(eager), floor)  # fused kernels: another fp32 ordering
    print(f"compiled vs eager: {parity.describe(result)}")
    assert result["ok"], f"compiled vs eager: {parity.describe(result)}"
