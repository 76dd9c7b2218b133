"""Write-the-code exercises: the learner's function runs on real gloo ranks, the reference passes, and each classic
mistake gets its own hint.

The wrong answers below are the mistakes the checkers name. Each checker launches its reference and one wrong answer on
real ranks in the slow tier; the other answers replay the per-rank outcomes `make record` recorded from real launches
(tests/recorded.py: stale when the task script, the answer or torch changed), so judging them is fast.
"""
import textwrap

import pytest

import torch
import torch.distributed as dist

from helpers.notebook.exercises import ranks, solutions, write, write_zero
from recorded import mistakes


def _code(text: str) -> str:
    return textwrap.dedent(text)


# --- decided before anything launches --------------------------------------------------------------------------

def test_an_untouched_outline_is_answered_without_a_launch(monkeypatch):
    monkeypatch.setattr(write, "run_on_ranks", lambda *a, **k: pytest.fail("launched an outline"))
    for stub in ("def ring_all_reduce(tensor):\n    ...\n",
                 "def ring_all_reduce(tensor):\n    '''Sum in place.'''\n    raise NotImplementedError\n"):
        verdict = write.check_ring_all_reduce(stub)
        assert not verdict and "outline" in verdict.message and "nothing was launched" in verdict.message
    assert not write.check_ddp_train("def train(model, dataset, epochs):\n    pass\n")


def test_code_without_the_function_is_a_verdict_not_a_traceback():
    verdict = write.check_ring_all_reduce("def ring(tensor):\n    return tensor\n")
    assert not verdict and "no function named ring_all_reduce" in verdict.message


def test_the_tasks_launch_on_a_one_gpu_machine_as_cpu_ranks(monkeypatch, tmp_path):
    """The task scripts are gloo programs: the checker hides the GPUs, which the launcher needs to accept 2 ranks on a
    machine with one GPU (it refuses more CUDA ranks than GPUs)."""
    from helpers import launch

    one_gpu = launch.Machine(gpus=1, cpus=8)
    with pytest.raises(launch.LaunchError, match="1 GPU"):
        launch.LaunchSpec.check("torchrun", ranks.TASKS / "ring.py", 2, ["--answer", "a.py"], machine=one_gpu)
    launch.LaunchSpec.check("torchrun", ranks.TASKS / "ring.py", 2, ["--answer", "a.py"], env=ranks.TASK_ENV,
                            machine=one_gpu)
    seen = {}

    def fake_torchrun(*args, **kwargs):
        seen.update(kwargs)
        raise launch.LaunchError("not launched in this test")

    monkeypatch.setattr(launch, "runs_root", lambda: tmp_path)
    monkeypatch.setattr(launch, "torchrun", fake_torchrun)
    outcomes, error = ranks.run_on_ranks("ring", "def ring_all_reduce(t):\n    pass\n", "ring_all_reduce", 2)
    assert outcomes == {} and error is not None
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == ""


def test_a_written_body_is_not_an_outline():
    assert not ranks.is_stub("def f(t):\n    ...\n    t += 1\n", "f")
    assert ranks.is_stub("def f(t):\n    '''doc'''\n    ...\n", "f")


def test_the_solution_is_shown_only_on_request_and_is_real_code():
    source = write.solution("ring_all_reduce")
    assert "dist.isend" in source and "def ring_all_reduce" in source
    with pytest.raises(ValueError, match="no solution named"):
        write.solution("nope")


# --- ring all-reduce (notebook 01) -------------------------------------------------------------------------------


WRONG_RINGS = {
    "built-in collective": ("""
        def ring_all_reduce(tensor):
            dist.all_reduce(tensor)
        """, "point-to-point messages only"),
    "mean instead of sum": ("""
        def ring_all_reduce(tensor):
            rank, world = dist.get_rank(), dist.get_world_size()
            total, buf = tensor.clone(), tensor.clone()
            for _ in range(world - 1):
                incoming = torch.empty_like(buf)
                reqs = [dist.isend(buf, (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)]
                [r.wait() for r in reqs]
                total += incoming
                buf = incoming
            tensor.copy_(total / world)
        """, "That is the mean"),
    "reduce-scatter only": ("""
        def ring_all_reduce(tensor):
            rank, world = dist.get_rank(), dist.get_world_size()
            chunks = list(torch.tensor_split(tensor, world))
            for step in range(world - 1):
                send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
                incoming = torch.empty_like(chunks[recv_i])
                reqs = [dist.isend(chunks[send_i], (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)]
                [r.wait() for r in reqs]
                chunks[recv_i] += incoming
        """, "all-gather steps pass the finished"),
    "torch.chunk on a short tensor": ("""
        def ring_all_reduce(tensor):
            rank, world = dist.get_rank(), dist.get_world_size()
            chunks = list(torch.chunk(tensor, world))
            for phase in (0, 1):
                for step in range(world - 1):
                    send_i = (rank - step + phase) % world
                    recv_i = (send_i - 1) % world
                    incoming = torch.empty_like(chunks[recv_i])
                    reqs = [dist.isend(chunks[send_i], (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)]
                    [r.wait() for r in reqs]
                    chunks[recv_i].add_(incoming) if phase == 0 else chunks[recv_i].copy_(incoming)
        """, "torch.tensor_split"),
    "whole tensor round the ring": ("""
        def ring_all_reduce(tensor):
            rank, world = dist.get_rank(), dist.get_world_size()
            total, buf = tensor.clone(), tensor.clone()
            for _ in range(world - 1):
                incoming = torch.empty_like(buf)
                reqs = [dist.isend(buf, (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)]
                [r.wait() for r in reqs]
                total += incoming
                buf = incoming
            tensor.copy_(total)
        """, "Send one chunk (1/N of the tensor) per step"),
    # bypasses: the sums come out right, but a built-in collective made them, however it was reached
    "all_reduce under another name": ("""
        def ring_all_reduce(tensor):
            from torch.distributed import all_reduce as ar
            ar(tensor)
        """, "point-to-point messages only"),
    "all_reduce_coalesced": ("""
        def ring_all_reduce(tensor):
            dist.all_reduce_coalesced([tensor])
        """, "point-to-point messages only"),
    "an object collective": ("""
        def ring_all_reduce(tensor):
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, tensor.tolist())
            tensor.copy_(torch.tensor(gathered).sum(0))
        """, "point-to-point messages only"),
    "a functional collective": ("""
        def ring_all_reduce(tensor):
            import torch.distributed._functional_collectives as funcol
            tensor.copy_(funcol.wait_tensor(funcol.all_reduce(tensor, "sum", dist.group.WORLD)))
        """, "point-to-point messages only"),
    "written for 3 ranks only": ("""
        def ring_all_reduce(tensor):
            rank = dist.get_rank()
            chunks = list(torch.tensor_split(tensor, 3))
            for phase in (0, 1):
                for step in range(2):
                    send_i = (rank - step + phase) % 3
                    recv_i = (send_i - 1) % 3
                    incoming = torch.empty_like(chunks[recv_i])
                    reqs = [dist.isend(chunks[send_i], (rank + 1) % 3), dist.irecv(incoming, (rank - 1) % 3)]
                    [r.wait() for r in reqs]
                    chunks[recv_i].add_(incoming) if phase == 0 else chunks[recv_i].copy_(incoming)
        """, "ran through on 3 ranks and hung on 2"),
    "a list sent, not a tensor": ("""
        def ring_all_reduce(tensor):
            dist.send(tensor.tolist(), (dist.get_rank() + 1) % dist.get_world_size())
        """, "The error is raised inside torch.distributed"),
    "a rank that never sends": ("""
        def ring_all_reduce(tensor):
            rank, world = dist.get_rank(), dist.get_world_size()
            incoming = torch.empty_like(tensor)
            if rank != 0:
                dist.send(tensor, (rank + 1) % world)
            dist.recv(incoming, (rank - 1) % world)
            tensor += incoming
        """, "Post the receive too"),
}


@pytest.mark.slow
def test_the_reference_ring_passes_on_three_ranks():
    verdict = write.check_ring_all_reduce(solutions.ring_all_reduce, nproc=3)
    assert verdict and "on 3 and 2 ranks" in verdict.message and "1.333 x the tensor" in verdict.message, verdict


P2P_RING = """
    def ring_all_reduce(tensor):
        rank, world = dist.get_rank(), dist.get_world_size()
        chunks = list(torch.tensor_split(tensor, world))
        for phase in (0, 1):
            for step in range(world - 1):
                send_i = (rank - step + phase) % world
                recv_i = (send_i - 1) % world
                incoming = torch.empty_like(chunks[recv_i])
                ops = [dist.P2POp(dist.isend, chunks[send_i], (rank + 1) % world),
                       dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
                chunks[recv_i].add_(incoming) if phase == 0 else chunks[recv_i].copy_(incoming)
    """


def test_the_ring_from_torchs_docs_with_batch_isend_irecv_passes(exercise_ranks):
    """dist.P2POp checks that its op *is* dist.isend or dist.irecv: the checker counts bytes below them, at the
    process group, so torch's own ring (its docs' batch_isend_irecv example) passes."""
    verdict = write.check_ring_all_reduce(_code(P2P_RING), nproc=3)
    assert verdict and "1.333 x the tensor" in verdict.message, verdict


def _next_rank(rank, world):  # a helper beside the learner's function, as a notebook cell would define it
    return (rank + RING_STEP) % world


RING_STEP = 1


def ring_with_a_helper(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor, world))
    for phase in (0, 1):
        for step in range(world - 1):
            send_i = (rank - step + phase) % world
            recv_i = (send_i - 1) % world
            incoming = torch.empty_like(chunks[recv_i])
            reqs = [dist.isend(chunks[send_i], _next_rank(rank, world)), dist.irecv(incoming, (rank - 1) % world)]
            [r.wait() for r in reqs]
            chunks[recv_i].add_(incoming) if phase == 0 else chunks[recv_i].copy_(incoming)


def test_a_helper_defined_beside_the_function_is_shipped_with_it(exercise_ranks):
    source = ranks.function_source(ring_with_a_helper, "ring_with_a_helper")
    assert "def _next_rank(rank, world):" in source and "RING_STEP = 1" in source, source
    ring = ranks.function_source(ring_with_a_helper, "ring_with_a_helper").replace(
        "def ring_with_a_helper(", "def ring_all_reduce(")
    verdict = write.check_ring_all_reduce(ring, nproc=3)
    assert verdict, verdict


def test_the_reference_ring_passes_on_two_ranks(exercise_ranks):
    verdict = write.check_ring_all_reduce(solutions.ring_all_reduce, nproc=2)
    assert verdict and "1.000 x the tensor" in verdict.message, verdict


@pytest.mark.parametrize("mistake", mistakes(WRONG_RINGS, launched="mean instead of sum"))
def test_each_ring_mistake_gets_its_hint(mistake, monkeypatch, exercise_ranks):
    monkeypatch.setattr(ranks, "STALL_S", 10)  # the hang case: the launcher's stall timeout, shortened
    code, hint = WRONG_RINGS[mistake]
    verdict = write.check_ring_all_reduce(_code(code), nproc=3)
    assert not verdict, verdict
    assert hint in verdict.hint, verdict


# --- DDP from a one-process loop (notebook 02) -------------------------------------------------------------------

LOOP = """
    def train(model, dataset, epochs):
        {wrap}
        {sampler}
        loader = DataLoader(dataset, batch_size=4, {loader_args})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(epochs):
            {set_epoch}
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                {step}
        return model
    """
RIGHT = dict(wrap="model = DDP(model)", sampler="sampler = DistributedSampler(dataset)",
             loader_args="sampler=sampler", set_epoch="sampler.set_epoch(epoch)", step="optimizer.step()")
WRONG_LOOPS = {
    "no DDP wrap": (dict(wrap="pass"), "Wrap the model in DDP(model)"),
    "no DistributedSampler": (dict(sampler="pass", loader_args="shuffle=True", set_epoch="pass"),
                              "Give the DataLoader a DistributedSampler"),
    "no set_epoch": (dict(set_epoch="pass"), "Call sampler.set_epoch(epoch)"),
    "sampler and shuffle": (dict(loader_args="sampler=sampler, shuffle=True"), "leave out shuffle=True"),
    "no optimizer step": (dict(step="pass"), "optimizer.step()"),
}


def _loop(**changes) -> str:
    return _code(LOOP).format(**{**RIGHT, **changes})


@pytest.mark.slow
def test_the_reference_ddp_loop_passes():
    assert write.check_ddp_train(solutions.train)


def test_the_written_out_ddp_loop_passes_on_three_ranks(exercise_ranks):
    assert write.check_ddp_train(_loop(), nproc=3)


@pytest.mark.parametrize("mistake", mistakes(WRONG_LOOPS, launched="no set_epoch"))
def test_each_ddp_mistake_gets_its_hint(mistake, exercise_ranks):
    changes, hint = WRONG_LOOPS[mistake]
    verdict = write.check_ddp_train(_loop(**changes))
    assert not verdict, verdict
    assert hint in verdict.hint, verdict


# --- fully_shard (notebook 07) -------------------------------------------------------------------------------------

SHARD = """
    def shard(model):
        {before}
        {blocks}
        {root}
        {after}
        return {returned}
    """
SHARD_RIGHT = dict(before="pass", blocks="for block in model[:-1]: fully_shard(block)", root="fully_shard(model)",
                   after="optimizer = torch.optim.SGD(model.parameters(), lr=0.05)", returned="model, optimizer")
WRONG_SHARDS = {
    "optimizer built before sharding": (dict(before="optimizer = torch.optim.SGD(model.parameters(), lr=0.05)",
                                             after="pass"), "Build the optimizer after fully_shard"),
    "no fully_shard at all": (dict(blocks="pass", root="pass"), "Call fully_shard(module) on each block"),
    "blocks only, not the root": (dict(root="pass"), "Finish with fully_shard(model) on the root"),
    "the root only": (dict(blocks="pass"), "fully_shard each block before the root"),
    "no optimizer returned": (dict(returned="model"), "Return both"),
    "another optimizer": (dict(after="optimizer = torch.optim.Adam(model.parameters(), lr=0.05)"),
                          "Use the optimizer the exercise gives"),
}


def _shard(**changes) -> str:
    return _code(SHARD).format(**{**SHARD_RIGHT, **changes})


def test_the_parity_bound_is_a_multiple_of_the_measured_floor_and_never_zero():
    floor, tolerance = ranks.parity_bound([2.0, 1.5], [2.0 + 1e-6, 1.5])
    assert floor == pytest.approx(1e-6) and tolerance == ranks.PARITY_K * floor
    floor, _ = ranks.parity_bound([2.0, 1.5], [2.0, 1.5])  # bitwise equal runs: one float32 rounding of the loss
    assert floor == 2.0 ** -23 * 2.0


@pytest.mark.slow
def test_the_reference_sharding_passes():
    assert write.check_fully_shard(solutions.shard, nproc=2)


def test_the_written_out_sharding_passes_on_three_ranks(exercise_ranks):
    verdict = write.check_fully_shard(_shard(), nproc=3)
    assert verdict and "about 1/3" in verdict.message, verdict


@pytest.mark.parametrize("mistake", mistakes(WRONG_SHARDS, launched="no optimizer returned"))
def test_each_sharding_mistake_gets_its_hint(mistake, exercise_ranks):
    changes, hint = WRONG_SHARDS[mistake]
    verdict = write.check_fully_shard(_shard(**changes))
    assert not verdict, verdict
    assert hint in verdict.hint, verdict


# --- gradient accumulation with no_sync (notebook 05) --------------------------------------------------------------

STEP = """
    def train_step(model, optimizer, micro_batches):
        {zero_outside}
        for i, (x, y) in enumerate(micro_batches):
            {zero_inside}
            with model.no_sync() if {quiet} else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(model(x), y){scale}
            {backward}
        optimizer.step()
    """
STEP_RIGHT = dict(zero_outside="optimizer.zero_grad()", zero_inside="pass", scale=" / len(micro_batches)",
                  quiet="i < len(micro_batches) - 1",
                  backward="with model.no_sync() if {quiet} else contextlib.nullcontext(): loss.backward()")
WRONG_STEPS = {
    "no no_sync": ("""
        def train_step(model, optimizer, micro_batches):
            optimizer.zero_grad()
            for x, y in micro_batches:
                (nn.functional.cross_entropy(model(x), y) / len(micro_batches)).backward()
            optimizer.step()
        """, "Run every micro-batch but the last (forward and backward) inside"),
    "forward outside no_sync": (dict(quiet="False", backward="with model.no_sync() if i < len(micro_batches) - 1 "
                                                            "else contextlib.nullcontext(): loss.backward()"),
                                "Run the forward pass inside no_sync() too"),
    "no_sync on every micro-batch": (dict(quiet="True"), "Run the last micro-batch's backward outside no_sync"),
    "losses not averaged": (dict(scale=""), "Divide each micro-batch's loss"),
    "zero_grad before every micro-batch": (dict(zero_outside="pass", zero_inside="optimizer.zero_grad()"),
                                           "Zero the gradients once per optimizer step"),
}


def _step(**changes) -> str:
    values = {**STEP_RIGHT, **changes}
    values["backward"] = values["backward"].format(quiet=values["quiet"])
    return _code(STEP).format(**values)


@pytest.mark.slow
def test_the_reference_accumulation_passes():
    verdict = write.check_accumulation(solutions.train_step)
    assert verdict and "all-reduced 1 time(s)" in verdict.message, verdict


def test_the_written_out_accumulation_passes_on_three_ranks(exercise_ranks):
    assert write.check_accumulation(_step(), nproc=3)


@pytest.mark.parametrize("mistake", mistakes(WRONG_STEPS, launched="losses not averaged"))
def test_each_accumulation_mistake_gets_its_hint(mistake, exercise_ranks):
    changes, hint = WRONG_STEPS[mistake]
    verdict = write.check_accumulation(_code(changes) if isinstance(changes, str) else _step(**changes))
    assert not verdict, verdict
    assert hint in verdict.hint, verdict


# --- a resumable loop, killed mid-save (notebook 06) ---------------------------------------------------------------

SAVE = """
    def save_checkpoint(path, model, optimizer, step):
        if {writer}:
            state = {{"model": model.state_dict(), "step": step{optimizer}}}
            {write}
    """
LOAD = """
    def load_checkpoint(path, model, optimizer):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        {load_optimizer}
        return state["step"]{next}
    """
RESUME_RIGHT = dict(writer="dist.get_rank() == 0", optimizer=', "optimizer": optimizer.state_dict()',
                    write='torch.save(state, path + ".tmp"); os.replace(path + ".tmp", path)',
                    load_optimizer='optimizer.load_state_dict(state["optimizer"])', next=" + 1")
WRONG_RESUMES = {
    "every rank writes": (dict(writer="True"), "Write it from rank 0 only"),
    "written in place": (dict(write="torch.save(state, path)"), "os.replace()"),
    "resumed at the saved step": (dict(next=""), "Return the step after the saved one"),
    "no optimizer state": (dict(optimizer="", load_optimizer="pass"), "the optimizer's"),
    "nothing saved": (dict(writer="False"), "Save with torch.save"),
}


def _resume(**changes) -> tuple[str, str]:
    values = {**RESUME_RIGHT, **changes}
    return _code(SAVE).format(**values), _code(LOAD).format(**values)


@pytest.mark.slow
def test_the_reference_resume_passes():
    assert write.check_resumable(solutions.save_checkpoint, solutions.load_checkpoint)


def test_the_written_out_resume_passes(exercise_ranks):
    verdict = write.check_resumable(*_resume())
    assert verdict and "bitwise equal" in verdict.message, verdict


@pytest.mark.parametrize("mistake", mistakes(WRONG_RESUMES, launched="resumed at the saved step"))
def test_each_resume_mistake_gets_its_hint(mistake, exercise_ranks):
    changes, hint = WRONG_RESUMES[mistake]
    verdict = write.check_resumable(*_resume(**changes))
    assert not verdict, verdict
    assert hint in verdict.hint, verdict


# --- a ds_config within a memory budget, launched (notebook 03) ----------------------------------------------------

def _ds(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            **extra}


def test_the_budget_lies_between_zero_2_and_zero_3():
    from helpers.calc import memory
    from helpers.rank.models import count_parameters, make_memory_model
    params = count_parameters(make_memory_model(write.DS_PARAMS, 8))
    two, three = (memory.zero_model_state_bytes(params, 2, s, "mixed", k=12)["total"] for s in (2, 3))
    assert three < write.ds_budget_bytes(2) < two


def test_a_config_that_breaks_the_batch_rule_is_refused_before_a_launch():
    # the blog's config: 64 = 2 x 32 forgets the accumulation; here 64 != 4 x 2 x 2
    verdict = write.check_ds_config(_ds(3, train_batch_size=64))
    assert not verdict and "refused before it started" in verdict.message, verdict


class _MeasuredRun:
    """What launch.deepspeed returns, as the checker reads it: each rank's measured model-state bytes."""

    def __init__(self, held_bytes: float, nproc: int = 2):
        self.held, self.nproc = held_bytes, nproc

    def results_by_rank(self):
        return {r: {"model_state_bytes": {"total": self.held}} for r in range(self.nproc)}


WRONG_DS_CONFIGS = {  # (the config, what its launch measured or None: refused first, words of the hint)
    "not a dict": ("stage 3", None, "Write the config as a Python dict"),
    "empty": ({}, None, "Write the config as a Python dict"),
    "the batch rule broken": (_ds(3, train_batch_size=64), None, "Fix what the refusal says"),
    "another micro batch": ({**_ds(3), "train_micro_batch_size_per_gpu": 8}, 0.5, "train_micro_batch_size_per_gpu"),
    "a stage too low": (_ds(2), 2.0, "Partition more of the model states"),
}


@pytest.mark.parametrize("mistake", WRONG_DS_CONFIGS)
def test_each_ds_config_mistake_gets_its_hint(mistake, monkeypatch):
    """Judged from what the launch measured (its records, here given): the launch itself is proven by the slow test
    below and by notebook 03."""
    config, held, hint = WRONG_DS_CONFIGS[mistake]
    budget = write.ds_budget_bytes(2)
    if held is not None:
        monkeypatch.setattr(write_zero.launch, "deepspeed", lambda *a, **k: _MeasuredRun(held * budget))
    verdict = write.check_ds_config(config)
    assert not verdict and hint in verdict.hint, verdict
    if held is not None:  # the same path passes the asked-for batch within the budget
        monkeypatch.setattr(write_zero.launch, "deepspeed", lambda *a, **k: _MeasuredRun(0.5 * budget))
        assert write.check_ds_config(_ds(3))


@pytest.mark.slow
def test_the_reference_ds_config_passes_and_a_lower_stage_gets_its_hint():
    assert write.check_ds_config(solutions.ds_config()), "reference"
    too_low = write.check_ds_config(_ds(2))
    assert not too_low and "Partition more of the model states" in too_low.hint, too_low


# --- ZeRO-1 by hand (notebook 04) ------------------------------------------------------------------------------------

ZERO1 = """
    def zero1_train(model, batches):
        rank, world = dist.get_rank(), dist.get_world_size()
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        size = -(-numel // world)
        pad = world * size - numel
        flat = nn.functional.pad(parameters_to_vector(params).detach(), (0, pad))
        shard = flat[rank * size:(rank + 1) * size].clone().requires_grad_()
        optimizer = torch.optim.AdamW([shard], lr=0.01)
        for x, y in batches:
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            grad = nn.functional.pad(parameters_to_vector([p.grad for p in params]), (0, pad))
            {reduce}
            {before}
            optimizer.step()
            {gather}
    """
ZERO1_RIGHT = dict(reduce="dist.all_reduce(grad); shard.grad = grad[rank * size:(rank + 1) * size] / world",
                   before="pass",
                   gather="dist.all_gather_into_tensor(flat, shard.detach()); "
                          "vector_to_parameters(flat[:numel], params)")
WRONG_ZERO1 = {
    "every rank steps the whole model": ("""
        def zero1_train(model, batches):
            world = dist.get_world_size()
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
            for x, y in batches:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
                optimizer.step()
        """, "Give the optimizer your shard only"),
    "gradients summed, not averaged": (dict(reduce="dist.all_reduce(grad); "
                                              "shard.grad = grad[rank * size:(rank + 1) * size]"),
                                       "divide by the world size"),
    "no all-gather after the step": (dict(gather="flat[rank * size:(rank + 1) * size] = shard.detach(); "
                                               "vector_to_parameters(flat[:numel], params)"),
                                     "all-gather every rank's shard"),
    "gathered before the step": (dict(before=ZERO1_RIGHT["gather"], gather="pass"), "Step first, then gather"),
    "the remainder dropped": ("""
        def zero1_train(model, batches):
            rank, world = dist.get_rank(), dist.get_world_size()
            params = list(model.parameters())
            size = sum(p.numel() for p in params) // world
            flat = parameters_to_vector(params).detach().clone()
            shard = flat[rank * size:(rank + 1) * size].clone().requires_grad_()
            optimizer = torch.optim.AdamW([shard], lr=0.01)
            for x, y in batches:
                model.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                grad = parameters_to_vector([p.grad for p in params])
                dist.all_reduce(grad)
                shard.grad = grad[rank * size:(rank + 1) * size] / world
                optimizer.step()
                dist.all_gather_into_tensor(flat[:world * size], shard.detach())
                vector_to_parameters(flat, params)
        """, "rounding down drops the remainder"),
    "shards of different sizes": ("""
        def zero1_train(model, batches):
            rank, world = dist.get_rank(), dist.get_world_size()
            params = list(model.parameters())
            flat = parameters_to_vector(params).detach().clone()
            pieces = list(torch.tensor_split(flat, world))
            shard = pieces[rank].clone().requires_grad_()
            optimizer = torch.optim.AdamW([shard], lr=0.01)
            for x, y in batches:
                model.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                grad = parameters_to_vector([p.grad for p in params])
                dist.all_reduce(grad)
                shard.grad = list(torch.tensor_split(grad, world))[rank] / world
                optimizer.step()
                dist.all_gather(pieces, shard.detach())
                vector_to_parameters(flat, params)
        """, "pad the flat vector with zeros"),
    # bypass: right on the 2 ranks of the notebook's call, wrong on any other count
    "divided by 2, not the world size": (dict(reduce="dist.all_reduce(grad); "
                                                "shard.grad = grad[rank * size:(rank + 1) * size] / 2"),
                                         "works for one rank count only"),
    "gathered with an all-reduce": (dict(gather="full = torch.zeros_like(flat); "
                                              "full[rank * size:(rank + 1) * size] = shard.detach(); "
                                              "dist.all_reduce(full); flat.copy_(full); "
                                              "vector_to_parameters(flat[:numel], params)"),
                                    "Gather with dist.all_gather_into_tensor"),
}


def _zero1(**changes) -> str:
    return _code(ZERO1).format(**{**ZERO1_RIGHT, **changes})


def _zero1_outcome(world=2, numel=5, **runs_changes) -> dict:
    """A rank's record as the zero_shard task writes it, for a right answer (changed by ``runs_changes``)."""
    weights = [0.5, 0.25, -0.5, 1.0, 2.0]
    run = {"weights": weights, "steps": 3, "optimizers": 1, "held": 3, "state_bytes": 28, "sent_per_step": 30.0}
    runs = {"fp32": {**run, **runs_changes}, "fp64": {**run, **runs_changes}}
    return {"world_size": world, "numel": numel, "steps": 3, "start": [0.0] * numel, "whole_state_bytes": 56,
            "ddp_sent_per_step": 20.0, "runs": runs,
            "reference": {"fp32": weights, "fp64": weights, "summed": [w + 1 for w in weights],
                          "gather_first": [w - 1 for w in weights]}}


def _zero1_verdict(monkeypatch, *outcomes):
    """The verdict on one run at the rank count of ``outcomes`` (the task's records of its run, one per rank)."""
    runs = {rank: {"world_size": len(outcomes), "runs": [o]} for rank, o in enumerate(outcomes)}
    monkeypatch.setattr(write_zero, "run_on_ranks", lambda *a, **k: (runs, None))
    return write.check_zero1(solutions.zero1_train, nproc=len(outcomes))


def test_zero1_verdicts_from_recorded_outcomes(monkeypatch):
    right = _zero1_outcome()
    verdict = _zero1_verdict(monkeypatch, right, right)
    assert verdict and "0.50 of the 56 bytes" in verdict.message and "1.50 x DDP's bytes" in verdict.message, verdict
    whole = _zero1_outcome(held=5)
    assert "Give the optimizer your shard only" in _zero1_verdict(monkeypatch, whole, whole).hint
    other = _zero1_outcome(weights=[0.5, 0.25, -0.5, 1.0, 2.5])
    assert "all-gather every rank's shard" in _zero1_verdict(monkeypatch, right, other).hint
    summed = _zero1_outcome(weights=right["reference"]["summed"])
    assert "divide by the world size" in _zero1_verdict(monkeypatch, summed, summed).hint
    tail = _zero1_outcome(weights=[0.5, 0.25, -0.5, 1.0, 0.0])
    verdict = _zero1_verdict(monkeypatch, tail, tail)
    assert "elements 4 to 4" in verdict.message and "drops the remainder" in verdict.hint, verdict
    chatty = _zero1_outcome(sent_per_step=40.0)  # 2x DDP's: an all-reduce where an all-gather would do
    assert "Gather with dist.all_gather_into_tensor" in _zero1_verdict(monkeypatch, chatty, chatty).hint
    lazy = _zero1_outcome(steps=1)
    assert "1 optimizer step(s) for 3 batches" in _zero1_verdict(monkeypatch, lazy, lazy).message


def test_zero1_outline_is_not_launched_and_its_solution_is_shown_on_request(monkeypatch):
    monkeypatch.setattr(write_zero, "run_on_ranks", lambda *a, **k: pytest.fail("launched an outline"))
    verdict = write.check_zero1("def zero1_train(model, batches):\n    # your lines\n    ...\n")
    assert not verdict and "outline" in verdict.message
    assert "all_gather_into_tensor" in write.solution("zero1_train")


@pytest.mark.slow
def test_the_reference_zero1_passes():
    verdict = write.check_zero1(solutions.zero1_train, nproc=2)
    assert verdict and "on 2 and 3 ranks" in verdict.message and "about 1/2" in verdict.message, verdict


def test_the_written_out_zero1_twins_pass_on_two_and_three_ranks(exercise_ranks):
    assert write.check_zero1(_zero1())
    # reduce-scatter instead of all-reduce: each rank receives only its own slice, DDP's bytes in all (1.0x)
    scatter = _zero1(reduce="shard.grad = torch.empty_like(shard); dist.reduce_scatter_tensor(shard.grad, grad); "
                            "shard.grad /= world")
    verdict = write.check_zero1(scatter)
    assert verdict and "on 2 and 3 ranks" in verdict.message and "1.01 x DDP's bytes" in verdict.message, verdict


@pytest.mark.parametrize("mistake", mistakes(WRONG_ZERO1, launched="gradients summed, not averaged"))
def test_each_zero1_mistake_gets_its_hint(mistake, exercise_ranks):
    changes, hint = WRONG_ZERO1[mistake]
    verdict = write.check_zero1(_code(changes) if isinstance(changes, str) else _zero1(**changes))
    assert not verdict, verdict
    assert hint in verdict.hint, verdict
