"""What a run releases (issue 13 items 3, 6, 7; issue 18 item 6): nothing per-trial under repeat-and-select,
seeded runs labelled NOT PRIVATE, no exact example count, no noise-free loss in the shareable files."""

from __future__ import annotations

import json
import re
import stat

import pytest

import privtune
from privtune.hpo import random_search as rs
from privtune.models.testing import make_toy_text_files
from privtune.training import train


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("releases"), {
        "train": ("train.tsv", 120, 0), "public": ("public.tsv", 40, 1), "dev": ("dev.tsv", 30, 2)})


def _tune(files, tmp_path, **kw):
    args = dict(eval_data=files["dev"], public_eval_data=files["public"], model=files["model"], mode="last-layer",
                epsilon=2.0, delta=1e-3, ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run",
                quiet=True)
    args.update(kw)
    return privtune.tune(files["train"], **args)


def _train(files, tmp_path, **kw):
    args = dict(eval_data=files["dev"], model=files["model"], mode="bitfit", epsilon=2.0, delta=1e-3, steps=4,
                batch_size=20, learning_rate=1e-2, ledger=f"sqlite:///{tmp_path / 'l.db'}",
                output_dir=tmp_path / "run", progress=False, labels=[0, 1])
    args.update(kw)
    return train(files["train"], **args)


def _every_file(run_dir) -> dict:
    return {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _contains(text: str, secret: str) -> bool:
    """Whether `secret` occurs in `text`; a number only as a whole number ("2.5" is not in "12.5px" or "2.55"),
    so that a short rounded learning rate cannot match the report's style sheet by chance."""
    if not re.fullmatch(r"[-+\d.e]+", secret):
        return secret in text
    return re.search(r"(?<![\d.])" + re.escape(secret) + r"(?![\d])", text) is not None


# ------------------------------------------------------------------------------------------ item 3
def test_repeat_and_select_publishes_only_the_selected_trial(files, tmp_path, monkeypatch, capsys):
    seen = {}
    real_choose_best = rs.choose_best

    def spy(trials):
        best = real_choose_best(trials)
        seen["trials"], seen["best"] = list(trials), best
        return best

    monkeypatch.setattr(rs, "choose_best", spy)
    monkeypatch.setattr(rs, "_draw_k", lambda rng, mean, shape: 3)  # K > 1, so that there is something to hide
    r = _tune(files, tmp_path, strategy="random-search", quiet=False,
              strategy_options={"trials": 4, "accounting": "repeat-and-select"}, seed=None)
    printed = capsys.readouterr()
    k = len(seen["trials"])
    others = [t for t in seen["trials"] if t is not seen["best"]]
    assert k == 3
    secrets = [repr(t.hyperparameters["learning_rate"]) for t in others]
    secrets += [f"{t.hyperparameters['learning_rate']:.3g}" for t in others
                if f"{t.hyperparameters['learning_rate']:.3g}" != f"{seen['best'].hyperparameters['learning_rate']:.3g}"]
    words = ["realised_trials", "best_index", "selected_trial", "random search trial", "random-search trial"]
    for path, data in _every_file(r.run_dir).items():
        text = data.decode("utf-8", errors="replace")
        for s in secrets + words:
            assert not _contains(text, s), (path, s)
    public = json.dumps([r.trials, r.history, r.metrics, r.certificate.to_dict()], default=str)
    for s in secrets + words + [f'"realised_trials": {k}']:
        assert not _contains(public, s), s
    assert len(r.trials) == 1 and r.trials[0]["hyperparameters"] == seen["best"].hyperparameters
    records = r.certificate.metadata["trial_records"]
    assert len(records) == 2 and records[-1]["phase"] == "final run"
    assert r.metrics["trials"] is None and r.metrics["wall_time_s"] is None
    for s in secrets + ["random search trial"]:
        assert not _contains(printed.out + printed.err, s), s
    report = (r.run_dir / "report.html").read_text()
    assert "selected trial only" in report  # the report says what is (not) published
    assert not (r.run_dir / ".tune_state.jsonl").exists()
    # durations grow with the hidden number of trials: log.txt states none
    assert not re.search(r"\bin \d+(\.\d+)? s\b", (r.run_dir / "log.txt").read_text()), "a duration in log.txt"


def test_composition_random_search_still_publishes_every_trial(files, tmp_path):
    r = _tune(files, tmp_path, strategy="random-search", seed=0,
              strategy_options={"trials": 3, "accounting": "composition"})
    assert len(r.trials) == 3 and r.history["strategy"]["realised_trials"] == 3


# ------------------------------------------------------------------------------------------ item 6
def test_seeded_train_is_labelled_not_private_in_certificate_card_and_report(files, tmp_path):
    r = _train(files, tmp_path, seed=3)
    cert = json.loads((r.output_dir / "certificate.json").read_text())
    assert cert["notes"][0].startswith("NOT PRIVATE: seeded") and cert["metadata"]["label"] == "NOT PRIVATE: seeded"
    card = (r.output_dir / "model" / "README.md").read_text()
    assert "NOT PRIVATE: seeded" in card.split("\n## ")[0]  # before the first section: a banner
    assert "NOT PRIVATE: seeded" in (r.output_dir / "report.html").read_text()
    assert json.loads((r.output_dir / "metrics.json").read_text())["label"] == "NOT PRIVATE: seeded"


def test_seeded_model_card_states_no_guarantee_anywhere(files, tmp_path):
    # the banner alone is not enough: the title, the front matter (shown by model hubs) and the guarantee
    # paragraph must not state (ε, δ) as a property of a model whose noise the seed reproduces
    r = _train(files, tmp_path, seed=3)
    card = (r.output_dir / "model" / "README.md").read_text()
    front, body = card.split("\n---\n", 1)
    assert "ε =" not in front and "NOT PRIVATE: seeded" in front
    assert "differentially private fine-tune" not in body and "-differentially private**" not in body
    assert "does **not** hold" in body.split("\n## Privacy guarantee", 1)[1]
    report = (r.output_dir / "report.html").read_text()
    assert "-differentially private</b>" not in report and "does <b>not</b> hold" in report


def test_unseeded_train_has_no_seeded_banner(files, tmp_path):
    r = _train(files, tmp_path, seed=None)
    cert = json.loads((r.output_dir / "certificate.json").read_text())
    assert not any("seeded" in n for n in cert["notes"]) and "label" not in cert["metadata"]
    assert "NOT PRIVATE: seeded" not in (r.output_dir / "model" / "README.md").read_text()


def test_seeded_train_cli_prints_the_banner(files, tmp_path, capsys):
    from privtune.cli import main

    rc = main(["train", "--data", files["train"], "--labels", "0,1", "--eval-data", files["dev"], "--model", str(files["model"]),
               "--mode", "last-layer", "--epsilon", "2", "--delta", "1e-3", "--steps", "2", "--batch-size", "20",
               "--seed", "7", "--ledger", f"sqlite:///{tmp_path / 'c.db'}", "--output", str(tmp_path / "c"),
               "--quiet"])
    assert rc == 0 and "NOT PRIVATE: seeded" in capsys.readouterr().out


def test_seeded_tune_is_labelled_not_private(files, tmp_path):
    r = _tune(files, tmp_path, strategy="single-step", seed=5)
    cert = json.loads((r.run_dir / "certificate.json").read_text())
    assert cert["notes"][0].startswith("NOT PRIVATE: seeded")
    assert "NOT PRIVATE: seeded" in (r.run_dir / "model" / "README.md").read_text().split("\n## ")[0]
    assert "NOT PRIVATE: seeded" in (r.run_dir / "report.html").read_text()


# ------------------------------------------------------------------------------------------ item 7
def test_train_metrics_do_not_reveal_the_number_of_sampled_examples(files, tmp_path):
    r = _train(files, tmp_path, seed=None)
    out = r.output_dir
    m = json.loads((out / "metrics.json").read_text())
    assert "examples_per_second" not in m and m["train_seconds"] > 0
    assert m["steps_per_second"] * m["train_seconds"] == pytest.approx(m["steps"])  # public: T
    hist = json.loads((out / "history.json").read_text())
    assert "train_loss" not in hist["final_run"]  # noise-free batch loss: NOT PRIVATE
    log = (out / "log.txt").read_text()
    assert "examples/s" not in log and not re.search(r"loss \d", log)
    npd = out / "not_private"
    assert stat.S_IMODE(npd.stat().st_mode) == 0o700
    for f in npd.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert "NOT PRIVATE" in (npd / "README.txt").read_text()
    private = json.loads((npd / "metrics.json").read_text())
    assert private["examples_per_second"] > 0 and private["label"].startswith("NOT PRIVATE")


# ------------------------------------------------------------------------------------------ issue 18 item 6
def _run_dir_with_loss(tmp_path, label):
    from privtune.accounting import Certificate, DPSGDEvent

    rd = tmp_path / "rd"
    rd.mkdir()
    Certificate.from_events([DPSGDEvent(2.0, 0.1, 20)], 1e-5).save(rd / "certificate.json")
    steps = list(range(1, 21))
    fr = {"step": steps, "eval": [{"step": 20, "accuracy": 0.7}]}
    private = {"final_run": {"step": steps, "train_loss": [0.7 - 0.01 * s for s in steps], "train_loss_label": label}}
    (rd / "metrics.json").write_text(json.dumps({"accuracy": 0.7, "epsilon": 1.0, "delta": 1e-5}))
    (rd / "history.json").write_text(json.dumps({"final_run": fr, "trials": []}))
    from privtune.report.release import write_not_private

    write_not_private(rd, {"history": private})
    return rd


def test_default_report_plots_no_noise_free_loss(tmp_path, monkeypatch):
    from privtune.accounting import Certificate, DPSGDEvent
    from privtune.report import html as H
    from privtune.report import plots as P

    # a run directory whose history.json still holds DP-SGD's batch loss (as every run before this fix wrote it)
    rd = tmp_path / "legacy"
    rd.mkdir()
    Certificate.from_events([DPSGDEvent(2.0, 0.1, 20)], 1e-5).save(rd / "certificate.json")
    steps = list(range(1, 21))
    (rd / "metrics.json").write_text(json.dumps({"accuracy": 0.7, "epsilon": 1.0, "delta": 1e-5}))
    (rd / "history.json").write_text(json.dumps({"trials": [], "final_run": {
        "step": steps, "eval": [{"step": 20, "accuracy": 0.7}], "train_loss": [0.7 - 0.01 * s for s in steps],
        "train_loss_label": "NOT PRIVATE: mean loss of each sampled batch, computed without noise"}}))
    drawn = []
    real = P.plot_learning_curves

    def spy(run, **kw):
        drawn.append(run.final_run.get("train_loss"))
        return real(run, **kw)

    monkeypatch.setattr(P, "plot_learning_curves", spy)
    out = H.write_report(rd)
    assert drawn == [None]  # the plotting code never saw the noise-free loss
    assert "computed without noise (do not publish)" not in out.read_text()


def test_opt_in_report_badges_the_non_private_loss_inside_the_picture(tmp_path):
    from privtune.report import html as H
    from privtune.report import plots as P
    from privtune.report.run import load_run

    rd = _run_dir_with_loss(tmp_path, "NOT PRIVATE: mean loss of each sampled batch, computed without noise")
    out = H.write_report(rd, include_non_private=True)
    assert out == rd / "not_private" / "report.html"
    assert (rd / "not_private" / "learning_curves.png").is_file() and not (rd / "learning_curves.png").exists()
    for f in (rd / "not_private").iterdir():  # NOT PRIVATE figures are private files, whatever the umask
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    run = load_run(rd, include_non_private=True)
    fig = P.plot_learning_curves(run)
    texts = [t.get_text() for t in fig.texts] + [ax.get_title() for ax in fig.axes]
    assert any(t.startswith("NOT PRIVATE") for t in texts)
    fig.canvas.draw()  # the badge and the loss title lie inside the image, not clipped
    renderer = fig.canvas.get_renderer()
    w, h = fig.canvas.get_width_height()
    for t in fig.texts + [fig.axes[0].title]:
        if t.get_text():
            bb = t.get_window_extent(renderer)
            assert bb.x0 >= 0 and bb.x1 <= w and bb.y0 >= 0 and bb.y1 <= h, t.get_text()


def test_resumed_repeat_and_select_does_not_publish_how_many_trials_had_completed(files, tmp_path, monkeypatch):
    import privtune.hpo.backends as backends

    monkeypatch.setattr(rs, "_draw_k", lambda rng, mean, shape: 3)
    real_fit, calls = backends.fit, []  # every trial (heads on features too) trains through the one loop's fit

    def interrupt_third(*a, **k):  # Ctrl-C during the third trial: two trials completed before it
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_fit(*a, **k)

    monkeypatch.setattr(backends, "fit", interrupt_third)
    args = dict(strategy="random-search", seed=11, strategy_options={"trials": 3, "accounting": "repeat-and-select"})
    with pytest.raises(KeyboardInterrupt):
        _tune(files, tmp_path, **args)
    assert len(calls) == 3
    monkeypatch.setattr(backends, "fit", real_fit)
    r = _tune(files, tmp_path, resume=True, **args)
    assert "resumed" not in r.metrics and r.metrics["trials"] is None
    log = (r.run_dir / "log.txt").read_text()
    assert not re.search(r"\d+ completed trial", log) and "trial 2" not in log and "3 runs" not in log
    assert not (r.run_dir / ".tune_state.jsonl").exists()


# ------------------------------------------------------------------------- "what a run releases" table
def _release_table() -> str:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "privacy-model.md").read_text()
    return page.split("## What a run releases", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("command", ["train", "tune-repeat-and-select", "tune-hyperfree"])
def test_release_table_names_every_file_and_field_a_run_writes(files, tmp_path, command):
    if command == "train":
        out = _train(files, tmp_path, seed=None).output_dir
    elif command == "tune-repeat-and-select":
        out = _tune(files, tmp_path, strategy="random-search",
                    strategy_options={"trials": 2, "accounting": "repeat-and-select"}).run_dir
    else:
        out = _tune(files, tmp_path, strategy="hyperfree", labels=[0, 1], steps=2, batch_size=20).run_dir
    table = _release_table()
    tokens = re.findall(r"`\.?([A-Za-z_][\w.\-]*)`", table)  # `metrics.json`, `metadata.seeds`, `.lr`, ...
    named = set(tokens) | {part for t in tokens for part in t.split(".")}
    for p in out.iterdir():  # every file or directory at the top of RUN_DIR
        assert (p.name in named or p.name.rstrip("/") + "/" in table
                or (p.suffix == ".png" and "*.png" in table)), p.name
    cert = json.loads((out / "certificate.json").read_text())
    fields = {f"certificate.json {k}": k for k in cert} | {f"metadata.{k}": k for k in cert["metadata"]}
    fields |= {f"metrics.json {k}": k for k in json.loads((out / "metrics.json").read_text())}
    hist = json.loads((out / "history.json").read_text())
    fields |= {f"history.json {k}": k for k in hist} | {f"final_run.{k}": k for k in hist["final_run"]}
    missing = [where for where, key in fields.items() if key not in named]
    assert not missing, f"docs/privacy-model.md 'What a run releases' does not name: {missing}"
