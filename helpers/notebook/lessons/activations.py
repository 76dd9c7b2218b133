"""Notebook 08 (a small GPT and where its memory goes): the settings, tables and claim lines its cells call.

The formulas are :mod:`helpers.calc.activations` (Korthikanti et al. 2022, adapted to the course's GPT) and
:mod:`helpers.calc.memory` (model states); the measurements come from ``course/gpt_memory.py`` (MemTracker) and
``course/gpt_train.py``. A formula is checked against what was measured within :data:`FORMULA_TOLERANCE`: the
formula names every tensor autograd keeps, so what it leaves out is allocator-free bookkeeping (a few scalars).

Example (notebook cells)::

    cfg = lesson.settings(PROFILE, NPROC, STEPS, GLOBAL_BATCH, SIZES, REPEATS)
    mem = launch.torchrun("course/gpt_memory.py", nproc=1, args=lesson.memory_args(cfg))
    rows = lesson.claim_formula(mem)
"""
from __future__ import annotations

from dataclasses import dataclass

from ...calc import activations, memory
from ...calc.throughput import median_spread
from ..checks import claim
from ..i18n import _
from .table import Lines, columns, line, show

FORMULA_TOLERANCE = 0.10  # measured vs formula, relative: the bound, for every size shown
TRAIN_MARGIN = 0.8  # the held-out loss must end below this fraction of the unigram baseline
SIZES = {"smoke": ("64x8x64", "128x8x64", "64x16x64", "64x8x128"),
         "full": ("256x8x256", "512x8x256", "256x16x256", "256x8x512")}
MIB = 2 ** 20
GIB = 2 ** 30


@dataclass(frozen=True)
class Settings:
    profile: str
    nproc: int
    steps: int
    global_batch: int
    sizes: tuple
    repeats: int
    n_layer: int = 2
    n_head: int = 4

    def __str__(self) -> str:
        return (f"profile={self.profile} nproc={self.nproc} steps={self.steps} global_batch={self.global_batch} "
                f"sizes={' '.join(self.sizes)} (seq x batch x width) repeats={self.repeats}")


def resolve(profile: str, default_nproc: int, nproc=None, steps=None, global_batch=24, sizes=None,
            repeats=None) -> Settings:
    """The notebook's parameters with defaults filled in; refused with what to change when they cannot run."""
    nproc = nproc or default_nproc
    steps = steps or (60 if profile == "smoke" else 300)
    repeats = repeats or (12 if profile == "smoke" else 20)
    sizes = tuple(sizes or SIZES[profile])
    if nproc < 1 or global_batch % nproc:
        raise ValueError(f"GLOBAL_BATCH={global_batch} is not a multiple of NPROC={nproc}: every rank gets "
                         f"GLOBAL_BATCH / NPROC sequences (24 splits over 1, 2, 3 and 4 ranks)")
    if repeats < 3:
        raise ValueError(f"REPEATS={repeats}: a step time worth comparing is a median of at least 3 steps")
    for size in sizes:
        parts = size.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"SIZES entry {size!r}: write SEQxBATCHxWIDTH, e.g. '64x8x64'")
        if int(parts[2]) % 4:
            raise ValueError(f"SIZES entry {size!r}: the width must divide by the 4 heads")
    return Settings(profile, nproc, steps, global_batch, sizes, repeats)


def settings(profile="auto", nproc=None, steps=None, global_batch=24, sizes=None, repeats=None) -> Settings:
    """:func:`resolve` with this machine's profile and default rank count; prints the result."""
    from .. import env

    cfg = resolve(env.profile(profile), env.default_nproc(), nproc, steps, global_batch, sizes, repeats)
    print(cfg)
    return cfg


def train_args(cfg: Settings) -> list:
    """``course/gpt_train.py``'s flags. The smoke profile always trains on the generated text: its few steps were
    measured to clear the loss margin there; a corpus on disk (``data/text/input.txt``) is for the full profile."""
    text = ["--dataset", "generated"] if cfg.profile == "smoke" else []
    return ["--steps", cfg.steps, "--batch-size", cfg.global_batch // cfg.nproc, *text]


def memory_args(cfg: Settings) -> list:
    """``course/gpt_memory.py``'s flags: every size with both attentions; the checkpointing runs at the first."""
    seq, batch, width = cfg.sizes[0].split("x")
    return ["--sizes", *cfg.sizes, "--attentions", "math", "sdpa", "--repeats", cfg.repeats, "--seq-len", seq,
            "--batch-size", batch, "--d-model", width, "--n-layer", cfg.n_layer, "--n-head", cfg.n_head]


# ------------------------------------------------------------------------------------ 1. the model

def claim_parameter_count(model, cfg) -> None:
    """``parameter_count``'s arithmetic against the parameters of a model built (on the meta device) from ``cfg``."""
    from ...rank.gpt import parameter_count

    counted = sum(p.numel() for p in model.parameters())
    claim("parameter_count(cfg) equals the built model's parameters exactly", counted == parameter_count(cfg),
          measured=f"{counted}")


# ------------------------------------------------------------------------------------------- 2. training


def claim_training(run, cfg: Settings) -> dict:
    r = run.result
    ratio = r["test_loss"] / r["unigram_loss"]
    # the losses go in the measured part: the last digits depend on the machine's float kernels
    claim(f"the held-out loss ends below {TRAIN_MARGIN} x the unigram baseline", ratio < TRAIN_MARGIN,
          measured=f"{r['test_loss']:.3f} vs {r['unigram_loss']:.3f} nats/char = {ratio:.2f} x, {cfg.nproc} "
                   f"rank(s), {cfg.steps} steps of {r['global_batch']} sequences")
    return r


# -------------------------------------------------------------------------------- 2. the formula, measured


def formula_bytes(row: dict, checkpoint: str | None = None, tp: int = 1, sp: bool = False) -> float:
    """:func:`helpers.calc.activations.model_bytes` for a measured row of ``course/gpt_memory.py``."""
    return activations.model_bytes(row["seq_len"], row["batch"], row["d_model"], row["n_head"], row["n_layer"],
                                   row["vocab"], row["dtype"], row["attention"], checkpoint or row["checkpoint"],
                                   tp, sp)


def claim_formula(run) -> list[dict]:
    """Measured activations (end of forward) against the formula at every size and attention; one claim each
    attention, every ratio within :data:`FORMULA_TOLERANCE`."""
    rows = []
    cuda = all("cuda_act_bytes" in r for r in run.result["activations"])  # GPUs: the allocator's count too
    spec = ((5, ">"), (5, ">"), (5, ">"), (9, ">"), (13, ">"), (12, ">"), (6, ">"), (9, ">"), (13, ">"))
    heads = [_("seq"), "batch", _("width"), _("attention"), _("measured MiB"), _("formula MiB"), _("ratio"),
             _("s^2 share")] + ([_("allocator MiB")] if cuda else [])
    table = [columns(spec, *heads)]
    for r in run.result["activations"]:
        formula = formula_bytes(r)
        sq = r["n_layer"] * activations.layer_terms(r["seq_len"], r["batch"], r["d_model"], r["n_head"],
                                                    r["dtype"], r["attention"]).get("softmax output", 0)
        rows.append(dict(r, formula=formula, ratio=r["act_bytes"] / formula, square_share=sq / formula))
        table.append(columns(spec, str(r["seq_len"]), str(r["batch"]), str(r["d_model"]), r["attention"],
                             f"{r['act_bytes'] / MIB:.2f}", f"{formula / MIB:.2f}", f"{rows[-1]['ratio']:.3f}",
                             f"{rows[-1]['square_share']:.0%}",
                             *([f"{r['cuda_act_bytes'] / MIB:.2f}"] if cuda else [])))
    show(Lines(table))
    for attention in ("math", "sdpa"):
        ratios = [r["ratio"] for r in rows if r["attention"] == attention]
        if ratios:
            claim(f"{attention} attention: measured / formula within 1 +- {FORMULA_TOLERANCE} at all "
                  f"{len(ratios)} sizes", all(abs(x - 1) <= FORMULA_TOLERANCE for x in ratios),
                  measured=f"{min(ratios):.3f} - {max(ratios):.3f}")
    pairs = [(m, s) for m in rows for s in rows if m["attention"] == "math" and s["attention"] == "sdpa"
             and all(m[k] == s[k] for k in ("seq_len", "batch", "d_model"))]
    gaps = [(m["act_bytes"] - s["act_bytes"]) / (m["formula"] - s["formula"]) for m, s in pairs]
    claim("what sdpa saves over math is the formula's s^2 terms (softmax output and mask, less the logsumexp), "
          f"within {FORMULA_TOLERANCE:.0%}", bool(gaps) and all(abs(g - 1) <= FORMULA_TOLERANCE for g in gaps),
          measured=", ".join(f"{g:.3f}" for g in gaps))
    return rows


def claim_peak(run) -> dict:
    """The peak of one training step by kind; parameters and AdamW state against the fp32 formula (4P and 8P)."""
    r, peak = run.result, run.result["peak_split"]
    states = memory.zero_model_state_bytes(r["params"], 1, stage=0, precision="fp32")
    total = sum(peak.values())
    show(Lines([columns(((16, ">"), (8, ">"), (None, "<"), (6, ">")), label, f"{peak[kind] / MIB:.2f}", "MiB",
                        f"{peak[kind] / total:.1%}")
                for kind, label in (("param", _("parameters")), ("grad", _("gradients")),
                                    ("opt", _("optimizer state")), ("act", _("activations")),
                                    ("temp", _("temporaries")))]))
    claim("parameters at the peak are exactly 4 bytes x parameter count", peak["param"] == states["params"],
          measured=f"{peak['param']} B")
    after_forward = r["checkpointing"]["none"]["act_bytes"]
    claim("the peak falls in the backward: every activation is still held when it starts, and its first gradients and "
          "temporaries join them", r["peak_phase"] == "backward", measured=r["peak_phase"])
    claim("activations at the step's peak are fewer than right after the forward (backward frees as it goes)",
          peak["act"] < after_forward, measured=f"{peak['act'] / MIB:.2f} < {after_forward / MIB:.2f} MiB")
    opt = peak["opt"] / states["optimizer"]
    claim("AdamW's state is 8 bytes per parameter (m and v, plus a step counter per tensor) within 1%",
          abs(opt - 1) <= 0.01, measured=f"{opt:.4f} x 8P")
    return peak


# ------------------------------------------------------------------------------------- 3. checkpointing


def claim_checkpointing(run) -> dict:
    """Per mode: activations measured vs formula, and the step time (median, min-max of the interleaved steps)."""
    r = run.result
    base = dict(next(x for x in r["activations"] if x["attention"] == "math"))
    out = {}
    spec = ((10, ">"), (13, ">"), (12, ">"), (6, ">"), (22, ">"))
    table = [columns(spec, _("checkpoint"), _("measured MiB"), _("formula MiB"), _("saved"),
                     _("step ms (min-max)"))]
    for mode, c in r["checkpointing"].items():
        med, lo, hi = median_spread(c["step_s"])
        out[mode] = dict(act=c["act_bytes"], formula=formula_bytes(base, mode), step=(med, lo, hi))
    none = out["none"]
    for mode, o in out.items():
        o["saved"] = 1 - o["act"] / none["act"]
        o["cost"] = o["step"][0] / none["step"][0] - 1
        med, lo, hi = o["step"]
        table.append(columns(spec[:4] + ((9, ">"),), mode, f"{o['act'] / MIB:.2f}", f"{o['formula'] / MIB:.2f}",
                             f"{o['saved']:.0%}", f"{med * 1e3:.1f}", f"({lo * 1e3:.1f}-{hi * 1e3:.1f})"))
    show(Lines(table))
    ratios = [o["act"] / o["formula"] for o in out.values()]
    claim(f"every mode's activations within 1 +- {FORMULA_TOLERANCE} of the formula",
          all(abs(x - 1) <= FORMULA_TOLERANCE for x in ratios), measured=", ".join(f"{x:.3f}" for x in ratios))
    claim("full < selective < none in activation memory",
          out["full"]["act"] < out["selective"]["act"] < none["act"])
    claim("recomputing costs time: full checkpointing's median step is slower than no checkpointing's",
          out["full"]["step"][0] > none["step"][0], measured=f"{out['full']['cost']:+.0%}")
    show(Lines([line(_("{mode}: {saved} less activation memory for {cost} step time", mode=mode,
                       saved=f"{out[mode]['saved']:.0%}", cost=f"{out[mode]['cost']:+.0%}"))
                for mode in ("selective", "full")]))
    return out


# --------------------------------------------------------------------------------------- 4. meta init


def claim_meta_init(run) -> None:
    claim("the GPT built on the meta device, to_empty + init_weights(seed), equals a normal build, tensor for tensor",
          run.result["meta_init_equal"])


# ---------------------------------------------------------------------------------- 5. the calculator


def claim_calculator(figures, run) -> None:
    """The calculator's activation row, for the run's first size, against what that run measured."""
    base = next(x for x in run.result["activations"] if x["attention"] == "math")
    predicted = figures.activations["total"]
    ratio = base["act_bytes"] / predicted
    claim(f"the calculator's activations match the measured run within 1 +- {FORMULA_TOLERANCE}",
          abs(ratio - 1) <= FORMULA_TOLERANCE, measured=f"{ratio:.3f}")


# ------------------------------------------------------------------------------------- 7. a real size, in bf16

GPT3 = dict(s=2048, b=1, h=12288, a=96, vocab=50257, n_layer=96)  # GPT-3 175B (Brown et al. 2020, Table 2.1)


def fake_activations(s: int, b: int, h: int, a: int, vocab: int, n_layer: int, attention: str = "math",
                     dtype=None) -> int:
    """MemTracker's activation bytes right after the forward of the course GPT at this shape, built and run under
    ``FakeTensorMode``: every tensor has its shape, dtype and size, and none has storage, so a shape that would
    need gigabytes is measured in a fraction of a second. ``dtype``: the parameters' (default torch.bfloat16)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from ...rank.gpt import GPT, GPTConfig

    dtype = dtype or torch.bfloat16
    shape = GPTConfig(vocab_size=vocab, seq_len=s, n_layer=n_layer, n_head=a, d_model=h, attention=attention)
    before = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(dtype)  # parameters made in bf16 (a fake tensor cannot be cast in place)
        try:
            model = GPT(shape)
        finally:
            torch.set_default_dtype(before)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            x, y = (torch.randint(0, vocab, (b, s)) for _ in range(2))  # the batch's ids, as the formula counts them
            logits, loss = model(x, y)  # held, as a training step holds them until its backward
            snapshot = tracker.get_tracker_snapshot("current")
    return next(iter(snapshot.values()))[_MemRefType.ACT]


def real_size_rows(shape: dict = GPT3) -> list[dict]:
    """Per attention, one layer's activation bytes at ``shape`` in bf16, measured (a model of 2 layers less one of
    1, under :func:`fake_activations`) and by the formula, and what the whole model holds per micro-batch."""
    rows = []
    for attention in activations.ATTENTIONS:
        dims = dict(shape, attention=attention)
        one, two = fake_activations(**dict(dims, n_layer=1)), fake_activations(**dict(dims, n_layer=2))
        layer = two - one
        formula = activations.layer_bytes(shape["s"], shape["b"], shape["h"], shape["a"], "bf16", attention)
        head = one - layer
        head_formula = sum(activations.head_terms(shape["s"], shape["b"], shape["h"], shape["vocab"], "bf16").values())
        rows.append(dict(attention=attention, layer=layer, formula=formula, head=head, head_formula=head_formula,
                         model=shape["n_layer"] * layer + head))
    return rows


def claim_real_size(shape: dict = GPT3, name: str = "GPT-3 175B") -> list[dict]:
    """The table of :func:`real_size_rows` and the claim that the measured layer and head equal the formula's."""
    rows = real_size_rows(shape)
    spec = ((9, ">"), (10, ">"), (8, ">"), (9, ">"), (8, ">"), (22, ">"))
    table = [columns(spec, _("attention"), _("layer GiB"), _("formula"), _("head GiB"), _("formula"),
                     _("x {n} layers + head", n=shape["n_layer"]))]
    table += [columns(spec[:5] + ((18, ">"),), r["attention"], f"{r['layer'] / GIB:.3f}", f"{r['formula'] / GIB:.3f}",
                      f"{r['head'] / GIB:.3f}", f"{r['head_formula'] / GIB:.3f}", f"{r['model'] / GIB:.1f}", "GiB")
              for r in rows]
    table.append(line(_("the course GPT at {name}'s shape ({dims}), bf16, on fake tensors: nothing allocated",
                        name=name, dims=f"s={shape['s']}, b={shape['b']}, h={shape['h']}, a={shape['a']}, "
                                        f"V={shape['vocab']}")))
    show(Lines(table))
    ok = all(abs(r["layer"] - r["formula"]) <= 0.01 * r["formula"]
             and abs(r["head"] - r["head_formula"]) <= 0.01 * r["head_formula"] for r in rows)
    claim(f"at {name}'s real shape in bf16, one layer and the head hold the formula's bytes within 1%, with both "
          "attentions", ok, measured=", ".join(f"{r['attention']} {r['layer'] / r['formula']:.3f} and "
                                              f"{r['head'] / r['head_formula']:.3f}" for r in rows))
    return rows
