"""Notebook 13 (mixture of experts, expert parallelism): the settings, and the tables and claim lines the notebook's
cells call.

course/gpt_moe.py replaces every MLP of the course's GPT by E experts and a top-k router (:mod:`helpers.rank.moe`) and
splits the experts over ``NPROC`` EP ranks: the tokens travel to their experts and back by ``all_to_all_single`` with
uneven splits. Every rank checks one step against one process holding every expert before training (fp32 and fp64
references: the noise floor) and reports what it routed, dropped, sent and computed, which the claims here hold to
:mod:`helpers.calc.moe`. course/moe_deepspeed.py puts DeepSpeed's MoE layer beside the course's.

Example (notebook cells)::

    cfg = lesson.settings(PROFILE, NPROC, STEPS)
    ...  # the launches, in the notebook
    lesson.claim_capacity(one, cfg)
    lesson.claim_parity({"EP": ep})
"""
from __future__ import annotations

from dataclasses import dataclass

from ...calc import moe as moe_calc
from ..checks import claim
from ..i18n import AUTO, Cell, Lines, _, say
from ..scripts import COURSE
from .table import label, show

EXPERTS, TOP_K, D_MODEL, SEQ_LEN, N_LAYER, AUX = 8, 2, 96, 48, 2, 0.01  # course/gpt_moe.py's defaults (--n-layer 2)
SCRIPT, DEEPSPEED_SCRIPT = COURSE / "gpt_moe.py", COURSE / "moe_deepspeed.py"
AUX_WEIGHTS = (0.0, AUX, 0.1)       # section 2: the load-balancing loss off, the default, ten times the default
FACTORS = (0.5, EXPERTS / TOP_K)    # section 2: experts too small to take the tokens, and large enough for all


def note(message) -> None:
    """One line of words under a table, in the kernel's language."""
    show(Lines([[Cell(message)]]))


@dataclass(frozen=True)
class Settings:
    profile: str
    nproc: int        # the EP degree of the main run (ranks = nproc; EXPERTS / nproc experts each)
    steps: int
    batch: int        # sequences per rank and step (every rank routes its own tokens)
    skip_steps: int
    gpus: int = 0

    def __str__(self) -> str:
        return (f"profile={self.profile} nproc={self.nproc} (EP degree) steps={self.steps} batch={self.batch} "
                f"sequences of {SEQ_LEN} characters per rank, {N_LAYER} MoE layers of {EXPERTS} experts, top-{TOP_K}, "
                f"{EXPERTS // self.nproc} experts per rank, d_model={D_MODEL}")

    def args(self, *extra) -> list:
        """The flags every run of the notebook shares, then ``extra``."""
        return ["--steps", self.steps, "--skip-steps", self.skip_steps, "--n-layer", N_LAYER,
                "--batch-size", self.batch, *extra]

    @property
    def tokens(self) -> int:
        """Tokens one rank routes per layer and step: one capacity group."""
        return self.batch * SEQ_LEN


def offered() -> list[int]:
    """The EP degrees the notebook runs: the 8 experts split evenly, at most 4 ranks on a laptop."""
    return [w for w in range(1, 5) if EXPERTS % w == 0]


def resolve(profile: str, gpus: int, nproc=None, steps=None) -> Settings:
    """The parameters with their defaults filled in, or a ValueError that says what to change."""
    nproc = nproc or (gpus if gpus in offered() else 4)
    if nproc not in offered():
        raise ValueError(f"NPROC={nproc}: the EP degree must split the {EXPERTS} experts evenly; use one of "
                         f"{', '.join(map(str, offered()))}")
    steps = steps or (12 if profile == "smoke" else 60)
    return Settings(profile, nproc, steps, batch=8, skip_steps=min(3, steps // 2), gpus=gpus)


def settings(profile="auto", nproc=None, steps=None) -> Settings:
    """:func:`resolve` with this machine's profile and GPU count; prints the result (and what NPROC=1 means)."""
    from .. import env

    cfg = resolve(env.profile(profile), env.gpu_count(), nproc, steps)
    print(cfg)
    if cfg.nproc == 1:
        note(_("NPROC=1: an expert-parallel degree of 1 is one process holding every expert: every claim below still "
               "runs, and every byte count is 0."))
    return cfg


# ---------------------------------------------------------------------------------------- 1. the layer


def show_router() -> None:
    """The router, capacity and balancing loss, as helpers/rank/moe.py writes them."""
    import inspect

    from ...rank import moe

    source = inspect.getsource(moe.route)
    print(source[source.index("    t, e = logits.shape"):])


def sizes_lines(counts: dict, ep: int) -> Lines:
    """A run's parameters (:func:`helpers.calc.moe.parameters`): dense, every expert, one token's, one EP rank's."""
    rows = [[Cell(_("parameters"), AUTO), Cell(_("count"), 10, ">"), Cell(_("share of total"), 15, ">")]]
    for key, text in (("dense", _("dense (attention, embeddings, norms)")), ("total", _("total (every expert)")),
                      ("active", _("active (k experts per token)")),
                      ("per_rank", _("per EP rank ({e} of {n} experts)", e=EXPERTS // ep, n=EXPERTS))):
        rows.append([Cell(text, AUTO), Cell(f"{counts[key]:,}", 10, ">"),
                     Cell(f"{counts[key] / counts['total']:.2f}", 15, ">")])
    return Lines(rows)


def show_sizes(run, cfg: Settings) -> None:
    show(sizes_lines(run.result["moe_params"], cfg.nproc))
    note(_("helpers/calc/moe.py: each expert is the GPT's MLP (8 h² parameters), the router h x E per layer"))


# ---------------------------------------------------------------------------------------- 2. one process


def one_process_plan(cfg: Settings) -> dict[str, list]:
    """The one-process runs of section 2: {label: extra flags}."""
    plan = {f"aux {w:g}": ["--aux-weight", w] for w in AUX_WEIGHTS}
    plan.update({f"capacity {f:g}": ["--capacity-factor", f] for f in FACTORS})
    return plan


def _load(run) -> dict:
    """One run's routing over training: tokens per expert per step, max / mean, dropped assignments per step."""
    r = run.result["moe_per_step"]
    return {"tokens": r["tokens_per_expert"], "imbalance": moe_calc.imbalance(r["tokens_per_expert"]),
            "dropped": r["dropped"], "assignments": sum(r["tokens_per_expert"])}


def show_load(one: dict) -> None:
    """Per run: assignments per expert and step, max / mean, and dropped assignments (routing depends on the CPU's
    rounding, so the cell that shows them is not compared)."""
    rows = [[Cell(_("run"), AUTO)] + [Cell(f"e{e}", 5, ">") for e in range(EXPERTS)]
            + [Cell(_("max / mean"), 11, ">"), Cell(_("dropped"), 9, ">")]]
    for name, run in one.items():
        load = _load(run)
        rows.append([Cell(name, AUTO)] + [Cell(f"{t:.0f}", 5, ">") for t in load["tokens"]]
                    + [Cell(f"{load['imbalance']:.3f}", 11, ">"), Cell(f"{load['dropped']:.0f}", 9, ">")])
    show(Lines(rows))
    note(_("assignments per expert and training step, {layers} layers summed (tokens x k before dropping)",
           layers=N_LAYER))


def plot_load(one: dict):
    """Bars of assignments per expert under each load-balancing weight."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = [f"aux {w:g}" for w in AUX_WEIGHTS]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        load = _load(one[name])
        ax.bar(np.arange(EXPERTS) + (i - 1) * width, load["tokens"], width,
               label=f"{name} (max / mean {load['imbalance']:.2f})")
    ax.axhline(np.mean(_load(one[names[0]])["tokens"]), color="grey", linestyle=":", label=label(_("uniform")))
    ax.set(xlabel=label(_("expert")), ylabel=label(_("assignments per step")),
           title=label(_("tokens per expert over training, by load-balancing weight")))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def claim_capacity(one: dict, cfg: Settings) -> None:
    """Dropped assignments against the capacity factor: at least what the experts cannot hold when they are too
    small, none when one expert can take every token of its group."""
    t, layers = cfg.tokens, N_LAYER
    small, big = (_load(one[f"capacity {f:g}"]) for f in FACTORS)
    room = EXPERTS * moe_calc.capacity(t, TOP_K, EXPERTS, FACTORS[0])  # slots of all experts, one group, one layer
    floor = layers * max(0, t * TOP_K - room)
    default = _load(one[f"aux {AUX:g}"])
    claim(f"at capacity factor {FACTORS[0]:g} the experts hold {room} of the {t * TOP_K} assignments of a group, so at "
          f"least {floor} per step are dropped; at factor E/k = {FACTORS[1]:g} none are; the default 1.25 lies between",
          small["dropped"] >= floor and big["dropped"] == 0 and small["dropped"] >= default["dropped"] >= 0,
          measured=f"{small['dropped']:.1f}, {default['dropped']:.1f}, {big['dropped']:.1f} dropped per step")


def claim_aux(one: dict) -> None:
    """The load-balancing loss evens the experts' load: imbalance and drops fall as its weight grows."""
    off, on = _load(one[f"aux {AUX_WEIGHTS[0]:g}"]), _load(one[f"aux {AUX_WEIGHTS[-1]:g}"])
    claim(f"with the load-balancing loss at weight {AUX_WEIGHTS[-1]:g}, the busiest expert's load over training "
          f"(max / mean) and the dropped assignments are both lower than without it",
          on["imbalance"] < off["imbalance"] and on["dropped"] < off["dropped"],
          measured=f"max / mean {off['imbalance']:.3f} -> {on['imbalance']:.3f}, dropped {off['dropped']:.1f} -> "
                   f"{on['dropped']:.1f} per step")


# ---------------------------------------------------------------------------------------- 3. expert parallelism


def _parity(run) -> dict:
    by_rank = run.results_by_rank()
    out = {k: max(r["moe_parity"][k] for r in by_rank.values()) for k in ("loss_gap", "grad_gap")}
    out.update({k: min(r["moe_parity"][k] for r in by_rank.values()) for k in ("loss_bound", "grad_bound")})
    out.update(ok=all(r["moe_parity"]["ok"] for r in by_rank.values()) and len(by_rank) == run.nproc)
    return out


def claim_parity(runs: dict) -> None:
    """Every rank of every run: one step's loss and gradients against one process holding every expert."""
    found = {name: _parity(run) for name, run in runs.items()}
    claim("on every rank, one step's loss and every gradient (after the sync) equal one process's holding every "
          "expert on the whole global batch, within 8 x the fp32 rounding floor measured against fp64 in the same rank",
          all(p["ok"] for p in found.values()),
          measured=", ".join(f"{name} loss {p['loss_gap']:.1e} / {p['loss_bound']:.1e}, grad {p['grad_gap']:.1e} / "
                             f"{p['grad_bound']:.1e}" for name, p in found.items()))


def show_traffic(run) -> None:
    """Per rank: token rows sent and received per step in the forward dispatch, rows its experts computed, and the
    four all-to-alls' bytes against the formula (routing depends on the CPU's rounding: not compared)."""
    rows = [[Cell("rank", 5, ">"), Cell(_("experts"), 9, ">"), Cell(_("rows out"), 9, ">"), Cell(_("rows in"), 8, ">"),
             Cell(_("computed"), 9, ">"), Cell(_("dispatch KiB"), 13, ">"), Cell(_("formula"), 9, ">"),
             Cell(_("if uniform"), 11, ">")]]
    for rank, r in sorted(run.results_by_rank().items()):
        s = r["moe_per_step"]
        rows.append([Cell(str(rank), 5, ">"), Cell(",".join(map(str, r["moe_local_experts"])), 9, ">"),
                     Cell(f"{s['rows']['sent']:.0f}", 9, ">"), Cell(f"{s['rows']['received']:.0f}", 8, ">"),
                     Cell(f"{sum(s['processed'].values()):.0f}", 9, ">"),
                     Cell(f"{s['sent_bytes']['dispatch']['forward'] / 1024:.1f}", 13, ">"),
                     Cell(f"{r['moe_formula']['dispatch']['forward'] / 1024:.1f}", 9, ">"),
                     Cell(f"{r['moe_uniform']['dispatch']['forward'] / 1024:.1f}", 11, ">")])
    show(Lines(rows))
    note(_("per training step, {layers} layers; KiB of the forward dispatch (the combine's backward sends the same, the "
           "combine's forward and the dispatch's backward what came in)", layers=N_LAYER))


def claim_traffic(run, cfg: Settings) -> None:
    """The four all-to-alls' bytes are the formula's from the exchanged counts; the rows computed add up to the kept
    assignments; each rank holds E / W experts and the parameters the formula says."""
    by_rank = run.results_by_rank()
    ok = True
    for r in by_rank.values():
        s, f = r["moe_per_step"], r["moe_formula"]
        ok &= all(abs(s["sent_bytes"][x][p] - f[x][p]) <= 1e-9 * max(1.0, f[x][p])
                  for x in moe_calc.EXCHANGES for p in ("forward", "backward"))
        ok &= s["count_bytes"] == N_LAYER * moe_calc.count_bytes_per_layer(EXPERTS, cfg.nproc)
    kept = sum(sum(r["moe_per_step"]["tokens_per_expert"]) - r["moe_per_step"]["dropped"] for r in by_rank.values())
    computed = sum(sum(r["moe_per_step"]["processed"].values()) for r in by_rank.values())
    claim(f"on every rank, the bytes of the four all-to-alls per MoE layer (dispatch and combine, forward and backward) "
          f"are the formula's from the exchanged per-expert counts, and the counts' own all-to-all sends "
          f"(E - E/W) integers; the rows all ranks' experts computed add up to the kept assignments", ok
          and abs(kept - computed) <= 1e-6 * max(1.0, kept),
          measured=f"{computed:.1f} rows computed, {kept:.1f} kept per step")
    held = sorted(tuple(r["moe_local_experts"]) for r in by_rank.values())
    want = moe_calc.parameters(run.result["moe_params"]["dense"], N_LAYER, D_MODEL, EXPERTS, TOP_K, cfg.nproc)
    claim(f"each of the {cfg.nproc} ranks holds {EXPERTS // cfg.nproc} different experts, and rank 0 holds the "
          f"formula's {want['per_rank']} parameters of the {want['total']} of every expert",
          held == [tuple(range(i * EXPERTS // cfg.nproc, (i + 1) * EXPERTS // cfg.nproc)) for i in range(cfg.nproc)]
          and run.result["params"] == want["per_rank"])


def show_balance(run) -> None:
    """Rows computed per rank and step, their max / mean, and the step time every rank shares."""
    load = [sum(r["moe_per_step"]["processed"].values()) for _rank, r in sorted(run.results_by_rank().items())]
    say(f"rows computed per rank and step: {', '.join(f'{x:.0f}' for x in load)}; max / mean "
        f"{moe_calc.imbalance(load):.3f}; {run.result['samples_per_s']:.0f} samples/s over the job")


# ---------------------------------------------------------------------------------------- 4. EP x DP


def claim_2d(run) -> None:
    """The (dp, ep) = (2, 2) run, on the gradients themselves: dense gradients the same on every rank, an expert's the
    same on its two dp replicas, and the two halves of the experts on different ranks."""
    by_rank = run.results_by_rank()
    dense = [r["moe_grad_norms"]["dense"] for r in by_rank.values()]
    replicas: dict[tuple, list] = {}
    for r in by_rank.values():
        replicas.setdefault(tuple(r["moe_local_experts"]), []).append(r["moe_grad_norms"]["experts"])
    same = all(abs(a - b) <= 1e-12 * max(abs(a), 1e-30) for a, b in zip(dense, dense[1:]))
    pairs = len(replicas) == 2 and all(len(v) == 2 and v[0].keys() == v[1].keys() and all(
        abs(v[0][e] - v[1][e]) <= 1e-12 * max(v[0][e], 1e-30) for e in v[0]) for v in replicas.values())
    claim("on the 2 x 2 (dp, ep) mesh, the dense gradients are the same on all 4 ranks (averaged over every rank) and "
          "each expert's gradients are the same on its 2 dp replicas (averaged over the dp group only)", same and pairs,
          measured=f"dense grad norm {dense[0]:.6f}")


# ---------------------------------------------------------------------------------------- 5. DeepSpeed


def show_deepspeed(run) -> None:
    rows = [[Cell(_("routing"), AUTO), Cell(_("output gap"), 11, ">"), Cell(_("floor"), 9, ">"),
             Cell(_("grad gap"), 9, ">"), Cell(_("floor"), 9, ">"), Cell(_("own rules: output gap"), 22, ">")]]
    for c in run.result["compared"]:
        rows.append([Cell(f"top-{c['top_k']}", AUTO)] + [Cell(f"{c[k]:.1e}", w, ">") for k, w in (
            ("out_gap", 11), ("out_floor", 9), ("grad_gap", 9), ("grad_floor", 9), ("out_gap_own_rules", 22))])
    show(Lines(rows))
    note(_("rank 0, DeepSpeed {version}, {ep} EP ranks; floor: the course's layer in fp32 against fp64",
           version=run.result["deepspeed"], ep=run.result["ep"]))


def claim_deepspeed(run) -> None:
    """DeepSpeed's MoE equals the course's layer at top-1; at top-2 it equals the course's layer with DeepSpeed's two
    rules and differs without them."""
    ok, unlike = True, True
    for r in run.results_by_rank().values():
        for c in r["compared"]:
            ok &= c["out_gap"] <= 8 * c["out_floor"] and c["grad_gap"] <= 8 * c["grad_floor"] \
                and c["aux_gap"] <= 8 * max(c["aux_floor"], 1e-7)
            if c["top_k"] == 2:
                unlike &= c["out_gap_own_rules"] > 100 * c["out_floor"]
    claim("on every rank, DeepSpeed's MoE layer gives the course's output, balancing loss and gradients within 8 x the "
          "fp32 floor: at top-1 with the same rules, at top-2 once the course's layer rescales the kept gates to sum "
          "to 1 and counts first choices in the balancing loss; without those two rules top-2 differs by over 100 x "
          "the floor", ok and unlike and len(run.results_by_rank()) == run.nproc)


# ---------------------------------------------------------------------------------------- 6. refused


def refusals() -> list[tuple[str, str]]:
    """What the launcher says to bad MoE input, without starting anything: (the input, the message)."""
    from ... import launch

    cases = [(4, ["--experts", "6"]), (4, ["--top-k", "9"]), (4, ["--capacity-factor", "0"]),
             (4, ["--dp", "2", "--ep", "4"])]
    out = []
    for n, args in cases:
        given = f"{n} ranks, {' '.join(args)}"
        try:
            launch.LaunchSpec.check("torchrun", SCRIPT, n, args, machine=launch.Machine(gpus=0, cpus=8))
            out.append((given, "accepted"))
        except launch.LaunchError as e:
            out.append((given, str(e)))
    return out


def claim_refusals() -> None:
    found = refusals()
    for given, message in found:
        say(f"{given:30s} -> {message}")
    claim("each bad input is refused before any rank starts, with the value to change",
          all(m != "accepted" and " use " in m for _, m in found))
