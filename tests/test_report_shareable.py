"""The shareable report and model card as a user meets them: ε is not upper-cased into "E", no plot's text
runs off its picture, one trial numbering in every chart and table, no machine path in anything a run
releases, a model/ directory that can be shared alone, and released files with one file mode."""

from __future__ import annotations

import json
import re

import pytest

from test_report_html import make_run  # noqa: E402  (tests/ is on sys.path under pytest)

from privtune.report import plots as P
from privtune.report import write_report
from privtune.report.html import CSS
from privtune.report.run import load_run

LONG_SPLIT = "public validation split (declared public by the user; no privacy cost)"


def _zero_based_trials(run_dir):
    """Number the run's trials from 0 as `privtune tune` writes them in history.json."""
    h = json.loads((run_dir / "history.json").read_text())
    for i, t in enumerate(h["trials"]):
        t["index"] = i
    (run_dir / "history.json").write_text(json.dumps(h))


def test_labels_are_not_upper_cased_so_epsilon_stays_epsilon(tmp_path):
    # upper-casing turns ε into Ε (capital epsilon), which reads as a Latin E: "E (TOTAL)"
    assert "uppercase" not in CSS.replace(" ", "")
    html = write_report(make_run(tmp_path / "run")).read_text()
    cards = re.findall(r'<div class="k">([^<]*)</div>', html)
    assert "ε (total)" in cards and "ledger: ε left" in cards


def _texts_inside(fig) -> list[str]:
    """Every visible text of ``fig`` that reaches outside the picture (empty: none is cut)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.canvas.get_width_height()
    texts = list(fig.texts) + ([fig._suptitle] if fig._suptitle is not None else [])
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        if ax.get_legend() is not None:
            texts += ax.get_legend().get_texts()
        for axis in (ax.xaxis, ax.yaxis):  # tick labels outside the view limits are not drawn
            lo, hi = sorted(axis.get_view_interval())
            texts += [t.label1 for t in axis.get_major_ticks() if lo <= t.get_loc() <= hi]
    cut = []
    for text in texts:
        if not text.get_visible() or not str(text.get_text()).strip():
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < -1 or box.x1 > width + 1 or box.y0 < -1 or box.y1 > height + 1:
            cut.append(text.get_text())
    return cut


@pytest.mark.parametrize("strategy", ["hyperfree", "linear-scaling", "random-search"])
def test_no_plot_text_runs_off_the_picture(tmp_path, strategy):
    run_dir = make_run(tmp_path / "run", strategy)
    h = json.loads((run_dir / "history.json").read_text())
    h["final_run"]["eval_split"] = LONG_SPLIT  # as `privtune tune` labels its public accuracy curve
    h["final_run"]["train_loss_label"] = "privatised loss L0 of the final run (charged)"
    (run_dir / "history.json").write_text(json.dumps(h))
    run = load_run(run_dir)
    bp = P.budget_points(run)
    figures = {"learning curves": P.plot_learning_curves(run), "budget": P.plot_budget(run, bp),
               "trial scores": P.plot_trial_scores(run)}
    assert figures["learning curves"] is not None
    for name, fig in figures.items():
        if fig is not None:
            assert _texts_inside(fig) == [], name
    title = figures["learning curves"].axes[-1].get_title()
    assert "no privacy cost" in title.replace("\n", " ")  # wrapped, not cut


@pytest.mark.parametrize("strategy", ["linear-scaling", "random-search"])
def test_trials_have_one_numbering_in_charts_and_table(tmp_path, strategy):
    run_dir = make_run(tmp_path / "run", strategy)
    _zero_based_trials(run_dir)
    run = load_run(run_dir)
    n = len(run.trials)
    fig = P.plot_trial_scores(run)
    fig.canvas.draw()
    chart = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert chart == [str(i) for i in range(1, n + 1)]
    bp = P.budget_points(run)
    assert bp.labels[:n] == [f"trial {i}" for i in range(1, n + 1)]
    html = write_report(run_dir).read_text()
    table = html[html.index("<h3>Trials</h3>"):]
    table = table[:table.index("</table>")]
    first_cells = re.findall(r"<tr><td>([^<]*)</td>", table)
    assert [c.split()[0] for c in first_cells] == [str(i) for i in range(1, n + 1)]
