"""``RUN_DIR/report.html``: one self-contained page (images inlined, no network) plus PNGs.

Built from ``certificate.json``, ``metrics.json``, ``history.json`` and ``config.yaml``
(:mod:`privtune.report.run`); plots from :mod:`privtune.report.plots`.  A section whose
data is missing is left out; a section whose data cannot be drawn is replaced by a
visible note, never silently dropped.

The default report is shareable: it shows only privatised or public quantities (and the grid
oracle's tuning, labelled NOT PRIVATE).  ``include_non_private=True`` (``privtune report
--include-non-private``) also draws what was computed from private data without noise (the batch
loss of DP-SGD, clipping diagnostics, a non-private reference), each badged NOT PRIVATE inside its
picture, and writes that report to ``RUN_DIR/not_private/``, outside the release.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import os
from pathlib import Path
from typing import Any, Callable

from privtune.accounting.certificate import NEIGHBOURING, privacy_statement, privacy_unit_of
from privtune.accounting.events import describe_event
from privtune.audit.result import AuditResult
from privtune.errors import PrivtuneError
from privtune.report import plots as P
from privtune.report.model_card import is_image_run
from privtune.report.release import NOT_PRIVATE_DIR, PublicPaths, load_not_private, seeded_notice
from privtune.report.run import RunData, load_events, load_run

PNG_NAMES = ("budget.png", "strategy.png", "trials.png", "learning_curves.png", "accuracy_vs_reference.png",
             "clipping.png")

STRATEGY_TEXT = {
    "linear-scaling": "Linear scaling (Panda, Tang et al., a linear scaling rule for private HPO): cheap low-ε "
                      "trials find the best total step size r = η·T at each trial budget; a line r(ε) is fitted and "
                      "extrapolated to the final run's ε.",
    "hyperfree": "Hyperparameter-free DP (Liu & Bu, HyFreeDP): a learning rate set at each update from privatised "
                 "losses, whose cost is accounted jointly with the gradient releases, and a clipping with no "
                 "threshold to tune.",
    "single-step": "Single step (Mehta et al., large-scale transfer): a zero-initialised head trained with one "
                   "full-batch DP step on cached features of a public backbone.",
    "random-search": "Random search: trials with random hyperparameters, the best one selected; the selection is "
                     "charged (repeat-and-select or plain composition of all trials, whichever is tighter).",
    "grid-oracle": "Grid oracle: a grid search whose tuning is NOT charged. It is NOT PRIVATE and exists only as the "
                   "reference an honest strategy is compared against.",
}

CSS = """
:root { --ink:#212529; --muted:#6c757d; --line:#e9ecef; --blue:#3451b2; --red:#c92a2a; --bg:#f5f6f8; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
       font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1060px; margin: 0 auto; padding: 28px 22px 60px; }
header h1 { font-size: 26px; margin: 0 0 2px; letter-spacing: -0.01em; }
header .sub { color: var(--muted); font-size: 13.5px; }
h2 { font-size: 18px; margin: 0 0 10px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
section { background:#fff; border:1px solid var(--line); border-radius:10px; padding:18px 22px; margin:16px 0; }
.cards { display:grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap:12px; margin:18px 0 4px; }
.card { background:#fff; border:1px solid var(--line); border-radius:10px; padding:12px 14px; }
/* no text-transform on labels: upper-casing turns ε into Ε, which reads as a Latin E */
.card .k { color:var(--muted); font-size:12.5px; font-weight:600; letter-spacing:.01em; }
.card .v { font-size:22px; font-weight:650; margin-top:2px; }
.card .d { color:var(--muted); font-size:12.5px; }
img.plot { display:block; max-width:100%; height:auto; margin:8px auto 4px; }
table { border-collapse: collapse; width:100%; font-size:13.5px; margin:6px 0 10px; }
th, td { text-align:left; padding:5px 8px; border-bottom:1px solid var(--line); vertical-align:top; }
th { color:var(--muted); font-weight:600; width:32%; }
table.grid th { width:auto; }
td.num, th.num { text-align:right; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size:12.5px; }
pre { background:#f8f9fa; border:1px solid var(--line); border-radius:8px; padding:10px 12px; overflow:auto; }
.badge { display:inline-block; font-size:11.5px; font-weight:700; padding:1px 7px; border-radius:999px;
         letter-spacing:.03em; vertical-align:middle; }
.np { color:#fff; background:var(--red); }
.ok { color:#fff; background:#2b8a3e; }
.warn { border-left:4px solid #f08c00; background:#fff9db; padding:8px 12px; border-radius:6px; margin:8px 0; }
.bad { border-left:4px solid var(--red); background:#fff5f5; padding:8px 12px; border-radius:6px; margin:8px 0; }
.note { color:var(--muted); font-size:13px; }
section.np-section { border-color:#ffc9c9; }
ul { margin:4px 0 8px; padding-left:20px; }
a { color: var(--blue); }
footer { color:var(--muted); font-size:12px; text-align:center; margin-top:26px; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    return str(v)


def _kv_table(rows: list[tuple[str, Any]], raw_html: bool = False) -> str:
    body = "".join(
        f"<tr><th>{_e(k)}</th><td>{v if raw_html else _e(_fmt(v))}</td></tr>" for k, v in rows if v is not None
    )
    return f"<table>{body}</table>" if body else ""


def _np_badge() -> str:
    return '<span class="badge np">NOT PRIVATE</span>'


class _Builder:
    def __init__(self, run: RunData) -> None:
        self.run = run
        self.images: dict[str, bytes] = {}
        self.notes: list[str] = list(run.problems)

    def figure(self, name: str, make: Callable[[], Any], alt: str) -> str:
        """Draw a figure (or note why it could not be drawn) and return its <img> tag."""
        try:
            fig = make()
        except Exception as exc:  # a plot must never take the whole report down; the failure is shown
            self.notes.append(f"The plot {name} could not be drawn: {type(exc).__name__}: {exc}")
            return f'<p class="bad">Plot {_e(name)} could not be drawn: {_e(type(exc).__name__)}: {_e(exc)}</p>'
        if fig is None:
            return ""
        png = P.figure_png(fig)
        self.images[name] = png
        b64 = base64.b64encode(png).decode("ascii")
        return f'<img class="plot" alt="{_e(alt)}" src="data:image/png;base64,{b64}">'


# ======================================================================================= sections
def _summary_cards(run: RunData, b: Any) -> str:
    m = run.metrics
    cards = []
    acc = m.get("accuracy")
    if isinstance(acc, (int, float)):
        split = str(m.get("reported_split") or "reported split")
        cards.append(("accuracy", f"{100 * acc:.1f} %", os.path.basename(split.rstrip("/")) or split))
    for key, label in (("bleu", "BLEU"), ("rouge_l", "ROUGE-L"), ("perplexity", "perplexity")):
        if isinstance(m.get(key), (int, float)):
            split = str(m.get("reported_split") or "reported split")
            cards.append((label, f"{m[key]:.2f}", os.path.basename(split.rstrip("/")) or split))
    if run.guarantee_epsilon is not None:
        cards.append(("ε (total)", f"{run.guarantee_epsilon:.4g}", "tuning included" if run.trials else "the whole run"))
    if run.delta is not None:
        cards.append(("δ", f"{run.delta:.0e}", "add/remove one example"))
    if run.strategy_name:
        cards.append(("strategy", run.strategy_name, "tuning NOT charged" if run.not_private else "tuning charged"))
    if m.get("mode"):
        cards.append(("mode", m["mode"], "what was trained"))
    rem = m.get("ledger_remaining_epsilon")
    if isinstance(rem, (int, float)):
        cards.append(("ledger: ε left", f"{rem:.3g}", "of this dataset's lifetime budget"))
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div><div class="d">{_e(d)}</div>'
        f"</div>" for k, v, d in cards) + "</div>"


def _budget_section(run: RunData, b: _Builder, bp: P.BudgetPoints | None) -> str:
    cert, m = run.certificate, run.metrics
    out = ["<section id='budget'><h2>Privacy budget</h2>"]
    if run.epsilon is not None and run.delta is not None:
        what = "tuning and the final run together" if run.trials else "the whole run"
        if run.seeded:  # the seed reproduces the noise: the accounted (ε, δ) is not a property of this run
            out.append(
                f"<p class='bad'>{_np_badge()} <b>NOT PRIVATE: seeded.</b> The certificate's events account to "
                f"(ε = {run.epsilon:.4g}, δ = {run.delta:.1e}) for {_e(what)}, but the explicit seed reproduces "
                "all of the run's noise, so that guarantee does <b>not</b> hold for this run.</p>"
            )
        else:
            union = run.union_bound_words()  # --mode auto: the guarantee comes from the plans, not the events alone
            out.append(
                f"<p>This run is <b>(ε = {run.guarantee_epsilon:.4g}, δ = {run.delta:.1e})-differentially private</b> "
                f"for {_e(what)}, with respect to adding or removing {_e(_protected(cert))}"
                + (f". {_e(union)} Composed by the <b>{_e(run.accountant.upper())}</b> accountant.</p>" if union else
                   f", as composed by the <b>{_e(run.accountant.upper())}</b> accountant over every event listed in "
                   "the certificate.</p>")
            )
    if run.not_private:
        out.append(f"<p class='bad'>{_np_badge()} The grid oracle's tuning is not charged: the ε above covers the "
                   "final run only, so this model has <b>no</b> end-to-end guarantee. Use it as a reference, "
                   "never as a release.</p>")
    out.append(b.figure("budget.png", lambda: P.plot_budget(run, bp), "ε spent after each trial and the final run"))
    if bp is not None and bp.cumulative:
        if bp.kind == "trials":
            out.append(
                "<p class='note'>Composition is not additive: each point is the ε of <i>all</i> events up to that "
                "trial, recomputed by the accountant, which is why it lies below the naive running sum.</p>")
        rows = []
        for lab, cum, ind in zip(bp.labels, bp.cumulative, bp.individual):
            rows.append(f"<tr><td>{_e(lab)}</td><td class='num'>{cum:.4g}</td>"
                        f"<td class='num'>{'' if ind is None else f'{ind:.4g}'}</td></tr>")
        if len(rows) > 12:
            rows = rows[:6] + ["<tr><td colspan='3' class='note'>…</td></tr>"] + rows[-5:]
        head = "<tr><th>after</th><th class='num'>ε so far (composed)</th><th class='num'>ε of this part alone</th></tr>"
        out.append(f"<table class='grid'>{head}{''.join(rows)}</table>")
        for n in bp.notes:
            out.append(f"<p class='warn'>{_e(n)}</p>")
    rows = [
        ("budget asked for (ε)", bp.target_epsilon if bp else None),
        ("ε of the tuning trials (composed)", bp.tuning_epsilon if bp and bp.kind == "trials" else None),
        ("ε of everything (certificate)", run.epsilon),
        ("δ", run.delta),
        ("accountant", run.accountant),
        ("neighbouring relation", cert.get("neighbouring", "add/remove one example")),
    ]
    out.append(_kv_table(rows))
    assumptions = cert.get("sampling_assumptions")
    if isinstance(assumptions, list) and assumptions:
        lis = "".join(f"<li>{_e(a)}</li>" for a in assumptions)
        if len(assumptions) > 6:
            lis = (f"<details><summary>{len(assumptions)} assumptions, one per event (show)</summary>"
                   f"<ul>{lis}</ul></details>")
            out.append("<h3>Sampling assumptions</h3>" + lis)
        else:
            out.append("<h3>Sampling assumptions</h3><ul>" + lis + "</ul>")
    ledger_rows = [("ledger dataset id", m.get("dataset_id")), ("ledger", m.get("ledger_url")),
                   ("ε remaining for this dataset", m.get("ledger_remaining_epsilon"))]
    if run.not_private:
        out.append("<h3>Ledger</h3><p class='note'>NOT PRIVATE reference: nothing was charged to the ledger and no "
                   "model was released. Its uses of the data are not covered by any privacy guarantee.</p>")
    elif any(v is not None for _, v in ledger_rows):
        out.append("<h3>Ledger</h3>" + _kv_table(ledger_rows))
        out.append("<p class='note'>Check it any time with <code>privtune budget show</code> (and "
                   "<code>privtune budget history --dataset …</code>). Every later run on the same data is charged to "
                   "the same budget.</p>")
    out.append("</section>")
    return "".join(out)


def _strategy_section(run: RunData, b: _Builder, bp: P.BudgetPoints | None) -> str:
    name = run.strategy_name
    hp = run.metrics.get("hyperparameters")
    if not name and not run.trials and not isinstance(hp, dict):
        return ""
    cls = " class='np-section'" if run.not_private else ""
    out = [f"<section id='strategy'{cls}><h2>Hyperparameters{': ' + _e(name) if name else ''}"
           f"{' ' + _np_badge() if run.not_private else ''}</h2>"]
    if name in STRATEGY_TEXT:
        text = STRATEGY_TEXT[name]
        clipping = (run.metrics.get("hyperparameters") or {}).get("clipping")
        if name == "hyperfree" and clipping:  # the style actually used (AUTO-S on features, flat C = 1 on a model)
            text += (" Clipping here: " + ("automatic (AUTO-S, per-example normalisation)." if clipping == "automatic"
                                          else f"{clipping} at C = 1 (sensitivity 1)."))
        out.append(f"<p>{_e(text)}</p>")
    sel = run.metrics.get("selection") or run.metadata.get("selection")
    if sel:
        m = run.metrics
        scored = m.get("accuracy") is not None or m.get("perplexity") is not None  # a reported split was scored
        out.append(f"<p><b>Trial selection:</b> {_e(sel)}." + (
            " The split used for the reported scores was never used to select." if scored else "") + "</p>")
    if name == "linear-scaling":
        out.append(b.figure("strategy.png", lambda: P.plot_linear_scaling(run, bp), "r against ε with fitted line"))
    elif name == "hyperfree":
        out.append(b.figure("strategy.png", lambda: P.plot_lr_trajectory(run), "learning-rate trajectory"))
    if name != "linear-scaling" or not any("score" in t for t in run.trials):
        out.append(b.figure("trials.png", lambda: P.plot_trial_scores(run), "trial scores"))
    snotes = run.strategy.get("notes")
    if isinstance(snotes, list) and snotes:
        out.append("<ul>" + "".join(f"<li class='note'>{_e(n)}</li>" for n in snotes) + "</ul>")
    if isinstance(hp, dict) and hp:
        out.append("<h3>Chosen for the final run</h3>" + _kv_table(list(hp.items())))
    if run.trials:
        keys: list[str] = []
        for t in run.trials:
            for k in (t.get("hyperparameters") or {}):
                if k not in keys:
                    keys.append(k)
        keys = keys[:6]
        head = "<tr><th>trial</th>" + "".join(f"<th class='num'>{_e(k)}</th>" for k in keys) + \
               "<th class='num'>score</th><th>score from</th></tr>"
        rows = []
        for t, name in zip(run.trials, P.trial_labels(run.trials)):  # the names the charts use
            h = t.get("hyperparameters") or {}
            phase = t.get("phase") if t.get("phase") and "pilot" not in str(t.get("phase")) else None
            rows.append(f"<tr><td>{_e(name.removeprefix('trial '))}{' (' + _e(phase) + ')' if phase else ''}</td>"
                        + "".join(f"<td class='num'>{_e(_fmt(h.get(k, '')))}</td>" for k in keys)
                        + f"<td class='num'>{_e(_fmt(t.get('score', '')))}</td>"
                        f"<td>{_e(t.get('score_source', ''))}</td></tr>")
        if len(rows) > 20:
            rows = rows[:10] + ["<tr><td class='note' colspan='99'>…</td></tr>"] + rows[-8:]
        out.append(f"<h3>Trials</h3><table class='grid'>{head}{''.join(rows)}</table>")
    out.append("</section>")
    return "".join(out)


def _final_section(run: RunData, b: _Builder) -> str:
    curves = b.figure("learning_curves.png", lambda: P.plot_learning_curves(run), "learning curves of the final run")
    ref = b.figure("accuracy_vs_reference.png", lambda: P.plot_accuracy_vs_reference(run),
                   "accuracy against the non-private reference (NOT PRIVATE)")
    acc = run.metrics.get("accuracy")
    if not curves and not ref and not isinstance(acc, (int, float)):
        return ""
    out = ["<section id='final'><h2>Final run</h2>"]
    if isinstance(acc, (int, float)):
        split = run.metrics.get("reported_split", "the reported split")
        out.append(f"<p>Accuracy of the released model on <b>{_e(split)}</b>: <b>{100 * acc:.2f} %</b>.</p>")
    out.append(curves)
    fr = run.final_run
    if curves and fr.get("eval_split"):
        loss = fr.get("train_loss_label")
        out.append(f"<p class='note'>Learning curves of the final run. Accuracy is measured on the "
                   f"<b>{_e(fr['eval_split'])}</b> at a few points, never on the reported split, at no privacy cost"
                   + (f"; the loss curve is the {_e(loss)}" if loss else "") + ".</p>")
    elif fr.get("eval_note"):
        out.append(f"<p class='note'>{_e(str(fr['eval_note'])[:1].upper() + str(fr['eval_note'])[1:])}.</p>")
    if fr.get("train_loss_note") and not run.include_non_private:
        out.append("<p class='note'>The per-step batch loss of DP-SGD is computed without noise, so this shareable "
                   "report does not show it.</p>")
    if ref:
        out.append(f"<h3>Against a non-private reference {_np_badge()}</h3>")
        out.append("<p class='note'>The reference is trained on the same private data <b>without</b> differential "
                   "privacy, only to show what privacy costs in accuracy. It is NOT PRIVATE, is not covered by the "
                   "certificate, and is never released or used to pick the model.</p>")
        out.append(ref)
    out.append("</section>")
    return "".join(out)


def _generation_section(run: RunData) -> str:
    """A generator's scores on the reported split and a few of its generations for PUBLIC prompts
    (``metrics["public_generations"]``: prompts of a split declared public; private prompts never appear here)."""
    m = run.metrics
    if m.get("task") != "text-generation":
        return ""
    out = ["<section id='generation'><h2>Generation</h2>"]
    rows = [(label, f"{m[k]:.2f}") for k, label in (("bleu", "BLEU"), ("chrf", "chrF"), ("rouge_l", "ROUGE-L"),
                                                    ("perplexity", "perplexity per response token"))
            if isinstance(m.get(k), (int, float))]
    if rows:
        split = m.get("reported_split", "the reported split")
        out.append(f"<p>Scores of the released model on <b>{_e(split)}</b> (greedy decoding; BLEU, chrF and ROUGE-L "
                   f"on its first {_e(m.get('scored_rows'))} rows, perplexity on all of them):</p>")
        out.append(_kv_table(rows))
    else:
        out.append("<p class='note'>No evaluation split was given (<code>--eval-data</code>), so the released model "
                   "was not scored.</p>")
    gens = m.get("public_generations")
    if isinstance(gens, dict) and gens.get("samples"):
        out.append(f"<h3>Generations for public prompts</h3><p class='note'>Prompts from <b>{_e(gens.get('split'))}"
                   "</b>, a split declared public; prompts of the private training data are never shown.</p>")
        out.append("<table><tr><th>prompt</th><th>generated</th><th>reference</th></tr>" + "".join(
            f"<tr><td>{_e(g.get('prompt'))}</td><td>{_e(g.get('generated'))}</td><td>{_e(g.get('reference'))}</td></tr>"
            for g in gens["samples"] if isinstance(g, dict)) + "</table>")
    out.append("</section>")
    return "".join(out)


#: where ``privtune audit --output RUN_DIR/audit`` leaves its results; the report shows them when present
AUDIT_DIR = "audit"


def _audit_section(run: RunData, b: _Builder) -> str:
    """The "Audit" section: each audit found under RUN_DIR/audit/{whitebox,blackbox}/audit.json."""
    found = []
    for kind in ("whitebox", "blackbox"):
        f = run.run_dir / AUDIT_DIR / kind / "audit.json"
        if not f.is_file():
            continue
        try:
            found.append((kind, AuditResult.from_dict(json.loads(f.read_text(encoding="utf-8")))))
        except (OSError, ValueError, TypeError) as exc:
            b.notes.append(f"{f.relative_to(run.run_dir)} could not be read: {type(exc).__name__}: {exc}")
    if not found:
        return ""
    out = ["<section id='audit'><h2>Audit</h2>",
           "<p class='note'>One-run privacy audit (Steinke, Nasr &amp; Jagielski 2023) written by "
           "<code>privtune audit --output RUN_DIR/audit</code>. A lower bound is evidence, not proof: a bound "
           "above the claimed ε shows a bug; a bound below it does not show that the claim is right.</p>"]
    for kind, res in found:
        out.append(f"<h3>{_e(res.kind)}</h3>")
        out.append(_kv_table([("claimed ε", f"{res.claimed_epsilon:.4g} (δ = {res.delta:.3g})"),
                              (f"empirical lower bound ({res.confidence:.0%})", f"{res.epsilon_lower_bound:.4g}"),
                              ("canaries m", res.num_canaries), ("guesses r", res.num_guesses),
                              ("correct guesses v", res.correct_guesses), ("verdict", res.verdict),
                              ("privacy of the audit", res.privacy)]))
        out.append(b.figure(f"audit_{kind}.png", res.figure,
                            f"{res.kind} audit: scores of included and excluded canaries"))
    out.append("</section>")
    return "".join(out)


def _clipping_section(run: RunData, b: _Builder) -> str:
    diag = run.history.get("clipping_diagnostics")
    if not isinstance(diag, dict):
        return ""
    out = [f"<section id='clipping' class='np-section'><h2>Clipping diagnostics {_np_badge()}</h2>",
           "<p class='note'>Computed from private per-example gradient norms <b>without noise</b>: NOT PRIVATE. They "
           "are for the person training the model, are not covered by the certificate, and must not be "
           "published.</p>"]
    out.append(b.figure("clipping.png", lambda: P.plot_clipping(run), "clipping diagnostics (NOT PRIVATE)"))
    scalars = [(k, v) for k, v in diag.items() if isinstance(v, (int, float, str)) and k != "label"]
    if scalars:
        out.append(_kv_table(scalars))
    out.append("</section>")
    return "".join(out)


def _verify(run: RunData) -> tuple[str, str]:
    """(status, message): status one of ok, failed, unavailable."""
    path = run.run_dir / "certificate.json"
    if not path.is_file():
        return "failed", "no certificate.json in this run"
    try:
        # Lazy: inside try: the report still renders if the accounting stack cannot load.
        import privtune.accounting as acct

        verify = acct.verify_certificate
    except (ImportError, AttributeError):
        return "unavailable", "privtune.accounting.verify_certificate is not available in this installation"

    try:
        cert = verify(path)
    except PrivtuneError as exc:
        return "failed", str(exc)
    eps = getattr(cert, "epsilon", None)
    return "ok", (f"ε recomputed from the listed events: {eps:.4g}" if isinstance(eps, (int, float))
                  else "ε recomputed from the listed events matches")


def _certificate_section(run: RunData) -> str:
    cert = run.certificate
    if not cert:
        return ""

    status, msg = _verify(run)
    badge = {"ok": "<span class='badge ok'>VERIFIED</span>",
             "failed": "<span class='badge np'>VERIFICATION FAILED</span>"}.get(status, "")
    out = [f"<section id='certificate'><h2>Certificate {badge}</h2>"]
    out.append(f"<p class='{'note' if status == 'ok' else 'bad'}'>{_e(msg)}</p>")
    out.append("<p>Re-verify it yourself in the run directory (recomputes ε from the events; exits with an error "
               "on a mismatch):</p>")
    out.append("<pre>privtune account --certificate certificate.json</pre>")
    md = run.metadata
    rows = [("ε", cert.get("epsilon")), ("δ", cert.get("delta")), ("accountant", cert.get("accountant")),
            ("neighbouring relation", cert.get("neighbouring")),
            ("number of events", len(cert["events"]) if isinstance(cert.get("events"), list) else None)]
    rows += [(str(k), v) for k, v in md.items() if isinstance(v, (str, int, float, bool))]
    out.append(_kv_table(rows))
    try:
        events = load_events(cert.get("events"))
        items = [describe_event(e) for e in events]
    except Exception as exc:  # malformed events are shown, not hidden
        items = [f"could not read the events: {exc}"]
    if items:
        shown = items if len(items) <= 15 else items[:8] + [f"… {len(items) - 13} more …"] + items[-5:]
        out.append("<h3>Events</h3><ul>" + "".join(f"<li><code>{_e(s)}</code></li>" for s in shown) + "</ul>")
    notes = cert.get("notes") or md.get("notes")
    if isinstance(notes, list) and notes:
        out.append("<h3>Notes</h3><ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    versions = cert.get("versions")
    if isinstance(versions, dict) and versions:
        out.append("<p class='note'>Versions: " + _e(", ".join(f"{k} {v}" for k, v in versions.items())) + "</p>")
    out.append("</section>")
    return "".join(out)


def _files_section(run: RunData) -> str:
    rd = run.run_dir
    items = []
    model_words = ("the image model (privtune's save_pretrained: backbone weights, head, image preprocessing)"
                   if is_image_run(run) else "the model (Hugging Face save_pretrained)")
    for rel, what in (("model/", model_words), ("model/README.md", "model card"),
                      ("certificate.json", "privacy certificate"), ("metrics.json", "metrics"),
                      ("history.json", "trial and training history"), ("config.yaml", "effective configuration"),
                      ("log.txt", "log")):
        if (rd / rel.rstrip("/")).exists():
            items.append(f"<li><a href='{_e(rel)}'>{_e(rel)}</a> — {_e(what)}</li>")
    cfg = ""
    if (rd / "config.yaml").is_file():  # as the run released it: its paths are names (older runs: made so here)
        public = PublicPaths(rd, [v for v in run.config.values() if isinstance(v, str)])
        text = "".join(public.text(line) for line in
                       (rd / "config.yaml").read_text(encoding="utf-8").splitlines(keepends=True))
        cfg = "<h3>Configuration</h3><pre>" + _e(text) + "</pre>"
    if (rd / "not_private").is_dir():
        kept = ["the configuration with the paths of your machine (rerun with <code>--config "
                "not_private/config.yaml</code>)"] if (rd / "not_private" / "config.yaml").is_file() else []
        if load_not_private(rd):
            kept.append("figures computed without noise (<code>privtune report --include-non-private</code> draws "
                        "them)")
        items.append(f"<li><code>not_private/</code> — for you only, not part of the release: {'; '.join(kept)}"
                     "</li>" if kept else "<li><code>not_private/</code> — for you only, not part of the release</li>")
    if not items and not cfg:
        return ""
    return f"<section id='files'><h2>Files</h2><ul>{''.join(items)}</ul>{cfg}</section>"


# ======================================================================================= entry
def render_report(run: RunData) -> tuple[str, dict[str, bytes]]:
    """Build the HTML text and the PNG images (name -> bytes) of a run.

    The page is meant to be shared: it names the run directory, the data and the model by their names,
    never by a path of the machine that ran it (:meth:`RunData.public`)."""
    run = run.public()
    b = _Builder(run)
    try:
        bp = P.budget_points(run)
    except Exception as exc:  # shown in the report
        bp = None
        b.notes.append(f"The privacy budget curve could not be computed: {type(exc).__name__}: {exc}")
    sections = [
        _budget_section(run, b, bp),
        _strategy_section(run, b, bp),
        _final_section(run, b),
        _generation_section(run),
        _clipping_section(run, b),
        _audit_section(run, b),
        _certificate_section(run),
        _files_section(run),
    ]
    title = "privtune run report"
    kind = "tuning + training run" if run.trials else "training run"
    # no time under repeat-and-select or at the unit level: the report is made when the run ends, and with the
    # start in the run directory's default name that gives the run's duration, which grows with its secret
    # number of trials, or with its number of rows (private at the unit level)
    hide_time = (run.strategy.get("accounting") == "repeat-and-select"
                 or privacy_unit_of(run.certificate.get("neighbouring", "")) is not None)
    when = "" if hide_time else " · generated " + _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    problems = ""
    if b.notes:
        problems = "<div class='warn'><b>Parts of this report are missing:</b><ul>" + "".join(
            f"<li>{_e(n)}</li>" for n in b.notes) + "</ul></div>"
    np_banner = ""
    if run.include_non_private:
        np_banner += (f"<div class='bad'>{_np_badge()} <b>This report includes figures computed from the private "
                      "data without noise.</b> It is for you only: do not publish it (the shareable report is "
                      "RUN_DIR/report.html).</div>")
    if run.seeded:
        np_banner += f"<div class='bad'>{_np_badge()} <b>{_e(seeded_notice(True))}</b></div>"
    if run.not_private:
        np_banner = (f"<div class='bad'>{_np_badge()} <b>This run's hyperparameter tuning was not charged "
                     "(grid oracle).</b> It is a reference, not a private release.</div>")
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}: {_e(run.run_dir.name)}</title>
<style>{CSS}</style></head>
<body><main>
<header><h1>{_e(title)}</h1>
<div class="sub">{_e(kind)} · <code>{_e(run.run_dir.name)}</code> {_e(when)}</div></header>
{np_banner}{problems}
{_summary_cards(run, b)}
{''.join(s for s in sections if s)}
<footer>Generated by privtune. This page is self-contained: images are inlined, nothing is loaded from the
network. Regenerate it with <code>privtune report {_e(run.run_dir.name)}</code>.</footer>
</main></body></html>
"""
    return doc, b.images


def write_report(run_dir: str | os.PathLike, *, include_non_private: bool = False) -> Path:
    """Write ``RUN_DIR/report.html`` (self-contained) and one PNG per plot; return the HTML path.

    The report shows only privatised or public quantities.  ``include_non_private=True`` also draws
    the NOT PRIVATE figures of ``RUN_DIR/not_private/`` (badged in each picture) and writes the
    report and its PNGs to ``RUN_DIR/not_private/`` instead, which is not part of the release.

    Reads ``certificate.json``, ``metrics.json``, ``history.json`` and ``config.yaml``
    from ``run_dir`` (any of them may be missing; what is missing is stated in the
    report).  "ε after trial k" is recomputed with
    :func:`privtune.accounting.compute_epsilon` over the cumulative events.

    Raises:
        InvalidParameterError: ``run_dir`` is not a run directory.
    """
    run = load_run(run_dir, include_non_private=include_non_private)
    doc, images = render_report(run)
    rd = Path(run_dir)
    if include_non_private:
        rd = rd / NOT_PRIVATE_DIR
        rd.mkdir(mode=0o700, exist_ok=True)
        os.chmod(rd, 0o700)
    for name in PNG_NAMES:  # no stale plot from an earlier report
        (rd / name).unlink(missing_ok=True)
    for name, png in images.items():
        (rd / name).write_bytes(png)
    out = rd / "report.html"
    out.write_text(doc, encoding="utf-8")
    if include_non_private:  # NOT PRIVATE figures: 0600 like the rest of not_private/, whatever the umask
        for path in [out, *(rd / name for name in images)]:
            os.chmod(path, 0o600)
    return out


def _protected(certificate: Any) -> str:
    """What the certificate protects, in words: "one training example" or "all rows of one <unit>"."""
    neigh = certificate.get("neighbouring") if isinstance(certificate, dict) else None
    return privacy_statement(neigh if isinstance(neigh, str) else NEIGHBOURING).split("adding or removing ", 1)[1]

