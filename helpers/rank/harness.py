"""The rank-side harness: what every training script in ``course/`` repeats and no lesson is about.

A course script writes out the distributed lines its chapter teaches (``init_process_group``, ``DistributedSampler``
and ``set_epoch``, ``DDP(...)``, ``deepspeed.initialize(...)``, ``fully_shard(...)``, the collectives). Everything
else lives here, once:

* :func:`parser` -- the data, model and run flags every training script shares; scripts add their own.
* :func:`dtype_flag` and :func:`train_dtype` -- ``--dtype fp32|fp64`` for the plain PyTorch scripts (DDP, FSDP2):
  fp64 is how a test measures the noise floor of fp32 rounding (:mod:`helpers.calc.parity`).
* :func:`datasets` and :func:`build_model` -- the data set (with the synthetic-data announcement) and the model.
* :class:`Meter` -- one step numbering (the first step is 1, a step's number is how many steps are done when it
  ends), the step clock (data fetch to finished work), warm-up skip, memory sampling, the step records, the
  progress log line, and the result record with steady-state throughput as :mod:`helpers.calc.throughput`
  defines it.
* :func:`count_ddp_comms`, :func:`count_fsdp_comms`, :func:`count_deepspeed_comms` -- what a rank hands to
  collectives, behind one interface (:class:`CommCounter`).
* :func:`evaluate` -- test accuracy, the work split between ranks.

Example (inside a rank)::

    args = harness.parser("DDP training").parse_args()
    train_ds, test_ds, info = harness.datasets(args)
    meter = harness.Meter(total_steps, device, world_size, samples_per_step=args.batch_size * world_size,
                          skip=args.skip_steps)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in meter.batches(loader):   # the step clock starts before each batch is fetched
            ...
            meter.step(loss=loss.item(), epoch=epoch, samples=labels.size(0))
    meter.finish()                                     # every rank: the step times of all ranks are gathered
    meter.report(framework="ddp", test_accuracy=evaluate(model, test_ds, device))
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from ..calc.throughput import steady_samples_per_s
from . import memcap
from .data import get_datasets
from .metrics import Reporter
from .models import SimpleCNN, make_memory_model
from .runtime import log0
from .state import memory_now, peak_memory


def parser(description: str, *, steps: int | None = None, test_size: int | None = None,
           steps_are: str = "steps") -> argparse.ArgumentParser:
    """The flags every training script shares. ``steps`` given: the run is counted in optimizer steps (``--steps``,
    this default); otherwise in ``--epochs`` (1), or ``--steps`` when given (``steps_are`` says what a step is).
    Add model flags with :func:`model_flags`."""
    p = argparse.ArgumentParser(description=description)
    if steps is None:
        p.add_argument("--epochs", type=int, default=1)
        p.add_argument("--steps", type=int, default=None, help=f"stop after this many {steps_are} (instead of epochs)")
    else:
        p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="per rank; the global batch is this x WORLD_SIZE")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=["auto", "cifar10", "synthetic"], default="auto")
    p.add_argument("--data-root", default="data")
    p.add_argument("--train-size", type=int, default=None, help="use a subset of the training images")
    p.add_argument("--test-size", type=int, default=test_size, help="use a subset of the test images")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--skip-steps", type=int, default=5,
                   help="warm-up steps left out of samples_per_s: allocator, first bucketing and all-reduce, compile")
    return profile_flag(p)


PROFILE_ENV = "HELPERS_PROFILE_STEPS"


class _ProfileSteps(argparse.Action):
    """Stores the flag and hands it to every :class:`Meter` of the process through ``$HELPERS_PROFILE_STEPS``:
    profiling is the harness's business, so a course script's lines stay its lesson's."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values < 0:
            parser.error(f"--profile-steps must be 0 or more, got {values}")
        setattr(namespace, self.dest, values)
        os.environ[PROFILE_ENV] = str(values)


def profile_flag(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--profile-steps N``: profile N steady-state steps (after ``--skip-steps``) with ``torch.profiler`` and write
    one Chrome trace per rank into the run directory (:class:`Meter`, which reads it from $HELPERS_PROFILE_STEPS)."""
    p.add_argument("--profile-steps", type=int, default=0, action=_ProfileSteps,
                   help="profile this many steps after the warm-up ones; a trace per rank in the run directory")
    return p


DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def dtype_flag(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--dtype fp32`` (default) or ``fp64``: the dtype of the weights, gradients, optimizer state and inputs.

    Only for the plain PyTorch scripts (DDP, FSDP2), which train in any dtype the model is built in. fp64 is not a
    lesson but a measurement: float addition is not associative, so a distributed fp32 run drifts from the
    one-process fp32 run; the one-process run in fp64 shows how large that drift is (:mod:`helpers.calc.parity`).
    DeepSpeed has no fp64 (its own ``--dtype`` offers fp32, bf16 and fp16)."""
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="fp64: measure the noise floor of fp32 rounding against this run (tests, notebook 07)")
    return p


def train_dtype(args) -> torch.dtype:
    """The torch dtype of ``--dtype`` (:func:`dtype_flag`)."""
    return DTYPES[args.dtype]


def model_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--model cnn (SimpleCNN) or memory (a wide MLP of --params parameters and --depth layers)."""
    p.add_argument("--model", choices=["cnn", "memory"], default="cnn", help="memory: a wide MLP of --params")
    p.add_argument("--params", type=int, default=20_000_000, help="parameters of --model memory")
    p.add_argument("--depth", type=int, default=4, help="layers of --model memory")
    return p


def tuning_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The knobs of chapter 05 that course/ddp_tuning.py and its DeepSpeed twin course/ds_tuning.py share, so a
    diff of the two scripts shows only what the DeepSpeed engine changes. Each script adds its own flags
    (``--compile``; ``--stage``, ``--offload`` ...) to the parser this returns."""
    p.add_argument("--accumulation", type=int, default=1, help="micro batches per optimizer step")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--clip", type=float, default=None, help="max global gradient norm (off without it)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear LR warmup from 0 over this many steps")
    p.add_argument("--bf16", action="store_true",
                   help="bf16: autocast in the DDP script; bf16 weights and gradients with an fp32 master copy in DeepSpeed")
    p.add_argument("--save-dir", default=None, help="save a checkpoint here at the end")
    return model_flags(p)


def datasets(args):
    """``(train_ds, test_ds, info)`` from the shared flags; rank 0 announces which data it is (CIFAR-10, or
    generated data whose numbers are not CIFAR-10 results). Rank 0 finds or downloads the data while the others
    wait (:func:`helpers.rank.data.get_datasets`)."""
    train_ds, test_ds, info = get_datasets(args.dataset, args.data_root, args.train_size, args.test_size, args.seed)
    memcap.apply_from_env()  # COURSE_MEMORY_CAP_MIB set: cap this rank's memory from here on (helpers/rank/memcap.py)
    log0(info.announcement)
    return train_ds, test_ds, info


def build_model(args, num_classes: int = 10) -> torch.nn.Module:
    """SimpleCNN, or with ``--model memory`` the wide MLP of ``--params`` parameters (:func:`model_flags`)."""
    if getattr(args, "model", "cnn") == "memory":
        return make_memory_model(args.params, args.depth)
    return SimpleCNN(num_classes)


class CommCounter:
    """Calls and bytes this rank handed to each collective: ``{op: {"calls", "bytes"}}`` (``bytes``: what the rank
    passes in, as :func:`helpers.calc.comm.bytes_sent_per_rank` expects). :class:`Meter` resets it after the first
    step and divides by the steps after it, as it does for the timing."""

    def __init__(self, ops=()):
        self.counts = {op: {"calls": 0, "bytes": 0} for op in ops}

    def add(self, op: str, tensor) -> None:
        entry = self.counts.setdefault(op, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        for entry in self.counts.values():
            entry.update(calls=0, bytes=0)

    def per_step(self, steps: int) -> dict | None:
        return {op: {k: v / max(1, steps) for k, v in c.items()} for op, c in self.counts.items()} or None


def _counting_allreduce_hook(counter: CommCounter, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter.add("all_reduce", bucket.buffer())
    return allreduce_hook(None, bucket)


def count_ddp_comms(ddp) -> CommCounter:
    """A DDP communication hook that counts every gradient bucket, then all-reduces it as DDP would."""
    counter = CommCounter(["all_reduce"])
    ddp.register_comm_hook(counter, _counting_allreduce_hook)
    return counter


def count_fsdp_comms(model) -> CommCounter:
    """FSDP2's own all-gather and reduce-scatter on every FSDP module, counting this rank's shard it hands to the
    all-gather and the whole gradient input of the reduce-scatter."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    counter = CommCounter(["all_gather_into_tensor", "reduce_scatter_tensor"])

    class CountingAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            counter.add("all_gather_into_tensor", input_tensor)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            counter.add("reduce_scatter_tensor", input_tensor)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(CountingAllGather())
            m.set_custom_reduce_scatter(CountingReduceScatter())
    return counter


class _DeepSpeedComms(CommCounter):
    """DeepSpeed's comms_logger (``"comms_logger": {"enabled": true, "prof_all": true}`` in the ds_config), read
    as a :class:`CommCounter`: ``comms_dict`` is ``{collective: {message bytes: [calls, ...]}}``."""

    def __init__(self):
        from deepspeed.comm import comm as ds_comm
        self._log = ds_comm.comms_logger
        super().__init__()

    def reset(self) -> None:
        self._log.comms_dict.clear()

    def per_step(self, steps: int) -> dict | None:
        self.counts = {op: {"calls": sum(v[0] for v in sizes.values()),
                            "bytes": sum(size * v[0] for size, v in sizes.items())}
                       for op, sizes in self._log.comms_dict.items()}
        return super().per_step(steps)


def count_deepspeed_comms() -> CommCounter:
    """What DeepSpeed's comms_logger recorded, behind the :class:`CommCounter` interface."""
    return _DeepSpeedComms()


class Meter:
    """Numbers, times and records the steps of one training loop (module docstring). One per script run.

    ``total``: the step the run ends at; ``start``: the step it starts after (a resumed run), so this run does
    ``total - start`` steps and its first is ``start + 1``. ``samples_per_step``: samples of one step, all ranks.
    ``skip``: warm-up steps of this run left out of ``samples_per_s``. ``memory``: sample RSS (and CUDA) memory
    into each step record. ``comm``: a :class:`CommCounter` reset after the first step. ``profile`` (default: the
    ``--profile-steps`` flag, through $HELPERS_PROFILE_STEPS): profile that many steps after the ``skip`` warm-up
    ones (the last warm-up step is the profiler's own warm-up) and write
    ``trace_rank<RANK>.json`` (Chrome trace format) into the run directory ($HELPERS_RUN_DIR, else the working
    directory); each profiled step is a ``ProfilerStep#`` span.
    """

    def __init__(self, total: int, device, world_size: int, *, samples_per_step: int, skip: int = 5, start: int = 0,
                 memory: bool = False, comm: CommCounter | None = None, log_every: int = 20,
                 reporter: Reporter | None = None, profile: int | None = None):
        self.rep = reporter or Reporter()
        self.device, self.world_size, self.samples_per_step = device, world_size, samples_per_step
        self.total, self.start, self.done = total, start, start
        self.skip = max(0, min(skip, total - start - 1))
        self.memory, self.comm, self.log_every = memory, comm, log_every
        self.step_s: list[float] = []
        self.samples = 0
        self._t0 = self._began = None
        self.summary: dict = {}
        self._comm = None
        if profile is None:  # the --profile-steps flag of the shared parsers, or the launcher's environment
            profile = int(os.environ.get(PROFILE_ENV) or 0)
        if profile < 0:
            raise ValueError(f"--profile-steps must be 0 or more, got {profile}")
        self.profile = min(profile, total - start - self.skip)  # no more than the steady steps there are
        self._prof = None
        self.trace_path: str | None = None
        self.rep.total(total - start, start=start)  # the launcher's progress bar

    @property
    def current(self) -> int:
        """The number of the step in progress (``done + 1``)."""
        return self.done + 1

    def _begin(self) -> None:
        if self.profile and self._prof is None and self.current == self.start + max(self.skip, 1):
            self._start_profiler()
        self._t0 = time.perf_counter()
        if self._began is None:
            self._began = self._t0

    def _start_profiler(self) -> None:
        from pathlib import Path

        from torch.profiler import ProfilerActivity, profile, schedule

        from .metrics import RUN_DIR_ENV

        rank = dist.get_rank() if dist.is_initialized() else 0
        path = Path(os.environ.get(RUN_DIR_ENV) or ".") / f"trace_rank{rank}.json"
        warmup = 1 if self.skip else 0  # the last warm-up step warms the profiler up, outside the trace

        def export(prof):
            prof.export_chrome_trace(str(path))
            self.trace_path = str(path)

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=activities, on_trace_ready=export,
                             schedule=schedule(wait=0, warmup=warmup, active=self.profile, repeat=1))
        self._prof.start()

    def batches(self, loader):
        """The loader's batches until the run's last step; each step's clock starts before its batch is fetched."""
        it = iter(loader)
        while self.done < self.total:
            self._begin()
            try:
                batch = next(it)
            except StopIteration:
                return
            yield batch

    def steps(self):
        """The numbers of the steps still to run, for loops that fetch their own (micro) batches."""
        while self.done < self.total:
            self._begin()
            yield self.current

    def step(self, *, loss: float, samples: int, epoch: int | None = None, **fields) -> int:
        """End the step: wait for the device, read the clock, write the step record, log every ``log_every``
        steps and the last. Returns the step's number."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # GPU work is asynchronous: the clock must see it finished
        step_s = time.perf_counter() - self._t0
        self.done += 1
        self.samples += samples
        self.step_s.append(step_s)
        if self.comm is not None and len(self.step_s) == 1:
            self.comm.reset()  # count the steps after the first, like the timing
        extra = dict(fields, **memory_now(self.device)) if self.memory else fields
        if epoch is not None:
            extra["epoch"] = epoch
        self.rep.step(self.done, loss=loss, samples=samples, step_s=step_s, **extra)
        if self._prof is not None and self.trace_path is None:
            self._prof.step()
            if self.trace_path is not None:  # the last profiled step: the trace is written, the profiler done
                self._prof.stop()
        if self.done % self.log_every == 0 or self.done == self.total:
            shown = "".join(f" {k} {fields[k]:{f}}" for k, f in (("grad_norm", ".3f"), ("lr", ".2e")) if k in fields)
            log0(f"{'' if epoch is None else f'epoch {epoch} '}step {self.done}/{self.total} loss {loss:.4f}{shown}")
        return self.done

    def finish(self) -> dict:
        """Call on every rank after the loop: gathers every rank's step times (one collective) and computes the
        run's summary (``train_seconds``, ``first_step_s``, ``samples_per_s``, ``timed_steps``, ``train_samples``)."""
        train_seconds = time.perf_counter() - self._began if self._began is not None else 0.0
        mine = torch.tensor(self.step_s, dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        rate = steady_samples_per_s([t.tolist() for t in every], self.samples_per_step, self.skip)
        self.summary = dict(train_seconds=train_seconds, first_step_s=self.step_s[0] if self.step_s else None,
                            samples_per_s=rate, timed_steps=max(0, len(self.step_s) - self.skip),
                            train_samples=self.samples * self.world_size)
        # read now: evaluation and checkpointing after the loop run collectives of their own (ZeRO-3, FSDP2)
        self._comm = self.comm.per_step(len(self.step_s) - 1) if self.comm is not None else None
        return self.summary

    def comm_per_step(self) -> dict | None:
        """What the counter saw per step over the training steps after the first (as of :meth:`finish`)."""
        return self._comm

    def throughput_line(self) -> str:
        rate = self.summary.get("samples_per_s")
        first = self.start + self.skip + 1
        return f"{rate:.0f} samples/s (median step, steps {first}-{self.done})" if rate else "no steady-state steps"

    def report(self, **fields) -> None:
        """On rank 0: the result record, the run's summary and peak memory (field meanings:
        :class:`helpers.rank.metrics.TrainResult`) plus ``fields``. Call :meth:`finish` first."""
        if dist.get_rank() == 0:
            self.rep.result(world_size=self.world_size, **self.summary, **peak_memory(self.device), **fields)


@torch.no_grad()
def evaluate(model, test_ds, device, *, dtype=None, batch_size: int = 256) -> float:
    """Test accuracy over the whole test set, with the work split between ranks; every rank calls it.

    Each rank scores every WORLD_SIZE-th image starting at its rank, then all_reduce adds up the counts (a
    DistributedSampler would pad the shards by repeating images, counting some twice). Under ZeRO-3 and FSDP2 every
    forward all-gathers the sharded parameters, a collective, so every rank runs the same number of forwards: a rank
    with one batch fewer runs one extra, uncounted. Pass the plain module for DDP (no gradients: nothing to sync).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model.eval()
    loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world_size)), batch_size=batch_size)
    counts = torch.zeros(2, dtype=torch.long, device=device)  # [correct, seen]
    images = None
    for images, labels in loader:
        images, labels = images.to(device, dtype), labels.to(device)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += labels.numel()
    for _ in range(math.ceil(math.ceil(len(test_ds) / world_size) / batch_size) - len(loader)):
        model(images[:1] if images is not None else test_ds[0][0][None].to(device, dtype))
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    model.train()
    return counts[0].item() / max(1, counts[1].item())


def batches(loader, sampler):
    """Micro batches forever, reshuffled each epoch (``sampler.set_epoch``): for loops that count steps, not epochs."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader
