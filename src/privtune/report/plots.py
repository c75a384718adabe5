"""The report's plots, drawn with matplotlib (object API, Agg canvas: no display needed).

Each ``plot_*`` function takes a :class:`~privtune.report.run.RunData` (and precomputed
budget numbers) and returns a ``matplotlib.figure.Figure``, or ``None`` when the run has
nothing to show for it.  :func:`budget_points` does the privacy arithmetic for the
budget plot; all of it goes through :func:`privtune.accounting.compute_epsilon`
(composition is not additive, so "ε after trial k" is recomputed from the cumulative
events, never summed).
"""

from __future__ import annotations

import dataclasses
import io
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

import privtune.accounting as acct
from privtune.accounting.events import DPSGDEvent, GaussianEvent
from privtune.accounting.gdp import mu_from_epsilon
from privtune.report.release import is_private_loss_label
from privtune.report.run import RunData, load_events

BLUE = "#3451b2"
LIGHT_BLUE = "#9fb3f0"
ORANGE = "#e8590c"
GREEN = "#2b8a3e"
GREY = "#868e96"
RED = "#c92a2a"
INK = "#212529"

NOT_PRIVATE = "NOT PRIVATE"

_RC = {
    "font.size": 9.5,
    "axes.titlesize": 10.5,
    "axes.titleweight": "bold",
    "axes.labelsize": 9.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e9ecef",
    "grid.linewidth": 0.8,
    "axes.edgecolor": "#adb5bd",
    "axes.labelcolor": INK,
    "xtick.color": "#495057",
    "ytick.color": "#495057",
    "legend.frameon": False,
    "legend.fontsize": 8.5,
    "axes.axisbelow": True,
}


def new_figure(width: float = 7.2, height: float = 3.2, ncols: int = 1, **kw: Any):
    """A Figure with an Agg canvas and ``ncols`` axes, styled for the report."""
    # Lazy: matplotlib only when a plot is drawn (report/__init__ is lazy for the same reason).
    import matplotlib

    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, ncols, **kw)
    return fig, axes


def _styled(fn):
    """Run a plotting function under the report's rc style."""

    def wrapper(*args, **kwargs):
        # Lazy: matplotlib only when a plot is drawn (report/__init__ is lazy for the same reason).
        import matplotlib

        with matplotlib.rc_context(_RC):
            return fn(*args, **kwargs)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def figure_png(fig: Figure) -> bytes:
    """Render ``fig`` to PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, facecolor="white")
    return buf.getvalue()


def _stamp_not_private(fig: Figure) -> None:
    fig.text(0.995, 0.01, NOT_PRIVATE, ha="right", va="bottom", color=RED, fontsize=11, fontweight="bold",
             alpha=0.9)


def _badge_not_private(fig: Figure, what: str) -> None:
    """A red NOT PRIVATE banner across the top of the picture itself (it travels with the PNG)."""
    fig.suptitle(f"{NOT_PRIVATE}: {what}", color="white", fontsize=10.5, fontweight="bold",
                 bbox={"boxstyle": "round,pad=0.3", "facecolor": RED, "edgecolor": RED})


def _compute_epsilon(events: Sequence, delta: float, accountant: str) -> float:
    if not events:
        return 0.0
    return float(acct.compute_epsilon(list(events), delta, accountant=accountant))


# ===================================================================================== budget
@dataclass
class BudgetPoints:
    """Cumulative ε as the accountant composes it.

    ``labels[i]`` names checkpoint i ("trial 3", "final run", or "step 120");
    ``cumulative[i]`` is ε of all events up to checkpoint i; ``individual[i]`` is ε of the
    events of that checkpoint alone (``None`` when not meaningful).
    """

    labels: list[str] = field(default_factory=list)
    cumulative: list[float] = field(default_factory=list)
    individual: list[float | None] = field(default_factory=list)
    kind: str = "trials"  # "trials" or "steps"
    tuning_epsilon: float | None = None  # ε of all trial events composed
    total_epsilon: float | None = None  # ε of every event of the certificate, recomputed
    target_epsilon: float | None = None  # the budget the user asked for
    notes: list[str] = field(default_factory=list)


def _truncate(event: Any, units: int) -> Any:
    """The first ``units`` steps (DPSGDEvent) or releases (GaussianEvent) of ``event``."""
    if isinstance(event, DPSGDEvent):
        return dataclasses.replace(event, steps=units)
    if isinstance(event, GaussianEvent):
        return dataclasses.replace(event, count=units)
    raise TypeError(type(event).__name__)


def _units(event: Any) -> int | None:
    if isinstance(event, DPSGDEvent):
        return event.steps
    if isinstance(event, GaussianEvent):
        return event.count
    return None


def trial_labels(trials: Sequence[dict]) -> list[str]:
    """One name per trial, the same in every chart and table of the report: ``"trial 1"``, ``"trial 2"``, …
    (numbered from 1 in the order run, over all phases and sweeps), and ``"pilot <mode>"`` for a
    ``--mode auto`` pilot (pilots are not numbered)."""
    out, k = [], 0
    for t in trials:
        if "pilot" in str(t.get("phase", "")):
            out.append(f"pilot {(t.get('hyperparameters') or {}).get('mode', '')}".strip())
        else:
            k += 1
            out.append(f"trial {k}")
    return out


def _tick(label: str) -> str:
    """A trial's name on a chart's x axis: its number, or ``P:<mode>`` for a pilot."""
    return label.replace("trial ", "").replace("pilot ", "P:")


def budget_points(run: RunData, max_points: int = 40) -> BudgetPoints | None:
    """ε after each trial and after the final run (or, without trials, along the final run's steps)."""
    delta = run.delta
    if delta is None:
        return None
    acc = run.accountant
    bp = BudgetPoints()
    target = run.metrics.get("target_epsilon", run.config.get("epsilon", run.metrics.get("epsilon")))
    bp.target_epsilon = float(target) if isinstance(target, (int, float)) else None
    cert_dicts = run.certificate.get("events") if isinstance(run.certificate.get("events"), list) else []
    cert_events = load_events(cert_dicts)
    bp.total_epsilon = _compute_epsilon(cert_events, delta, acc) if cert_events else None

    names = trial_labels(run.trials)
    named = [(t, name) for t, name in zip(run.trials, names) if isinstance(t.get("events"), list)]
    trials = [t for t, _ in named]
    if trials:
        idx = list(range(len(trials)))
        if len(idx) > max_points:  # keep the cost bounded: evenly spaced checkpoints, always the last
            step = len(idx) / max_points
            idx = sorted({int(i * step) for i in range(max_points)} | {len(idx) - 1})
        cum: list = []
        trial_dicts: list = []
        marks = set(idx)
        for i, (t, name) in enumerate(named):
            ev = load_events(t["events"])
            cum += ev
            trial_dicts += t["events"]
            if i in marks:
                bp.labels.append(name)
                bp.cumulative.append(_compute_epsilon(cum, delta, acc))
                bp.individual.append(_compute_epsilon(ev, delta, acc) if ev else 0.0)
        bp.tuning_epsilon = bp.cumulative[-1] if bp.cumulative else 0.0
        if cert_events:
            bp.labels.append("final run")
            bp.cumulative.append(bp.total_epsilon)
            if cert_dicts[: len(trial_dicts)] == trial_dicts:
                rest = cert_events[len(trial_dicts):]
                bp.individual.append(_compute_epsilon(rest, delta, acc) if rest else 0.0)
            else:
                bp.individual.append(None)
                bp.notes.append(
                    "The certificate accounts the tuning trials as a whole (e.g. repeat-and-select), so its total is "
                    "not the trial-by-trial composition drawn here; the curve up to the last trial composes the "
                    "trials' own events."
                )
        return bp

    # no trials: ε along the final run's steps
    bp.kind = "steps"
    units = [_units(e) for e in cert_events]
    if not cert_events or any(u is None for u in units):
        if cert_events:
            bp.labels, bp.cumulative, bp.individual = ["final run"], [bp.total_epsilon], [bp.total_epsilon]
        return bp if cert_events else None
    total_units = sum(units)
    n = min(12, total_units)  # each checkpoint is one accountant call
    checkpoints = sorted({max(1, round(total_units * (i + 1) / n)) for i in range(n)})
    for c in checkpoints:
        events, left = [], c
        for e, u in zip(cert_events, units):
            if left <= 0:
                break
            events.append(e if u <= left else _truncate(e, left))
            left -= u
        bp.labels.append(f"step {c}")
        bp.cumulative.append(_compute_epsilon(events, delta, acc))
        bp.individual.append(None)
    bp.tuning_epsilon = 0.0
    return bp


@_styled
def plot_budget(run: RunData, bp: BudgetPoints) -> Figure | None:
    """Left: ε if we had stopped after each trial (composed), vs the naive sum. Right: tuning vs final."""
    if bp is None or not bp.cumulative:
        return None
    two = bp.kind == "trials" and bp.total_epsilon is not None
    fig, axes = new_figure(9.6 if two else 7.2, 3.4, ncols=2 if two else 1,
                           gridspec_kw={"width_ratios": [2.3, 1]} if two else None)
    ax = axes[0] if two else axes
    x = list(range(1, len(bp.cumulative) + 1))
    if bp.kind == "trials":
        ax.plot(x, bp.cumulative, "-o", color=BLUE, lw=2, ms=5,
                label=f"ε if we had stopped here (composed); final ε = {bp.cumulative[-1]:.4g}")
        if all(v is not None for v in bp.individual):
            naive = [sum(bp.individual[: i + 1]) for i in range(len(bp.individual))]  # type: ignore[arg-type]
            ax.plot(x, naive, "--", color=GREY, lw=1.3, label="sum of per-step ε (naive; not how ε composes)")
        ticks = x if len(x) <= 14 else x[:: max(1, len(x) // 10)] + [x[-1]]
        ax.set_xticks(ticks)
        ax.set_xticklabels([_tick(bp.labels[i - 1])
                            if bp.labels[i - 1] != "final run" else "final" for i in ticks])
        ax.set_xlabel("after trial k (P: mode-auto pilot)  →  final run")
        ax.set_title("Privacy spent: ε after each trial, composed by the accountant")
    else:
        steps = [int(s.split()[1]) for s in bp.labels if s.startswith("step ")]
        if len(steps) == len(bp.cumulative):
            ax.plot(steps, bp.cumulative, "-", color=BLUE, lw=2,
                    label=f"ε if we had stopped at this step; final ε = {bp.cumulative[-1]:.4g}")
            ax.set_xlabel("optimizer step of the final run")
        else:
            ax.bar(bp.labels, bp.cumulative, color=BLUE)
        ax.set_title("Privacy spent during training (composed by the accountant)")
    if bp.target_epsilon is not None:
        ax.axhline(bp.target_epsilon, color=ORANGE, lw=1.2, ls=":", label=f"budget ε = {bp.target_epsilon:g}")
    ax.set_ylabel(f"ε  (δ = {run.delta:.0e})")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left")
    if two:
        ax2 = axes[1]
        tuning = bp.tuning_epsilon or 0.0
        final_adds = max(0.0, bp.total_epsilon - tuning)
        ax2.barh([0], [tuning], height=0.5, color=LIGHT_BLUE, label=f"tuning trials: ε = {tuning:.3g}")
        ax2.barh([0], [final_adds], height=0.5, left=[tuning], color=BLUE,
                 label=f"final run adds {final_adds:.3g} (total {bp.total_epsilon:.4g})")
        ax2.set_ylim(-0.6, 0.6)
        if bp.target_epsilon is not None:
            ax2.axvline(bp.target_epsilon, color=ORANGE, ls=":", lw=1.2)
        ax2.set_yticks([])
        ax2.set_xlim(0, max(bp.total_epsilon, bp.target_epsilon or 0) * 1.08)
        ax2.set_xlabel("ε")
        ax2.set_title("Split, as the accountant sees it")
        ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=1)
        ax2.grid(axis="y", visible=False)
    if run.not_private:
        _stamp_not_private(fig)
    return fig


# ===================================================================================== strategy
def _trial_r(hp: dict) -> float | None:
    for key in ("r", "total_step_size", "step_size_total"):
        v = hp.get(key)
        if isinstance(v, (int, float)):
            return float(v)
    lr, steps = hp.get("learning_rate"), hp.get("steps")
    if isinstance(lr, (int, float)) and isinstance(steps, (int, float)):
        return float(lr) * float(steps)
    return None


@_styled
def plot_linear_scaling(run: RunData, bp: BudgetPoints | None = None) -> Figure | None:
    """Trials' total step size r = η·T against their ε, the fitted line and the chosen r*."""
    s = run.strategy
    fit = s.get("fit") if isinstance(s.get("fit"), dict) else {}
    space = str(fit.get("space", "epsilon")).lower()
    xlabel = "μ (Gaussian DP) of the trial" if space in ("mu", "μ", "gdp") else "ε of the trial"
    mu_space = xlabel.startswith("μ")
    ext = s.get("extrapolation") if isinstance(s.get("extrapolation"), dict) else {}
    trial_eps = s.get("trial_epsilons") if isinstance(s.get("trial_epsilons"), list) else []
    x_points = ext.get("x_points") if isinstance(ext.get("x_points"), list) else []

    def to_space(eps: float) -> float | None:
        """A trial ε in the fit's space (μ when the fit is in μ-space)."""
        if not mu_space:
            return eps
        for e, xp in zip(trial_eps, x_points):  # the strategy's own conversion, when it recorded one
            if isinstance(e, (int, float)) and abs(e - eps) <= 1e-3 * max(1.0, abs(e)):
                return float(xp)
        try:
            return float(mu_from_epsilon(eps, delta)) if delta is not None else None
        except (ImportError, ValueError):
            return None

    fig, ax = new_figure(7.2, 3.6)
    delta = run.delta
    pts_x, pts_r, pts_s = [], [], []
    for i, t in enumerate(run.trials):
        hp = t.get("hyperparameters") if isinstance(t.get("hyperparameters"), dict) else {}
        r = _trial_r(hp)
        x = hp.get("epsilon")
        if not isinstance(x, (int, float)) and isinstance(t.get("events"), list) and delta is not None:
            x = _compute_epsilon(load_events(t["events"]), delta, run.accountant)
        x = to_space(float(x)) if isinstance(x, (int, float)) else None
        if r is None or not isinstance(x, (int, float)):
            continue
        pts_x.append(float(x))
        pts_r.append(r)
        pts_s.append(t.get("score") if isinstance(t.get("score"), (int, float)) else math.nan)
    if pts_x:
        sc = ax.scatter(pts_x, pts_r, c=pts_s, cmap="viridis", s=36, zorder=3, edgecolor="white", lw=0.6,
                        label="trials (colour = score)")
        if any(not math.isnan(v) for v in pts_s):
            cb = fig.colorbar(sc, ax=ax, pad=0.01, fraction=0.04)
            cb.set_label("trial score")
    tx = x_points if mu_space else trial_eps
    br = s.get("best_r")
    if isinstance(tx, list) and isinstance(br, list) and len(tx) == len(br) and tx:
        ax.scatter(tx, br, marker="o", s=150, facecolor="none", edgecolor=ORANGE, lw=2, zorder=4,
                   label="best r at each trial budget")
    final_x = ext.get("x_final") if mu_space else s.get("final_epsilon", ext.get("x_final"))
    slope, intercept = fit.get("slope"), fit.get("intercept")
    xs_all = [v for v in (pts_x + (tx if isinstance(tx, list) else [])) if isinstance(v, (int, float))]
    if isinstance(final_x, (int, float)):
        xs_all.append(float(final_x))
    if isinstance(slope, (int, float)) and isinstance(intercept, (int, float)) and xs_all:
        hi = max(xs_all) * 1.08
        grid = [hi * i / 100 for i in range(101)]
        line = [slope * g + intercept for g in grid]
        ok = [(g, v) for g, v in zip(grid, line) if v > 0]
        if ok:
            ax.plot([g for g, _ in ok], [v for _, v in ok], "-", color=GREY, lw=1.5,
                    label=f"fit: r = {slope:.3g}·{'μ' if mu_space else 'ε'} {'−' if intercept < 0 else '+'} "
                          f"{abs(intercept):.3g}")
    r_star = s.get("r_star")
    if isinstance(r_star, (int, float)) and isinstance(final_x, (int, float)):
        ax.scatter([final_x], [r_star], marker="*", s=260, color=RED, zorder=5, edgecolor="white",
                   label=f"r* = {r_star:.3g} at final {'μ' if xlabel.startswith('μ') else 'ε'} = {final_x:.3g}")
        ax.axvline(final_x, color=RED, lw=0.8, ls=":")
    if not pts_x and not isinstance(r_star, (int, float)):
        return None
    rs = [v for v in pts_r + ([r_star] if isinstance(r_star, (int, float)) else []) if v > 0]
    if rs and max(rs) / min(rs) > 20:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("total step size r = η · T")
    ax.set_xlim(left=0)
    ax.set_title("Linear scaling: r(ε) fitted on cheap trials, extrapolated to the final run")
    ax.legend(loc="best")
    if run.not_private:
        _stamp_not_private(fig)
    return fig


@_styled
def plot_lr_trajectory(run: RunData) -> Figure | None:
    """Hyperparameter-free: the learning rate chosen at each update from privatised losses."""
    lr = run.strategy.get("lr_trajectory") or run.final_run.get("lr")
    if not isinstance(lr, list) or not lr:
        return None
    lr = [float(v) for v in lr]
    steps = run.final_run.get("step")
    xs = steps if isinstance(steps, list) and len(steps) == len(lr) else list(range(1, len(lr) + 1))
    fig, ax = new_figure(7.2, 3.0)
    ax.plot(xs, lr, "-", color=BLUE, lw=1.8, drawstyle="steps-post")
    if min(lr) > 0 and max(lr) / min(lr) > 10:
        ax.set_yscale("log")
    elif min(lr) >= 0:  # from 0: a ±5 % wobble around η₀ must not fill the picture and look dramatic
        ax.set_ylim(0, 1.15 * max(lr) if max(lr) > 0 else 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate η")
    ax.set_title("Hyperparameter-free: learning rate set from privatised losses")
    return fig


@_styled
def plot_trial_scores(run: RunData) -> Figure | None:
    """Each trial's selection score, the chosen trial highlighted."""
    scored = [(t, name) for t, name in zip(run.trials, trial_labels(run.trials))
              if isinstance(t.get("score"), (int, float))]
    if not scored:
        return None
    trials = [t for t, _ in scored]
    scores = [float(t["score"]) for t in trials]
    best = max(range(len(scores)), key=scores.__getitem__)
    sources = {str(t.get("score_source")) for t in trials if t.get("score_source")}
    fig, ax = new_figure(7.2, 3.0)
    xs = list(range(1, len(scores) + 1))
    colors = [ORANGE if i == best else LIGHT_BLUE for i in range(len(scores))]
    ax.bar(xs, scores, color=colors, edgecolor="white")
    ax.set_ylim(min(scores) - 0.1 * (max(scores) - min(scores) + 1e-3) - 0.02, max(scores) + 0.03)
    ax.set_xlabel("trial")
    ax.set_ylabel("score" + (f" ({', '.join(sorted(sources))})" if sources else ""))
    ticks = xs if len(xs) <= 25 else xs[:: max(1, len(xs) // 12)]
    ax.set_xticks(ticks, [_tick(scored[x - 1][1]) for x in ticks])  # the trial names of the Trials table
    ax.annotate(f"chosen: {scores[best]:.3g}", (best + 1, scores[best]), textcoords="offset points",
                xytext=(0, 4), ha="center", color=ORANGE, fontweight="bold")
    title = "Trial scores used for selection"
    if run.not_private:
        title += f"  ({NOT_PRIVATE}: tuning not charged)"
        _stamp_not_private(fig)
    ax.set_title(title)
    return fig


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


# ===================================================================================== final run
@_styled
def plot_learning_curves(run: RunData) -> Figure | None:
    """Final run: the loss curve when it is privatised (hyperfree's charged L0), and accuracy on a public
    split, against step.  A loss computed without noise (DP-SGD's batch loss) is drawn only for a run
    loaded with ``include_non_private=True``, under a NOT PRIVATE banner inside the picture."""
    fr = run.final_run
    loss, steps = fr.get("train_loss"), fr.get("step")
    evals = [e for e in fr.get("eval", []) if isinstance(e, dict) and "accuracy" in e] if isinstance(
        fr.get("eval"), list) else []
    loss_private = is_private_loss_label(fr.get("train_loss_label"))
    has_loss = isinstance(loss, list) and len(loss) > 0 and (loss_private or run.include_non_private)
    if not has_loss and not evals:
        return None
    if not has_loss:  # accuracy on the public split only
        fig, ax2 = new_figure(7.2, 3.1)
        _accuracy_panel(run, fr, ax2, evals)
        return fig
    fig, axes = new_figure(9.6, 3.4 if not loss_private else 3.1, ncols=2)
    ax = axes[0]
    if has_loss:
        at = fr.get("train_loss_step")  # released only at some steps (hyperfree: every K steps)
        xs = (at if isinstance(at, list) and len(at) == len(loss) else
              steps if isinstance(steps, list) and len(steps) == len(loss) else list(range(1, len(loss) + 1)))
        ys = [float(v) if v is not None else math.nan for v in loss]
        ax.plot(xs, ys, color=LIGHT_BLUE, lw=1, label="per step")
        w = max(1, len(ys) // 20)
        if w > 1:
            sm = [sum(ys[max(0, i - w + 1): i + 1]) / len(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]
            ax.plot(xs, sm, color=BLUE, lw=2, label=f"moving average ({w} steps)")
        ax.legend(loc="upper right")

    label = str(fr.get("train_loss_label") or "training loss")
    label = label[:1].upper() + label[1:]
    if not loss_private:
        _badge_not_private(fig, "loss computed without noise (do not publish)")
        label = "Batch loss (no noise)"
    ax.set_title(textwrap.fill(label, 48))  # wrapped: a long title must not run off the picture
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    _accuracy_panel(run, fr, axes[1], evals)
    return fig


def _accuracy_panel(run: RunData, fr: dict, ax2: Any, evals: list) -> None:
    if evals:
        ax2.plot([e.get("step", i) for i, e in enumerate(evals)], [100 * float(e["accuracy"]) for e in evals], "-o",
                 color=GREEN, lw=2, ms=4)
        # tune evaluates the PUBLIC validation split during the final run (eval_split says so); train evaluates
        # its evaluation split, which is also the reported one
        split = fr.get("eval_split") or run.metrics.get("reported_split")
        # wrapped to the panel's width (about 45 characters at the title's size on the narrowest panel): a
        # title wider than its figure is cut at the picture's edge
        ax2.set_title("Evaluation accuracy" + ("\n" + textwrap.fill(f"({_short(str(split), 135)})", 45)
                                               if split else ""))
        ax2.set_xlabel("step")
        ax2.set_ylabel("accuracy (%)")
    else:
        ax2.set_axis_off()
        why = "no public validation split given" if fr.get("eval_note") else "no evaluation split given"
        ax2.text(0.5, 0.5, why, ha="center", va="center", color=GREY)


@_styled
def plot_accuracy_vs_reference(run: RunData) -> Figure | None:
    """The released model's accuracy next to a non-private reference (labelled NOT PRIVATE)."""
    ref = run.metrics.get("nonprivate_reference")
    acc = run.metrics.get("accuracy")
    if not isinstance(ref, dict) or not isinstance(ref.get("accuracy"), (int, float)) or not isinstance(
            acc, (int, float)):
        return None
    eps = run.epsilon
    fig, ax = new_figure(7.2, 2.4)
    labels = [f"privtune (ε = {eps:.3g})" if eps is not None else "privtune", f"non-private reference\n({NOT_PRIVATE})"]
    vals = [100 * float(acc), 100 * float(ref["accuracy"])]
    bars = ax.barh([1, 0], vals, color=[BLUE, "white"], edgecolor=[BLUE, RED], hatch=["", "///"], lw=1.5)
    bars[1].set_edgecolor(RED)
    ax.set_yticks([1, 0])
    ax.set_yticklabels(labels)
    for y, v in zip([1, 0], vals):
        ax.text(v + 0.5, y, f"{v:.1f} %", va="center", fontweight="bold", color=INK)
    ax.set_xlim(0, 108)
    ax.set_xlabel("accuracy (%)" + (f" on {run.metrics['reported_split']}" if run.metrics.get("reported_split")
                                    else ""))
    ax.grid(axis="y", visible=False)
    ax.set_title(f"Accuracy: released model vs non-private reference ({NOT_PRIVATE})")
    _stamp_not_private(fig)
    return fig


def _numeric_list(v: Any) -> list[float] | None:
    if isinstance(v, list) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return [float(x) for x in v]
    return None


@_styled
def plot_clipping(run: RunData) -> Figure | None:
    """Clipping diagnostics (computed without noise: NOT PRIVATE), whatever numeric series they hold."""
    diag = run.history.get("clipping_diagnostics")
    if not isinstance(diag, dict):
        return None
    series = {k: _numeric_list(v) for k, v in diag.items()}
    series = {k: v for k, v in series.items() if v is not None and len(v) > 1 and k != "step"}
    mappings = {k: v for k, v in diag.items() if isinstance(v, dict) and v and all(
        isinstance(x, (int, float)) for x in v.values())}
    panels = list(series.items())[:2] + list(mappings.items())[: max(0, 2 - len(series))]
    if not panels:
        return None
    fig, axes = new_figure(9.6 if len(panels) > 1 else 7.2, 3.0, ncols=len(panels))
    axes = axes if len(panels) > 1 else [axes]
    steps = _numeric_list(diag.get("step"))
    for ax, (name, val) in zip(axes, panels):
        if isinstance(val, dict):
            ax.bar([str(k) for k in val], [float(x) for x in val.values()], color=RED, alpha=0.75)
        else:
            xs = steps if steps and len(steps) == len(val) else list(range(1, len(val) + 1))
            ax.plot(xs, val, color=RED, lw=1.8)
            ax.set_xlabel("step" if steps else "index")
        ax.set_title(f"{name.replace('_', ' ')} ({NOT_PRIVATE})", color=RED)
    _stamp_not_private(fig)
    return fig
