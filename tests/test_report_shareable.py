"""The shareable report and model card as a user meets them: ε is not upper-cased into "E", no plot's text
runs off its picture, one trial numbering in every chart and table, no machine path in anything a run
releases, a model/ directory that can be shared alone, and released files with one file mode."""

from __future__ import annotations

import json
import os
import re
import site
import stat
import sys

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


# ------------------------------------------------------------------------------ real (tiny-model) runs
@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A `tune` and a `train` run of the tiny test model, released into a temporary directory under the
    usual umask 022: {"root": the temporary directory, "tune": RUN_DIR, "train": RUN_DIR}."""
    import privtune
    from privtune.models.testing import make_toy_text_files
    from privtune.training import train

    root = tmp_path_factory.mktemp("released")
    files = make_toy_text_files(root / "data", {"train": ("train.tsv", 120, 0), "public": ("public.tsv", 40, 1),
                                                "dev": ("dev.tsv", 30, 2)})
    old = os.umask(0o022)
    try:
        privtune.tune(files["train"], eval_data=files["dev"], public_eval_data=files["public"], model=files["model"],
                      mode="last-layer", epsilon=2.0, delta=1e-3, ledger=f"sqlite:///{root / 'tune.db'}",
                      output_dir=root / "runs" / "tuned", quiet=True)
        train(files["train"], eval_data=files["dev"], model=files["model"], mode="bitfit", epsilon=2.0, delta=1e-3,
              steps=4, batch_size=20, learning_rate=1e-2, ledger=f"sqlite:///{root / 'train.db'}",
              output_dir=root / "runs" / "trained", progress=False, labels=[0, 1])
    finally:
        os.umask(old)
    return {"root": root, "tune": root / "runs" / "tuned", "train": root / "runs" / "trained"}


def _released_files(run_dir):
    """Every file a run releases (docs/privacy-model.md): all of RUN_DIR but the NOT PRIVATE directory."""
    return [p for p in sorted(run_dir.rglob("*")) if p.is_file() and "not_private" not in p.relative_to(run_dir).parts]


def _machine_paths(root) -> list[str]:
    paths = {str(root), os.path.realpath(root), os.path.expanduser("~"), sys.prefix}
    paths |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return sorted(p for p in paths if p and p != os.sep)


@pytest.mark.parametrize("command", ["tune", "train"])
def test_nothing_released_names_a_path_of_this_machine(released, command):
    run_dir = released[command]
    files = _released_files(run_dir)
    names = {str(p.relative_to(run_dir)) for p in files}
    assert {"report.html", "metrics.json", "certificate.json", "config.yaml", "log.txt", "model/README.md",
            "model/privtune_classifier.json", "model/certificate.json"} <= names
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        for machine in _machine_paths(released["root"]):
            assert machine not in text, (str(path.relative_to(run_dir)), machine)
        assert "site-packages" not in text, str(path.relative_to(run_dir))
    # the files still say what was used, by name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["reported_split"] == "dev.tsv"
    assert json.loads((run_dir / "model" / "privtune_classifier.json").read_text())["base_model"] == "st"
    config = (run_dir / "config.yaml").read_text()
    assert "data: train.tsv" in config and "model: st" in config
    # the paths that rerun the run are kept for the trainer, outside the release
    kept = (run_dir / "not_private" / "config.yaml").read_text()
    assert f"data: {released['root'] / 'data' / 'train.tsv'}" in kept


def test_the_bundled_backbone_is_saved_under_its_hub_name(tmp_path):
    from privtune.models.classifier import BUNDLED_MODEL_NAME, default_model_path, public_model_name

    try:
        bundled = default_model_path()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the bundled backbone package is not installed ({exc})")
    assert public_model_name(bundled) == BUNDLED_MODEL_NAME == "sentence-transformers/all-MiniLM-L6-v2"
    assert public_model_name("prajjwal1/bert-tiny") == "prajjwal1/bert-tiny"  # a hub name stays a name
    (tmp_path / "my-model").mkdir()
    assert public_model_name(tmp_path / "my-model") == "my-model"


def test_model_directory_can_be_shared_alone(released, tmp_path):
    import shutil

    from privtune.accounting import verify_certificate

    alone = tmp_path / "uploaded"
    shutil.copytree(released["tune"] / "model", alone)
    card = (alone / "README.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", card)
    assert "certificate.json" in links
    for link in links:  # every link of the card resolves inside the model directory itself
        if "://" not in link:
            assert (alone / link).resolve().is_relative_to(alone.resolve()) and (alone / link).is_file(), link
    assert "../" not in card
    assert "privtune account --certificate certificate.json" in card
    cert = json.loads((released["tune"] / "certificate.json").read_text())
    assert verify_certificate(alone / "certificate.json").epsilon == pytest.approx(cert["epsilon"])


@pytest.mark.parametrize("command", ["tune", "train"])
def test_released_files_share_one_mode_and_not_private_stays_private(released, command):
    run_dir = released[command]
    modes = {str(p.relative_to(run_dir)): stat.S_IMODE(p.stat().st_mode) for p in _released_files(run_dir)}
    assert modes["model/model.safetensors"] == 0o644  # written 0600 by safetensors through a temporary file
    assert set(modes.values()) == {0o644}, modes
    dirs = [run_dir, *(p for p in run_dir.rglob("*") if p.is_dir() and "not_private" not in p.parts)]
    assert {stat.S_IMODE(d.stat().st_mode) for d in dirs} == {0o755}
    np_dir = run_dir / "not_private"
    if np_dir.exists():
        assert stat.S_IMODE(np_dir.stat().st_mode) == 0o700
        assert {stat.S_IMODE(p.stat().st_mode) for p in np_dir.iterdir()} == {0o600}


def test_saved_model_files_follow_the_umask(tmp_path):
    from privtune.models.testing import make_toy_text_files
    from privtune.models.classifier import Classifier, load_classifier

    files = make_toy_text_files(tmp_path / "data", {"train": ("train.tsv", 8, 0)})
    clf = load_classifier(files["model"], num_labels=2)
    for umask, want in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(umask)
        try:
            out = clf.save_pretrained(tmp_path / f"saved-{umask:o}")
        finally:
            os.umask(old)
        got = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
        assert set(got.values()) == {want}, got
    assert isinstance(Classifier.from_pretrained(out), Classifier)


def test_report_names_papers_by_authors_not_by_internal_numbers(tmp_path):
    for strategy in ("linear-scaling", "hyperfree"):
        html = write_report(make_run(tmp_path / strategy, strategy)).read_text()
        assert not re.search(r"seed \d{3}", html), strategy
    from privtune.report.html import STRATEGY_TEXT

    assert "Panda, Tang et al." in STRATEGY_TEXT["linear-scaling"] and "Liu & Bu" in STRATEGY_TEXT["hyperfree"]


def test_model_card_names_the_base_model_the_saved_model_names(tmp_path):
    from privtune.report import write_model_card

    run_dir = make_run(tmp_path / "run")
    # a released config names the bundled backbone's directory only ("model"); the saved model knows its name
    (run_dir / "config.yaml").write_text("model: model\nepsilon: 1.0\n")
    (run_dir / "model" / "privtune_classifier.json").write_text(
        json.dumps({"base_model": "sentence-transformers/all-MiniLM-L6-v2", "num_labels": 2}))
    card = write_model_card(run_dir).read_text()
    assert "base_model: sentence-transformers/all-MiniLM-L6-v2" in card
    assert "of `model`" not in card


def test_public_paths_names_files_and_leaves_other_text_alone(tmp_path):
    from privtune.report.release import PublicPaths

    run_dir = tmp_path / "runs" / "mine"
    data = tmp_path / "data" / "my file.csv"
    public = PublicPaths(run_dir, [str(data), f"sqlite:///{tmp_path / 'l.db'}"])
    home = os.path.expanduser("~")
    cases = {
        f"data={data} (n=120)": "data=my file.csv (n=120)",  # a known path, spaces and all
        f"sqlite:///{tmp_path / 'l.db'}": "sqlite:///l.db",
        f"done → {run_dir}": "done → mine",
        f"{run_dir / 'certificate.json'}": "certificate.json",  # inside RUN_DIR: relative to it
        f"wrote {run_dir / 'model' / 'README.md'}": "wrote model/README.md",
        f"sqlite:///{home}/.privtune/ledger.db": "sqlite:///~/.privtune/ledger.db",
        f"{sys.prefix}/lib/site-packages/pkg/model": "model",
        "add/remove one example; q = B/n; https://huggingface.co/x; see /etc/hosts": None,  # unchanged
    }
    for text, want in cases.items():
        assert public.text(text) == (text if want is None else want), text
    assert public.value({"split": str(data), "n": 3, "xs": [str(run_dir), None]}) == {
        "split": "my file.csv", "n": 3, "xs": ["mine", None]}


def test_a_small_learning_rate_wobble_is_drawn_from_zero(tmp_path):
    run_dir = make_run(tmp_path / "run", "hyperfree")
    h = json.loads((run_dir / "history.json").read_text())
    h["strategy"]["lr_trajectory"] = [0.1] * 20 + [0.095] * 20 + [0.09] * 20 + [0.098] * 11  # η₀ = 0.1, ±5 %
    (run_dir / "history.json").write_text(json.dumps(h))
    fig = P.plot_lr_trajectory(load_run(run_dir))
    low, high = fig.axes[0].get_ylim()
    assert low == 0 and 0.1 < high < 0.2
