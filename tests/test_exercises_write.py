"""Write-the-code exercises: the learner's function runs on real gloo ranks, the reference passes, and each classic
mistake gets its own hint.

The wrong answers below are the mistakes the checkers name. Each is launched like a learner's answer (a few seconds
per launch on 2-3 ranks), so everything that launches is marked slow; what is decided before a launch is fast.
"""
import textwrap

import pytest

from helpers.notebook.exercises import ranks, solutions, write


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
def test_the_reference_ring_passes_on_two_and_three_ranks():
    for nproc in (2, 3):
        verdict = write.check_ring_all_reduce(solutions.ring_all_reduce, nproc=nproc)
        assert verdict, verdict
        assert f"{2 * (nproc - 1) / nproc:.3f} x the tensor" in verdict.message


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(WRONG_RINGS))
def test_each_ring_mistake_gets_its_hint(mistake, monkeypatch):
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
def test_the_reference_ddp_loop_and_its_written_out_twin_pass():
    assert write.check_ddp_train(solutions.train)
    assert write.check_ddp_train(_loop(), nproc=3)


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(WRONG_LOOPS))
def test_each_ddp_mistake_gets_its_hint(mistake):
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
def test_the_reference_sharding_and_its_written_out_twin_pass():
    assert write.check_fully_shard(solutions.shard, nproc=2)
    verdict = write.check_fully_shard(_shard(), nproc=3)
    assert verdict and "about 1/3" in verdict.message, verdict


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(WRONG_SHARDS))
def test_each_sharding_mistake_gets_its_hint(mistake):
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
def test_the_reference_accumulation_and_its_written_out_twin_pass():
    verdict = write.check_accumulation(solutions.train_step)
    assert verdict and "all-reduced 1 time(s)" in verdict.message, verdict
    assert write.check_accumulation(_step(), nproc=3)


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(WRONG_STEPS))
def test_each_accumulation_mistake_gets_its_hint(mistake):
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
def test_the_reference_resume_and_its_written_out_twin_pass():
    assert write.check_resumable(solutions.save_checkpoint, solutions.load_checkpoint)
    verdict = write.check_resumable(*_resume())
    assert verdict and "bitwise equal" in verdict.message, verdict


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(WRONG_RESUMES))
def test_each_resume_mistake_gets_its_hint(mistake):
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


@pytest.mark.slow
def test_the_reference_ds_config_passes_and_a_lower_stage_gets_its_hint():
    assert write.check_ds_config(solutions.ds_config()), "reference"
    too_low = write.check_ds_config(_ds(2))
    assert not too_low and "Partition more of the model states" in too_low.hint, too_low
