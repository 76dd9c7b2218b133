"""Notebook 14 (at scale in one process): real models' layouts simulated at their real rank counts, held to the
course's formulas, and the planner of notebook 10 held to the layouts their authors chose.

course/gpt_at_scale.py builds one rank of a layout under FakeTensorMode and torch's fake process group and measures
its memory with FSDPMemTracker; :func:`simulate` runs it as ``python course/gpt_at_scale.py ... --json``, a process
of its own (the kernel never joins a process group). :mod:`helpers.calc.scale` holds the published shapes, the
published layouts and what one rank should hold; :mod:`helpers.calc.plan` proposes layouts. course/gpt_local.py runs
DP x TP ranks with real numbers in one process (torch's LocalTensor). The learner's own layout: :mod:`.at_scale_plan`.

Example (notebook cells)::

    r = lesson.simulate("llama3-405b", world=16384, tp=8, pp=16, stage=1)
    lesson.show_rank(r)
    lesson.claim_formula([r])
"""
from __future__ import annotations

import json
import os
import textwrap
from concurrent.futures import ThreadPoolExecutor

from ... import launch
from ...calc import scale, stages
from ..checks import claim
from ..i18n import Cell, Lines, _, say
from ..scripts import COURSE
from .table import columns, line, show

SCRIPT, LOCAL_SCRIPT = COURSE / "gpt_at_scale.py", COURSE / "gpt_local.py"
GIB = 2 ** 30
GPU_BYTES = 80e9           # an H100's 80 GB (the planner's helpers.calc.scale.planned counts the same)
STATE_TOLERANCE = 1e-3     # parameters, gradients, optimizer state: the same arithmetic, measured and counted
ACT_TOLERANCE = 0.05       # activations: the last stage's final LayerNorm runs on a sequence shard (section 1)
LOCAL_FLOORS = 4           # LocalTensor ranks: a few fp32 noise floors from fp64 (tests/test_local_ranks.py)
LLAMA = dict(model="llama3-405b", world=16384, tp=8, pp=16)           # Llama 3 405B's layout: DP 128
LLAMA_MICROBATCHES = 16    # 2,048 sequences a step over DP 128: 16 micro-batches of one sequence per pipeline
DEEPSEEK = dict(model="deepseek-v3", world=2048, tp=1, pp=16, ep=64)  # DeepSeek-V3's: DP 128, EP 64 taken from it
LLAMA_LONG = dict(LLAMA, cp=16, seq_len=131072)  # Llama 3 405B at 128K tokens: DP 8 x CP 16 (scale.PUBLISHED)


LOCAL_CHOICES = (16, 32, 64)


def settings(profile: str, local_ranks: int) -> None:
    """Check the parameters cell before anything runs, and say what the chapter will do."""
    if local_ranks not in LOCAL_CHOICES:
        raise ValueError(f"LOCAL_RANKS = {local_ranks!r}: use one of {', '.join(map(str, LOCAL_CHOICES))} (TP 4 "
                         "divides each into whole DP groups of the tiny GPT)")
    print(f"profile={profile}: nothing is trained; every layout is one rank simulated in a process of its own "
          f"(course/gpt_at_scale.py), and section 6 runs {local_ranks} LocalTensor ranks and 4 gloo ranks")


def simulate(model: str, world: int, tp: int = 1, pp: int = 1, stage: int = 0, ep: int = 1,
             checkpoint: str = "none", seq_len: int | None = None, cp: int = 1) -> dict:
    """One rank of the layout, simulated by course/gpt_at_scale.py in a process of its own: its JSON (``measured``
    and ``formula`` bytes, the layout). A layout that cannot be built is refused here, before anything starts."""
    return simulate_each(model, world, tp, pp, (stage,), (checkpoint,), ep, seq_len, cp)[(stage, checkpoint)]


def simulate_each(model: str, world: int, tp: int, pp: int, stages, checkpoints, ep: int = 1,
                  seq_len: int | None = None, cp: int = 1) -> dict:
    """{(stage, checkpoint): :func:`simulate`'s JSON} for every stage and recomputation given: a process per stage
    (or per recomputation, for one stage), as many at once as there are CPU cores (each simulation is one thread of
    Python), each running its share one after another."""
    shape = dict(scale.MODELS[model], **({"seq_len": seq_len} if seq_len else {}))
    for stage in stages:
        problem = scale.layout_problem(shape, world, tp, pp, stage, ep, cp)
        if problem:
            raise ValueError(problem)
    common = ["--model", model, "--world", world, "--tp", tp, "--pp", pp, "--ep", ep, "--json",
              *(["--seq-len", seq_len] if seq_len else []), *(["--cp", cp] if cp > 1 else [])]
    shares = ([((st,), tuple(checkpoints)) for st in stages] if len(stages) > 1
              else [(tuple(stages), (c,)) for c in checkpoints])
    jobs = [(SCRIPT, [*common, "--stage", *sts, "--checkpoint", *cks],
             f"14_{model}_{world}_stage{'_'.join(map(str, sts))}_{'_'.join(cks)}") for sts, cks in shares]
    return {(r["stage"], r["checkpoint"]): r for found in _json_runs(jobs) for r in found}


def _json_runs(jobs: list[tuple]) -> list[list[dict]]:
    """:func:`_json_run` for every (script, args, name) in ``jobs``, as many at once as there are CPU cores; in the
    order of ``jobs``."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda job: _json_run(*job), jobs))


def _json_run(script, args: list, name: str) -> list[dict]:
    """``python script args`` in a process of its own: the JSON lines it printed, in order, or RuntimeError with its
    output's end."""
    run = launch.python(script, args, timeout=600, name=name)
    found = [text for text in run.output.splitlines() if text.startswith("{")]
    if run.returncode or not found:
        raise RuntimeError(f"course/{script.name} {' '.join(map(str, args))} failed:\n{run.output[-3000:]}")
    return [json.loads(text) for text in found]


def first_and_last(model: str, dp: int, tp: int, pp: int, microbatches: int, ep: int = 1,
                   checkpoint: str = "none", seq_len: int | None = None) -> dict:
    """{stage: (simulation, :func:`held`)} for the first and the last pipeline stage of a layout (a process each, at
    once: :func:`simulate_each`)."""
    sims = simulate_each(model, dp * tp * pp, tp, pp, sorted({0, pp - 1}), (checkpoint,), ep, seq_len)
    return {stage: (r, held(r, microbatches)) for (stage, _checkpoint), r in sims.items()}


def show_script() -> None:
    """The lines of course/gpt_at_scale.py that make a rank of the real job: the fake group, the mesh, the model on the
    meta device, fake tensors, one step under the tracker."""
    text = SCRIPT.read_text().splitlines()
    start = next(i for i, t in enumerate(text) if 'dist.init_process_group("fake"' in t)
    end = next(i for i, t in enumerate(text) if "optimizer.step()" in t)
    print(textwrap.dedent("\n".join(text[start:end + 1])))


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3f}"


ROWS = (("params", "params", _("parameters (fp32 shard)")), ("grads", "grads", _("gradients (fp32 shard)")),
        ("optimizer", "optimizer", _("optimizer state (AdamW, fp32)")),
        ("activations after forward", "activations", _("one micro-batch's activations")))
SPEC = ((36, "<"), (10, ">"), (10, ">"), (9, ">"))


def heading(r: dict) -> list[Cell]:
    fields = dict(model=r["model"], world=r["world"], dp=r["dp"], tp=r["tp"], pp=r["pp"], stage=r["stage"],
                  blocks=r["formula"]["blocks"], tokens=f"{r['shape']['seq_len']:,}", checkpoint=r["checkpoint"])
    if r.get("cp", 1) > 1:  # a dense model only (the simulation refuses CP with experts)
        return line(_("{model} on {world} ranks: dp {dp} x cp {cp} x tp {tp} x pp {pp}, stage {stage} ({blocks} "
                      "blocks), {tokens} tokens, recomputation {checkpoint}", cp=r["cp"], **fields))
    ep = f" (ep {r['ep']})" if r["ep"] > 1 else ""
    return line(_("{model} on {world} ranks: dp {dp}{ep} x tp {tp} x pp {pp}, stage {stage} ({blocks} blocks), "
                  "{tokens} tokens, recomputation {checkpoint}", ep=ep, **fields))


def show_rank(r: dict) -> None:
    """What the simulated rank holds beside the formula (GiB), and what else its step's peak holds."""
    m, f = r["measured"], r["formula"]
    sent, ring = "all-to-all bytes sent", "ring bytes sent"
    rows = [*ROWS, *(((sent, sent, _("all-to-all bytes sent in the step")),) if r["ep"] > 1 else ()),
            *(((ring, ring, _("ring bytes sent in the step")),) if r.get("cp", 1) > 1 else ())]
    out = [heading(r), columns(SPEC, _("GiB per rank"), _("measured"), _("formula"), _("ratio"))]
    for key, formula, name in rows:
        out.append(columns(SPEC, name, _gib(m[key]), _gib(f[formula]), f"{m[key] / f[formula]:.4f}"))
    for key, name in (("unsharded params", _("gathered parameters (bf16)")),
                      ("all-gather buffers", _("all-gather buffers")), ("temporaries", _("temporaries"))):
        out.append(columns(SPEC, name, _gib(m[key]), "", "", _("at the peak")))
    out.append(columns(SPEC, _("peak of forward and backward"), _gib(m["peak"])))
    show(Lines(out))


def agreement(r: dict) -> dict:
    """The worst relative gap of the states, the activations' ratio, and the all-to-alls' (1.0 without EP)."""
    m, f = r["measured"], r["formula"]
    states = max(abs(m[k] / f[k] - 1) for k in ("params", "grads", "optimizer"))
    sent = m["all-to-all bytes sent"] / f["all-to-all bytes sent"] if r["ep"] > 1 else 1.0
    return dict(states=states, activations=m["activations after forward"] / f["activations"], sent=sent)


def claim_formula(results: list[dict]) -> None:
    """Every simulated rank's states equal the formulas' (0.1%), its activations within 5%, its all-to-alls equal."""
    gaps = [agreement(r) for r in results]
    worst_act = max(gaps, key=lambda g: abs(g["activations"] - 1))["activations"]
    claim(f"on each of the {len(results)} simulated ranks, parameters, gradients and optimizer state equal the "
          f"formulas' bytes within {STATE_TOLERANCE:.1%}, one micro-batch's activations are within "
          f"{ACT_TOLERANCE:.0%} of the formula, and the all-to-alls send the formula's bytes",
          all(g["states"] <= STATE_TOLERANCE and abs(g["activations"] - 1) <= ACT_TOLERANCE
              and abs(g["sent"] - 1) <= 1e-6 for g in gaps),
          measured=f"worst states gap {max(g['states'] for g in gaps):.1e}, activations ratio {worst_act:.3f}")


# ------------------------------------------------------------------------------------ 2. does the layout fit?

def held(r: dict, microbatches: int) -> dict:
    """What the rank holds at its busiest under 1F1B: the simulated step's peak (parameters, gradients, one
    micro-batch's activations, the step's buffers), the optimizer state (which AdamW creates at its first step, after
    that peak, and keeps from then on), and the activations of the other micro-batches in flight
    (:func:`helpers.calc.stages.in_flight`)."""
    m = r["measured"]
    n = stages.in_flight("1f1b", r["pp"], r["stage"], microbatches)
    states = sum(m[k] for k in ("params", "grads", "optimizer"))
    total = m["peak"] + m["optimizer"] + (n - 1) * m["activations after forward"]
    return dict(in_flight=n, states=states, activations=n * m["activations after forward"],
                rest=total - states - n * m["activations after forward"], total=total)


FIT = ((6, ">"), (10, "<"), (10, ">"), (8, ">"), (12, ">"), (8, ">"), (8, ">"), (8, "<"))


def show_fit(sims: dict, microbatches: int = LLAMA_MICROBATCHES) -> None:
    """``sims``: {(stage, checkpoint): simulate(...)}: each rank's memory at its busiest, against 80 GB."""
    out = [columns(FIT, _("stage"), _("recompute"), _("in flight"), _("states"), _("activations"), _("rest"),
                   _("total"), _("fits in 80 GB"))]
    for (stage, checkpoint), r in sorted(sims.items()):
        h = held(r, microbatches)
        out.append(columns(FIT, str(stage), checkpoint, str(h["in_flight"]), _gib(h["states"]),
                           _gib(h["activations"]), _gib(h["rest"]), _gib(h["total"]),
                           _("yes") if h["total"] <= GPU_BYTES else _("no")))
    out.append(line(_("GiB per rank under 1F1B with {m} micro-batches; rest: the step's buffers and temporaries at "
                      "its peak (gathered parameters and their whole gradients, recomputed blocks, the loss)",
                      m=microbatches)))
    show(Lines(out))


def claim_fit(sims: dict, microbatches: int = LLAMA_MICROBATCHES) -> None:
    """Without recomputation the first stage does not fit in 80 GB; with it every simulated stage does."""
    total = {key: held(r, microbatches)["total"] for key, r in sims.items()}
    without = [v for (s, c), v in total.items() if c == "none" and s == 0]
    recomputed = [v for (s, c), v in total.items() if c == "full"]
    claim("the paper's layout fits in 80 GB on every simulated stage once each block is recomputed in backward, and "
          "its first stage does not fit without recomputation", without and recomputed
          and all(v > GPU_BYTES for v in without) and all(v <= GPU_BYTES for v in recomputed),
          measured=", ".join(f"stage {s} {c}: {v / GIB:.1f} GiB" for (s, c), v in sorted(total.items())))


# --------------------------------------------------------------------------- 3. 131,072 tokens over CP 16

def claim_context(long: dict, short: dict) -> None:
    """``long``: a stage of Llama 3 405B at 131,072 tokens over CP 16 (DP 8); ``short``: the same stage at 8,192
    tokens without CP (DP 128). CP gives the long rank the short one's bytes; the ring sends chapter 12's; without
    CP one long micro-batch alone would not fit (the formula: nothing that large is simulated)."""
    ml, ms = long["measured"], short["measured"]
    keys = ("params", "grads", "optimizer", "activations after forward")
    gap = max(abs(ml[k] / ms[k] - 1) for k in keys)
    claim(f"at {long['shape']['seq_len']:,} tokens over CP {long['cp']} a rank holds the model states and one "
          f"micro-batch's activations it holds at {short['shape']['seq_len']:,} tokens without CP: dp x cp shards "
          f"the weights over as many ranks, and CP leaves it as many tokens", gap <= STATE_TOLERANCE,
          measured=f"activations {ml[keys[-1]] / GIB:.3f} vs {ms[keys[-1]] / GIB:.3f} GiB, worst gap {gap:.1e}")
    sent, formula = ml["ring bytes sent"], long["formula"]["ring bytes sent"]
    claim("the ring sends chapter 12's bytes: each layer's K and V blocks cp - 1 hops in forward, K, V and their "
          "gradients cp - 1 hops in backward", sent > 0 and abs(sent / formula - 1) <= 1e-9,
          measured=f"{sent / GIB:.3f} GiB, formula {formula / GIB:.3f} GiB")
    shape, lay = long["shape"], {k: long[k] for k in ("tp", "pp", "stage")}
    without = scale.expected(shape, world=long["world"], **lay)["activations"]
    claim(f"without CP one micro-batch of {shape['seq_len']:,} tokens alone would hold more than the GPU's 80 GB "
          "in activations on this stage (the formula)", without > GPU_BYTES, measured=f"{without / GIB:.1f} GiB")
    claim("the step's peak is higher with the ring: each block's scores are computed whole, s / cp by s / cp a "
          "head, where a flash kernel would tile them", ml["peak"] > ms["peak"],
          measured=f"{ml['peak'] / GIB:.1f} vs {ms['peak'] / GIB:.1f} GiB")


# --------------------------------------------------------------------------------- 4. DeepSeek-V3's experts

def claim_recompute_resends(none: dict, full: dict) -> None:
    """Recomputing a MoE block's forward sends its dispatch and combine again: 6 all-to-alls instead of 4."""
    a, b = (r["measured"]["all-to-all bytes sent"] for r in (none, full))
    claim("recomputing the MoE blocks in backward sends their dispatch and combine again: six all-to-alls of token "
          "rows per block instead of four, 1.5 times the bytes", a > 0 and abs(b / a - 1.5) <= 1e-9,
          measured=f"{a / GIB:.3f} -> {b / GIB:.3f} GiB")


# ------------------------------------------------------------------------- 5. the planner and the published

PUB = ((27, "<"), (24, "<"), (10, ">"), (26, "<"), (11, "<"), (9, "<"))


def _degrees(layout: dict) -> str:
    keys = ("dp", "cp", "tp", "pp", "ep")
    return " ".join(f"{k}{layout[k]}" for k in keys if layout.get(k, 1) > 1 or k == "dp")


def published() -> list[tuple[dict, dict]]:
    """(entry, :func:`helpers.calc.scale.planned`) for every published layout."""
    return [(entry, scale.planned(entry)) for entry in scale.PUBLISHED]


def show_published(found: list[tuple[dict, dict]]) -> None:
    """The validation table: each published layout, where the planner ranks it, and its first choice; MFU by the
    model beside the reported one."""
    out = [columns(PUB, _("model"), _("their layout"), _("place"), _("the planner's first"), _("model MFU"),
                   _("reported"))]
    for entry, p in found:
        theirs, first = p["theirs"], p["first"]
        rank = f"{p['rank']} / {len(p['fits'])}" if theirs else _("does not fit")
        reported = "-" if not entry["reported_mfu"] else "-".join(f"{v:.0%}" for v in sorted(set(
            entry["reported_mfu"])))
        out.append(columns(PUB, entry["name"], _degrees(entry["layout"]), rank, _degrees(first["layout"]),
                           "-" if p["mfu"] is None else f"{p['mfu']:.0%} / {p['first_mfu']:.0%}", reported))
    out.append(line(_("place: among the layouts that fit, fastest first by the model; MFU: model FLOPs over "
                      "the GPUs' peak, by the model, for theirs / for the planner's first")))
    show(Lines(out))
    for entry, p in found:
        if p["theirs"]:
            lay = p["theirs"]["layout"]
            say(f"{entry['name']}: best as ZeRO-{lay['zero']}, {lay['schedule']}, recompute {lay['checkpoint']}, "
                f"{lay['microbatches']} micro-batches; {p['theirs']['bytes'] / 1e9:.1f} GB per GPU ({entry['source']})")


def claim_published(found: list[tuple[dict, dict]]) -> None:
    llama = [(e, p) for e, p in found if e["name"].startswith("Llama") and e["reported_mfu"]]
    claim("the model's MFU for Llama 3's layouts lies below the reported range: its 52% of peak per GPU is a setting, "
          "not their kernels", llama and all(p["mfu"] < min(e["reported_mfu"]) for e, p in llama),
          measured=", ".join(f"{p['mfu']:.0%} vs {min(e['reported_mfu']):.0%}" for e, p in llama))
    claim("each of the four published layouts is among those the planner finds to fit on its authors' machine, "
          "knowing only the model's shape, the machine and the batch", all(p["theirs"] for _, p in found),
          measured=", ".join(f"{p['rank']}/{len(p['fits'])}" for _, p in found))


# -------------------------------------------------------------------- 6. real numbers, many ranks, one process

def local_ranks(world: int = 16, tp: int = 4) -> dict:
    """course/gpt_local.py's step on ``world`` ranks simulated by LocalTensor in one process (its JSON line)."""
    return local_ranks_each([(world, tp)])[0]


def local_ranks_each(layouts: list[tuple[int, int]]) -> list[dict]:
    """:func:`local_ranks` for every (world, tp) in ``layouts``, a process each, as many at once as there are cores."""
    jobs = [(LOCAL_SCRIPT, ["--simulate", world, "--tp", tp], f"14_local_{world}_tp{tp}") for world, tp in layouts]
    return [found[-1] for found in _json_runs(jobs)]


LOC = ((10, "<"), (8, ">"), (6, ">"), (6, ">"), (12, ">"), (12, ">"))


def show_local(results: list[dict]) -> None:
    out = [columns(LOC, _("ranks"), "dp", "tp", "", _("worst grad"), _("fp32 floor"))]
    for r in results:
        kind = _("simulated") if r["simulated"] else _("real")
        out.append(columns(LOC, f"{r['ranks']}", str(r["dp"]), str(r["tp"]), kind,
                           f"{max(r['grad_error'].values()):.1e}", f"{r['floor']:.1e}"))
    out.append(line(_("worst grad: the largest distance of any rank's gradient from the one-process step in fp64; "
                      "fp32 floor: the one-process fp32 step's own distance")))
    show(Lines(out))


def claim_local(simulated: list[dict], real: dict) -> None:
    same = next((r for r in simulated if r["ranks"] == len(real["loss"]) and r["tp"] == real["tp"]), None)
    claim(f"every simulated rank's gradients lie within {LOCAL_FLOORS} fp32 noise floors of the one-process step "
          "in fp64, and the 4 real gloo ranks give the 4 simulated ranks' losses (same seed)",
          same is not None and all(max(r["grad_error"].values()) <= LOCAL_FLOORS * r["floor"]
                                   for r in [*simulated, real])
          and all(abs(v - same["loss"][k]) <= 1e-6 * abs(v) for k, v in real["loss"].items()),
          measured=", ".join(f"{r['ranks']} ranks {max(r['grad_error'].values()) / r['floor']:.2f} floors"
                             for r in [*simulated, real]))


# ----------------------------------------------------------------------------------------- 8. refusals

BAD = (dict(model="llama3-70b", world=96, tp=3), dict(model="llama3-405b", world=5120, tp=8, pp=5),
       dict(model="llama3-405b", world=1000, tp=8, pp=16), dict(model="llama3-70b", world=64, tp=8, ep=8),
       dict(model="deepseek-v3", world=2048, tp=1, pp=16, ep=48),
       dict(model="llama3-405b", world=16384, tp=8, pp=16, cp=16, seq_len=100000))


def claim_refusals() -> None:
    """Each impossible layout is refused by :func:`simulate` before any process starts."""
    found = []
    for bad in BAD:
        try:
            simulate(**bad)
            found.append((bad, "accepted"))
        except ValueError as refused:
            found.append((bad, str(refused)))
    for bad, message in found:
        say(f"{' '.join(f'{k} {v}' for k, v in bad.items()):44s} -> {message}")
    claim("each layout whose degrees do not divide the model or the world size is refused before anything is built, "
          "with what would work", all(m != "accepted" and ("use" in m or "divide" in m) for _, m in found))
