"""Notebook 12 (context parallelism): the settings, the picture of the layouts, and the tables and claim lines the
notebook's cells call.

course/gpt_cp.py splits every sequence of the course's GPT over ``NPROC`` CP ranks and runs attention over the whole
sequence either by passing K/V blocks round a ring (:func:`helpers.rank.cp.ring_attention`, zig-zag or contiguous
positions) or by two all-to-alls (:func:`helpers.rank.cp.ulysses_attention`). Every rank checks one step against one
process on the unsplit batch before training (fp32 and fp64 references: the noise floor) and reports what its
attention sent, computed and kept, which the claims here hold to :mod:`helpers.calc.cp`.

Example (notebook cells)::

    cfg = lesson.settings(PROFILE, NPROC, STEPS)
    lesson.show_layouts(cfg)
    ...  # the launches, in the notebook
    lesson.show_parity(runs)   # the gaps vary by machine: a cell nbval does not compare
    lesson.claim_parity(runs)
    lesson.claim_bytes(runs, cfg)
"""
from __future__ import annotations

from dataclasses import dataclass

from ...calc import cp as cp_calc
from ...calc import parity
from ..checks import claim
from ..i18n import AUTO, Cell, Lines, _, say
from ..scripts import COURSE
from .table import label, show


def note(message) -> None:
    """One line of words under a table, in the kernel's language."""
    show(Lines([[Cell(message)]]))

HEADS, D_MODEL, SEQ_LEN, N_LAYER = 12, 96, 48, 2  # course/gpt_cp.py's defaults (--n-layer 2 here)
SCRIPT = COURSE / "gpt_cp.py"


@dataclass(frozen=True)
class Settings:
    profile: str
    nproc: int        # the CP degree of the main runs (ranks = nproc)
    steps: int
    batch: int        # sequences per step (every CP rank holds seq_len / nproc positions of each)
    skip_steps: int
    gpus: int = 0

    def __str__(self) -> str:
        return (f"profile={self.profile} nproc={self.nproc} (CP degree) steps={self.steps} batch={self.batch} "
                f"sequences of {SEQ_LEN} characters, {SEQ_LEN // self.nproc} positions per rank, {N_LAYER} layers, "
                f"{HEADS} heads, d_model={D_MODEL}")

    def args(self, *extra) -> list:
        """The flags every run of the notebook shares, then ``extra``."""
        return ["--steps", self.steps, "--skip-steps", self.skip_steps, "--n-layer", N_LAYER,
                "--batch-size", self.batch, *extra]


def offered() -> list[int]:
    """The CP degrees the notebook runs: zig-zag cuts 48 positions into 2 W chunks and Ulysses splits 12 heads."""
    return [w for w in range(1, HEADS + 1) if SEQ_LEN % (2 * w) == 0 and HEADS % w == 0]


def resolve(profile: str, gpus: int, nproc=None, steps=None) -> Settings:
    """The parameters with their defaults filled in, or a ValueError that says what to change."""
    nproc = nproc or (gpus if gpus in offered() else 4)
    if nproc not in offered():
        raise ValueError(f"NPROC={nproc}: the CP degree must cut the {SEQ_LEN} positions into 2 x NPROC zig-zag chunks "
                         f"and the {HEADS} heads evenly (Ulysses); use one of {', '.join(map(str, offered()))}")
    steps = steps or (8 if profile == "smoke" else 40)
    return Settings(profile, nproc, steps, batch=8, skip_steps=min(3, steps // 2), gpus=gpus)


def settings(profile="auto", nproc=None, steps=None) -> Settings:
    """:func:`resolve` with this machine's profile and GPU count; prints the result (and what NPROC=1 means)."""
    from .. import env

    cfg = resolve(env.profile(profile), env.gpu_count(), nproc, steps)
    print(cfg)
    if cfg.nproc == 1:
        note(_("NPROC=1: a context-parallel degree of 1 is one process holding whole sequences: every claim below "
               "still runs, and every byte count is 0."))
    return cfg


# ---------------------------------------------------------------------------------------- 0. why


LLAMA3_405B = dict(h=16384, a=128, n_layer=126, s=131072, b=1)  # Grattafiori et al. 2024, Tables 3 and 4


def long_context_lines(shape: dict = LLAMA3_405B, tp: int = 8, cp: int = 16, pp: int = 16) -> Lines:
    """One layer's activations at Llama 3 405B's long-context shape in bf16 with a flash kernel (chapter 08's
    formula), whole, under TP with Megatron's SP, and with CP on top; per GPU, a pipeline stage's layers (Llama 3's
    long-context layout: TP 8, CP 16, PP 16)."""
    from ...calc import activations

    s, b, h, a = shape["s"], shape["b"], shape["h"], shape["a"]
    stage = -(-shape["n_layer"] // pp)  # layers per pipeline stage
    rows = [[Cell(_("split"), AUTO), Cell(_("one layer GiB"), 14, ">"),
             Cell(_("x {n} layers GiB", n=shape["n_layer"]), 18, ">"),
             Cell(_("per GPU, PP {pp} ({n} layers) GiB", pp=pp, n=stage), 30, ">")]]
    for label, n, t, sp in ((_("one GPU"), s, 1, False), (f"TP {tp} + SP", s, tp, True),
                            (f"TP {tp} + SP, CP {cp}", s // cp, tp, True)):
        layer = activations.layer_bytes(n, b, h, a, "bf16", "sdpa", tp=t, sp=sp)
        rows.append([Cell(label, AUTO), Cell(f"{layer / 2**30:.2f}", 14, ">"),
                     Cell(f"{layer * shape['n_layer'] / 2**30:,.0f}", 18, ">"),
                     Cell(f"{layer * stage / 2**30:,.1f}", 30, ">")])
    return Lines(rows)


def show_long_context() -> None:
    show(long_context_lines())
    note(_("Llama 3 405B (h = 16384, 128 heads, 126 layers), one sequence of 131,072 tokens, bf16, flash attention; "
           "chapter 08's formula (helpers/calc/activations.py)"))


def show_ring() -> None:
    """The ring's forward, as helpers/rank/cp.py writes it."""
    import inspect

    from ...rank import cp

    print(inspect.getsource(cp._RingAttention.forward))


# ---------------------------------------------------------------------------------------- 1. the layouts


def _ranges(positions: list[int]) -> str:
    """0 1 2 3 10 11 -> "0-3, 10-11"."""
    parts, start = [], positions[0]
    for a, b in zip(positions, positions[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}-{a}" if a != start else str(a))
            start = b
    return ", ".join(parts)


def layout_lines(world: int, seq_len: int = SEQ_LEN) -> Lines:
    """Per rank: the positions each layout gives it and the causal query-key pairs it computes (the formula)."""
    from ...rank.cp import layout_indices

    work = {layout: cp_calc.causal_work_pairs(seq_len, world, layout) for layout in cp_calc.LAYOUTS}
    rows = [[Cell("rank", AUTO), Cell(_("contiguous positions"), AUTO), Cell(_("pairs"), 7, ">"), Cell("  "),
             Cell(_("zig-zag positions"), AUTO), Cell(_("pairs"), 7, ">")]]
    for r in range(world):
        rows.append([Cell(str(r), AUTO), Cell(_ranges(layout_indices("contiguous", seq_len, world, r).tolist()), AUTO),
                     Cell(str(work["contiguous"][r]), 7, ">"), Cell("  "),
                     Cell(_ranges(layout_indices("zigzag", seq_len, world, r).tolist()), AUTO),
                     Cell(str(work["zigzag"][r]), 7, ">")])
    ratio = {layout: f"{cp_calc.imbalance(pairs):.3f}" for layout, pairs in work.items()}
    rows.append([Cell(_("max / mean"), AUTO), Cell("", AUTO), Cell(ratio["contiguous"], 7, ">"), Cell("  "),
                 Cell("", AUTO), Cell(ratio["zigzag"], 7, ">")])
    return Lines(rows)


def show_layouts(cfg: Settings) -> None:
    """The table of :func:`layout_lines` at the notebook's CP degree (2 when NPROC is 1, so there is a split to see)."""
    world = max(cfg.nproc, 2)
    show(layout_lines(world))
    note(_("{s} positions over {world} ranks; pairs: the causal query-key pairs a rank computes per sequence and "
           "head, blockwise (a block on the diagonal whole, a block wholly in the future skipped)", s=SEQ_LEN,
           world=world))


def plot_layouts(cfg: Settings):
    """Two causal masks side by side, each visible (query, key) pair coloured by the rank that computes it."""
    import matplotlib.pyplot as plt
    import numpy as np

    from ...rank.cp import layout_indices

    world = max(cfg.nproc, 2)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.9))
    for ax, layout in zip(axes, cp_calc.LAYOUTS[::-1]):
        owner = np.full((SEQ_LEN, SEQ_LEN), np.nan)
        for r in range(world):
            for q in layout_indices(layout, SEQ_LEN, world, r).tolist():
                owner[q, :q + 1] = r
        ax.imshow(owner, cmap="viridis", vmin=0, vmax=world - 1, interpolation="nearest")
        work = cp_calc.causal_work_pairs(SEQ_LEN, world, layout)
        ax.set(title=label(_("{layout}: max / mean work {ratio:.2f}", layout=layout, ratio=cp_calc.imbalance(work))),
               xlabel=label(_("key position")), ylabel=label(_("query position")))
    fig.suptitle(label(_("causal attention over {world} ranks: each colour is one rank's queries", world=world)))
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- 2. parity


def _parity(run) -> dict:
    """One run's worst gaps and tightest bounds over its ranks, and whether every rank held its bounds."""
    by_rank = run.results_by_rank()
    out = {k: max(r["cp_parity"][k] for r in by_rank.values()) for k in ("loss_gap", "grad_gap")}
    out.update({k: min(r["cp_parity"][k] for r in by_rank.values()) for k in ("loss_bound", "grad_bound")})
    out.update(ranks=len(by_rank), ok=all(r["cp_parity"]["ok"] for r in by_rank.values()) and len(by_rank) == run.nproc)
    return out


def show_parity(runs: dict) -> None:
    """Every run's worst loss and gradient gap to one process over its ranks, beside its bounds (the fp32 floor is
    the CPU's rounding, so the numbers vary by machine: the cell that shows them is not compared)."""
    rows = [[Cell(_("run"), AUTO), Cell(_("ranks"), 6, ">"), Cell(_("loss gap"), 10, ">"), Cell(_("bound"), 10, ">"),
             Cell(_("grad gap"), 10, ">"), Cell(_("bound"), 10, ">")]]
    for label, run in runs.items():
        p = _parity(run)
        rows.append([Cell(label, AUTO), Cell(str(p["ranks"]), 6, ">")] + [
            Cell(f"{p[k]:.1e}", 10, ">") for k in ("loss_gap", "loss_bound", "grad_gap", "grad_bound")])
    show(Lines(rows))


def claim_parity(runs: dict) -> None:
    """Every rank of every run: one step's loss and gradients against one process on the unsplit batch (the table
    is :func:`show_parity`'s)."""
    found = {label: _parity(run) for label, run in runs.items()}
    claim(f"in every run, on every rank, one step's loss and every gradient (after the sync) equal one process's on "
          f"the unsplit batch, within {parity.K} x the fp32 rounding floor measured against fp64 in the same rank",
          all(p["ok"] for p in found.values()),
          measured=", ".join(f"{label} loss {p['loss_gap']:.1e} / {p['loss_bound']:.1e}, grad {p['grad_gap']:.1e} / "
                             f"{p['grad_bound']:.1e}" for label, p in found.items()))


# ---------------------------------------------------------------------------------------- 3. bytes


def claim_bytes(runs: dict, cfg: Settings, labels=("ring, zig-zag", "ring, contiguous", "Ulysses")) -> None:
    """What each rank's attention sent per step, counted, against :func:`helpers.calc.cp.bytes_per_step`."""
    rows = [[Cell(_("run"), AUTO), Cell(_("forward KiB"), 12, ">"), Cell(_("formula"), 9, ">"),
             Cell(_("backward KiB"), 13, ">"), Cell(_("formula"), 9, ">")]]
    ok = True
    for label in labels:
        by_rank = runs[label].results_by_rank()
        for phase in ("forward", "backward"):
            ok &= all(r["cp_per_step"][phase]["sent_bytes"] == r["cp_formula"][phase] ==
                      r["cp_per_step"][phase]["recv_bytes"] for r in by_rank.values())
        r = by_rank[0]
        rows.append([Cell(label, AUTO)] + [Cell(f"{v / 1024:.1f}", w, ">") for v, w in (
            (r["cp_per_step"]["forward"]["sent_bytes"], 12), (r["cp_formula"]["forward"], 9),
            (r["cp_per_step"]["backward"]["sent_bytes"], 13), (r["cp_formula"]["backward"], 9))])
    show(Lines(rows))
    note(_("per rank and training step, {layers} layers, b={b} s={s} h={h} fp32; each rank receives as much as it "
           "sends", layers=N_LAYER, b=cfg.batch, s=SEQ_LEN, h=D_MODEL))
    claim(f"on every rank of the three runs ({cfg.nproc} CP ranks), the bytes sent and received per step, forward "
          f"and backward, are exactly the formula's: the ring 2 (W-1) K/V blocks forward and 4 (W-1) backward, "
          f"Ulysses four all-to-alls each way", ok)


# ---------------------------------------------------------------------------------------- 4. the work


def _pairs(run) -> dict[int, tuple[float, float]]:
    """{rank: (query-key pairs its forward attention computed per step, the formula's)}."""
    return {rank: (r["cp_per_step"]["forward"]["work_pairs"], r["cp_formula"]["work_pairs"])
            for rank, r in sorted(run.results_by_rank().items())}


def show_balance(runs: dict, labels=("ring, contiguous", "ring, zig-zag", "Ulysses")) -> None:
    """Per rank: the query-key pairs its attention computed per step in forward (counted), the formula's, and the
    milliseconds its forward attention arithmetic took per step (times vary by machine: the cell is not compared;
    ranks that share cores also wait for one, so the times are shown, not claimed)."""
    rows = [[Cell(_("run"), AUTO), Cell("rank", 5, ">"), Cell(_("pairs / step"), 13, ">"),
             Cell(_("formula"), 9, ">"),
             Cell(_("forward attention ms"), 21, ">")]]
    for label in labels:
        by_rank = runs[label].results_by_rank()
        for rank, (counted, formula) in _pairs(runs[label]).items():
            ms = 1e3 * by_rank[rank]["cp_per_step"]["forward"]["compute_s"]
            rows.append([Cell(label if rank == 0 else "", AUTO), Cell(str(rank), 5, ">"),
                         Cell(f"{counted:,.0f}", 13, ">"), Cell(f"{formula:,.0f}", 9, ">"), Cell(f"{ms:.1f}", 21, ">")])
    show(Lines(rows))


def claim_balance(runs: dict, cfg: Settings, labels=("ring, contiguous", "ring, zig-zag", "Ulysses")) -> dict:
    """Claims that every rank computed the formula's pairs and the imbalance (max/mean) of each layout; returns
    {label: max/mean} (the table is :func:`show_balance`'s)."""
    ok, ratios = True, {}
    for label in labels:
        pairs = _pairs(runs[label])
        ok &= all(counted == formula for counted, formula in pairs.values())
        ratios[label] = cp_calc.imbalance(counted for counted, _formula in pairs.values())
    w = cfg.nproc
    claim(f"on every rank, the query-key pairs computed per step are the formula's, and the slowest rank's share is "
          f"max/mean = 2W/(W+1) = {2 * w / (w + 1):.3f} with contiguous positions, 1 with zig-zag and with Ulysses",
          ok and abs(ratios["ring, contiguous"] - 2 * w / (w + 1)) < 1e-9 and ratios["ring, zig-zag"] == 1
          and ratios["Ulysses"] == 1,
          measured=", ".join(f"{label} {ratio:.3f}" for label, ratio in ratios.items()))
    return ratios


# ---------------------------------------------------------------------------------------- 5. activations


def activation_rows(runs: dict, cfg: Settings, labels=("ring, zig-zag", "Ulysses")) -> list[dict]:
    """Per run and rank: MemTracker's activation bytes after one forward, and the formula's."""
    rows = []
    for label in labels:
        run = runs[label].result  # rank 0's report: the model and the attention every rank ran
        shape = dict(b=cfg.batch, h=D_MODEL, a=HEADS, n_layer=N_LAYER, vocab=run["vocab_size"],
                     attention=run["cp_attention"], core=run["gpt"]["attention"])
        want = cp_calc.activation_bytes_per_rank(SEQ_LEN, cp=cfg.nproc, **shape)["total"]
        whole = cp_calc.activation_bytes_per_rank(SEQ_LEN, cp=1, **shape)["total"]
        for rank, r in sorted(runs[label].results_by_rank().items()):
            rows.append(dict(run=label, rank=rank, measured=r["cp_act_bytes"], formula=want, whole=whole))
    return rows


def claim_activations(runs: dict, cfg: Settings) -> list[dict]:
    """The table of :func:`activation_rows` and the claim that every rank holds the formula's bytes within 1%."""
    rows = activation_rows(runs, cfg)
    table = [[Cell(_("run"), AUTO), Cell("rank", 5, ">"), Cell(_("measured KiB"), 13, ">"),
              Cell(_("formula KiB"), 12, ">"), Cell(_("one process KiB"), 16, ">")]]
    table += [[Cell(r["run"] if r["rank"] == 0 else "", AUTO), Cell(str(r["rank"]), 5, ">"),
               Cell(f"{r['measured'] / 1024:.1f}", 13, ">"), Cell(f"{r['formula'] / 1024:.1f}", 12, ">"),
               Cell(f"{r['whole'] / 1024:.1f}", 16, ">")] for r in rows]
    show(Lines(table))
    note(_("activations right after one forward of this rank's positions (MemTracker), fp32; one process: the "
           "same model on whole sequences (formula)"))
    ok = all(abs(r["measured"] - r["formula"]) <= 0.01 * r["formula"] for r in rows)
    claim(f"on every rank, MemTracker's activations are chapter 08's formula at s / {cfg.nproc} positions within 1% "
          f"(Ulysses adds the softmax of {HEADS} / {cfg.nproc} heads over the whole sequence, its math kernel's)", ok,
          measured=", ".join(f"{r['run']} rank {r['rank']} {r['measured'] / r['formula']:.4f}" for r in rows
                             if r["rank"] == 0))
    return rows


# ---------------------------------------------------------------------------------------- 6. CP x DP


def claim_2d(run) -> None:
    """The (dp, cp) = (2, 2) run: each rank's place on the mesh, and its bytes against the formula at CP 2."""
    by_rank = run.results_by_rank()
    for rank, r in sorted(by_rank.items()):
        note(_("rank {rank}: dp rank {dp}, cp rank {cp} -> positions {positions} of the sequences of data shard "
               "{dp}", rank=rank, dp=r["dp_rank"], cp=r["cp_rank"], positions=_ranges(r["cp_positions"])))
    roles = sorted((r["dp_rank"], r["cp_rank"]) for r in by_rank.values())
    claim("the 4 ranks cover the 2 x 2 (dp, cp) mesh once each, and each sends per step the ring's bytes at CP 2",
          roles == [(d, c) for d in range(2) for c in range(2)] and all(
              r["cp_per_step"][phase]["sent_bytes"] == r["cp_formula"][phase] for r in by_rank.values()
              for phase in ("forward", "backward")))


# ---------------------------------------------------------------------------------------- 7. torch's own


def try_torch_cp(cfg: Settings, ranks: int = 2):
    """Launch ``--attn torch`` (torch's ``context_parallel``) on ``ranks`` ranks for one step: (run or None, the
    error's message or None)."""
    from ... import launch

    try:
        run = launch.torchrun(SCRIPT, nproc=ranks, args=cfg.args("--attn", "torch"), show="none", timeout=300,
                              stall_timeout=120, name="12_torch_cp")
        return run, None
    except launch.LaunchError as e:
        return None, str(e)


def claim_torch_cp(outcome, cfg: Settings) -> None:
    """What torch's context_parallel did here: on CPU, the rank's error quoted and claimed to be torch's reason."""
    run, error = outcome
    if cfg.gpus:
        say(run.log(0).splitlines()[-1] if run else error.splitlines()[0])
        return
    reason = next((l.strip() for l in (error or "").splitlines() if "Error: --attn torch:" in l), None)
    if reason:
        say(reason[reason.index("--attn torch:"):])
    claim("on CPU the launch stops before training, with torch's reason: context_parallel has no sharding strategy "
          "for the CPU kernel of causal SDPA", run is None and reason is not None and "no sharding" in reason)


# ---------------------------------------------------------------------------------------- 8. refused


def refusals() -> list[tuple[str, str]]:
    """What the launcher says to bad CP input, without starting anything: (the input, the message)."""
    from ... import launch

    cases = [(4, ["--seq-len", "60"]), (4, ["--attn", "ulysses", "--n-head", "2"]), (4, ["--dp", "2", "--cp", "4"]),
             (3, ["--cp", "2"])]
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
        say(f"{given:34s} -> {message}")
    claim("each bad input is refused before any rank starts, with the value to change",
          all(m != "accepted" and " use " in m for _, m in found))
