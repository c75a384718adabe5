"""privtune.report.progress: rich display, quiet mode, plain log file, interruption."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from privtune.report.progress import BATCH_LOSS_LABEL, Progress, RunLog


def test_runlog_appends_timestamped_lines(tmp_path):
    p = tmp_path / "run" / "log.txt"
    with RunLog(p) as log:
        log.write("hello")
        log.write("two\nlines")
    with RunLog(p) as log:
        log.write("again")
    lines = p.read_text().splitlines()
    assert lines[0].endswith("  hello") and lines[0][:4].isdigit()
    assert lines[2].strip() == "lines" and lines[3].endswith("again")
    RunLog(None).write("nothing")  # no file, no error


def test_progress_quiet_writes_only_the_log(tmp_path, capsys):
    log = tmp_path / "log.txt"
    with Progress(quiet=True, log_path=log, total_epsilon=1.0, log_interval=0.0) as pr:
        pr.start_phase("feature caching", total=100, unit="examples")
        pr.advance(100, examples=100)
        pr.start_phase("trial 1/2", total=3)
        for _ in range(3):
            pr.advance(1, examples=32, loss=0.69, epsilon=0.25)
        pr.log("trial 1/2 done: score 0.8")
        pr.start_phase("final run", total=2)
        pr.advance(2, examples=64, loss=0.5, epsilon=0.9)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    text = log.read_text()
    assert "start feature caching (100 examples)" in text
    assert "done trial 1/2: 3/3 steps" in text and "ε 0.25/1" in text
    assert "trial 1/2 done: score 0.8" in text
    assert "done final run: 2/2 steps" in text and "ε 0.9/1" in text
    # the loss and the example rate come from private data without noise: never in the shareable log.txt
    assert "loss" not in text and "examples/s" not in text


def test_an_umbrella_phase_is_not_reported_done_when_its_first_step_starts(tmp_path):
    """tune opens "hyperfree (bitfit)" (open-ended) and its η trials start phases of their own: the log read
    "done hyperfree (bitfit): 0 runs … in 0.0 s" before any trial ran."""
    log = tmp_path / "log.txt"
    with Progress(quiet=True, log_path=log, total_epsilon=1.0, log_interval=0.0) as pr:
        pr.start_phase("hyperfree (bitfit)", None, unit="runs")
        pr.start_phase("trial 1", total=2)
        pr.advance(2, examples=64)
        pr.start_phase("open-ended with work", None, unit="runs")
        pr.advance(1)
        pr.end_phase()
    text = log.read_text()
    assert "start hyperfree (bitfit)" in text and "done hyperfree" not in text
    assert "done trial 1: 2/2 steps" in text and "done open-ended with work: 1 runs" in text


def test_progress_draws_phase_loss_and_epsilon():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=160)
    with Progress(console=console, total_epsilon=2.0) as pr:
        pr.start_phase("trial 3/6", total=4)
        pr.advance(4, examples=128, loss=0.4321, epsilon=1.25)
        pr.log("a message")
    text = buf.getvalue()
    assert "trial 3/6" in text and "loss 0.4321" in text and "ε 1.25/2" in text and "ex/s" in text
    assert "a message" in text


def test_interrupt_is_logged(tmp_path):
    log = tmp_path / "log.txt"
    with pytest.raises(KeyboardInterrupt):
        with Progress(quiet=True, log_path=log) as pr:
            pr.start_phase("final run", total=10)
            pr.advance(3)
            raise KeyboardInterrupt
    text = log.read_text()
    assert "interrupted (Ctrl-C)" in text and "interrupted during final run: 3/10 steps" in text


class _Recording(Progress):
    """A quiet Progress that records every phase and every update."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.updates: list = []
        self.phases: list = []
        self.loss_labels: dict = {}
        self.plans: list = []

    def start_phase(self, name, total=None, unit="steps", work=None, kind=None, loss_label="loss", counted=True):
        self.phases.append((name, total))
        self.loss_labels[name] = loss_label
        super().start_phase(name, total, unit, work=work, kind=kind, loss_label=loss_label, counted=counted)

    def plan_ahead(self, items):
        self.plans.append([(k, w) for k, w in items])
        super().plan_ahead(items)

    def advance(self, n=1, *, examples=None, loss=None, epsilon=None):
        self.updates.append({"phase": self.phase, "n": n, "examples": examples, "loss": loss, "epsilon": epsilon,
                             "rate": self.examples_per_second})
        super().advance(n, examples=examples, loss=loss, epsilon=epsilon)


def test_tune_reports_steps_examples_loss_and_epsilon(tmp_path, monkeypatch):
    """privtune tune gives every run's steps to the display: examples/s, the loss (labelled not private when it is
    the batch loss; the privatised loss for hyperfree's final run) and the ε spent so far over the whole tune."""
    import importlib

    import privtune
    from privtune.finetune import usefulness
    from privtune.models.testing import make_tiny_text_model, make_toy_text_dataset

    monkeypatch.setattr(usefulness, "FINETUNE_AT_CHANCE_N_EPS", 0)  # toy data (n·ε = 320): still pilot every mode

    def write(path, ds):
        path.write_text("label\tsentence\n" + "".join(f"{y}\t{t}\n" for t, y in zip(ds.texts, ds.labels)))
        return str(path)

    tune_mod = importlib.import_module("privtune.hpo.tune")  # the module (privtune.hpo.tune is also the function)
    made = []
    monkeypatch.setattr(tune_mod, "_progress", lambda quiet, run_dir, eps: made.append(
        _Recording(quiet=True, log_path=run_dir / "log.txt", total_epsilon=eps, log_interval=0.0)) or made[-1])
    model = make_tiny_text_model(tmp_path / "st", sentence_transformers=True)
    r = privtune.tune(write(tmp_path / "train.tsv", make_toy_text_dataset(160, seed=0)),
                      public_eval_data=write(tmp_path / "pub.tsv", make_toy_text_dataset(40, seed=1)),
                      model=model, mode="auto", strategy="hyperfree", epsilon=2.0, delta=1e-3, epochs=2,
                      batch_size=40, seed=0, quiet=True, ledger=f"sqlite:///{tmp_path / 'l.db'}",
                      output_dir=tmp_path / "run")
    (pr,) = made
    names = [n for n, _ in pr.phases]
    pilots = [n for n in names if "pilot bitfit" in n or "pilot lora" in n]
    # the batch loss of fit is not private: the display says so next to the loss, not in the phase's name
    assert pilots and all(pr.loss_labels[n] == BATCH_LOSS_LABEL for n in pilots)
    assert "not private, not in the release" in BATCH_LOSS_LABEL
    final = [n for n in names if n.startswith("final run")]
    assert len(final) == 1 and pr.loss_labels[final[0]] == "privatised loss"
    steps = r.metrics["hyperparameters"]["steps"]
    assert (final[0], steps) in pr.phases
    upd = [u for u in pr.updates if u["phase"] == final[0]]
    assert len(upd) == steps and all(u["examples"] is not None and u["n"] == 1 for u in upd)
    assert any(u["loss"] is not None for u in upd) and any(u["rate"] > 0 for u in upd)
    eps = [u["epsilon"] for u in upd if u["epsilon"] is not None]
    assert eps and eps == sorted(eps) and eps[-1] == pytest.approx(r.certificate.epsilon, rel=1e-6)
    for name in pilots:
        pu = [u for u in pr.updates if u["phase"] == name]
        assert pu and all(u["loss"] is not None and u["examples"] is not None for u in pu)
    text = (tmp_path / "run" / "log.txt").read_text()
    assert f"done {final[0]}: {steps}/{steps} steps" in text and "examples/s" not in text and "ε " in text
    # the time left is planned by kind of work: before the pilots, caching, every pilot (its steps and its score)
    # and the plan of the first candidate, which wins ties; once the pilots have chosen, that mode's plan only
    first, last = {k for k, _ in pr.plans[0]}, {k for k, _ in pr.plans[-1]}
    assert {"forward", "features", "model:bitfit", "model:lora", "predict"} <= first
    chosen = r.metrics["mode"]
    assert last <= {"features" if chosen == "last-layer" else f"model:{chosen}", "predict", "release"}


def test_time_left_for_the_phase_and_the_whole_run_from_the_plan_and_the_clock(tmp_path, monkeypatch):
    import privtune.report.progress as progress_module

    clock = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    log = tmp_path / "log.txt"
    with Progress(quiet=True, log_path=log, total_epsilon=1.0, log_interval=0.0) as pr:
        pr.plan_work(1000)  # planned examples of the whole run (public: from the plan)
        pr.start_phase("trial 1/2", total=10, work=400)
        clock[0] += 40
        pr.advance(4, examples=160)
        # phase: 40 s for 4 of 10 steps → 60 s left; run: 0.25 s per planned example, 840 examples left
        assert pr.time_left() == pytest.approx((60.0, 210.0))
        clock[0] += 60
        pr.advance(6, examples=240)
        pr.start_phase("final run", total=5, work=600)
        clock[0] += 30
        pr.advance(1, examples=120)
        # phase: 30 s per step → 120 s left; run: (100 + 30) s for 520 planned examples → 480·0.25 = 120 s
        assert pr.time_left() == pytest.approx((120.0, 120.0))
    text = log.read_text()
    assert "1m00s left, run 3m30s left" in text and "2m00s left, run 2m00s left" in text


def test_no_time_left_where_durations_are_kept_secret(tmp_path, monkeypatch):
    log = tmp_path / "log.txt"
    with Progress(quiet=True, log_path=log, log_interval=0.0) as pr:
        pr.log_timing = False  # e.g. repeat-and-select: the durations grow with the hidden number of trials
        pr.plan_work(100)
        pr.start_phase("trial", total=4, work=100)
        pr.advance(2)
    assert "left" not in log.read_text()


def test_time_left_prices_each_kind_of_work_at_its_own_rate(tmp_path, monkeypatch):
    """A head step on cached features costs next to nothing, a DP-BiTFiT step a few forward passes: one rate for
    all the planned examples of a tune priced the demo's head steps at a pilot's speed (an hour left, a minute
    before the end)."""
    import privtune.report.progress as progress_module

    clock = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    log = tmp_path / "log.txt"
    with Progress(quiet=True, log_path=log, log_interval=1e9) as pr:
        pr.plan_ahead([("forward", 1000), ("model:bitfit", 100), ("features", 5000), ("predict", 200)])
        pr.start_phase("caching", total=1000, unit="examples", work=1000, kind="forward")
        clock[0] += 10
        pr.advance(500, examples=500)
        # forward: 0.02 s per example, measured; the other kinds scaled from it by RELATIVE_COST until measured
        forward = 0.02
        expect = (10 + 100 * forward * progress_module.RELATIVE_COST["model:bitfit"]
                  + 5000 * forward * progress_module.RELATIVE_COST["features"]
                  + 200 * forward * progress_module.RELATIVE_COST["predict"])
        assert pr.time_left() == pytest.approx((10.0, expect))
        clock[0] += 10
        pr.advance(500, examples=500)
        pr.start_phase("pilot bitfit", total=10, work=100, kind="model:bitfit")
        clock[0] += 5
        pr.advance(1, examples=10)
        # bitfit measured: 0.5 s per example, its own pilot's; the head steps stay priced as head steps; the kinds
        # not measured yet are scaled from the rate measured last (the machine's load may have changed since the
        # caching: here a forward pass now costs 0.5 / 3.3 s, not 0.02 s)
        cost = progress_module.RELATIVE_COST
        now_forward = 0.5 / cost["model:bitfit"]
        after = 5000 * now_forward * cost["features"] + 200 * now_forward * cost["predict"]
        expect = 45 + after
        assert pr.time_left() == pytest.approx((45.0, expect))
        assert pr.time_left()[1] < 150  # one rate for all (0.5 s per example) would say 2,645 s
        clock[0] += 45
        pr.advance(9, examples=90)
        pr.end_phase()
    assert f"done pilot bitfit: 10/10 steps, 0s left, run {round(after)}s left" in log.read_text()


def test_plain_lines_as_they_come_when_the_output_is_not_a_terminal(tmp_path):
    """Redirected to a file, the rich display drew nothing until the run ended (13 minutes of silence for a
    `privtune train`): now the log's lines are printed as they are written."""
    buf = io.StringIO()
    log = tmp_path / "log.txt"
    with Progress(console=Console(file=buf), log_path=log, total_epsilon=1.0, log_interval=0.0) as pr:
        pr.start_phase("DP bitfit", total=4, loss_label=BATCH_LOSS_LABEL)
        pr.advance(1, examples=32, loss=0.5, epsilon=0.25)
        pr.log("a message")
        printed = buf.getvalue()
        assert "start DP bitfit (4 steps)" in printed and "DP bitfit: 1/4 steps, ε 0.25/1" in printed
        assert "a message" in printed
        pr.advance(3, examples=96, loss=0.4, epsilon=1.0)
    printed = buf.getvalue()
    assert printed == log.read_text()  # the same lines as log.txt, hence no loss and no example rate
    assert "loss" not in printed and "ex/s" not in printed and "\x1b" not in printed  # no terminal codes


def test_hidden_timing_leaves_no_clock_in_any_line(tmp_path, monkeypatch):
    """Under repeat-and-select the time between lines would count the trials: after hide_timing no line has a
    timestamp, a duration, a time left or a rate, the lines held before it lose theirs too, and progress lines
    come every tenth of a phase, not every so many seconds."""
    import privtune.report.progress as progress_module

    clock = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    buf = io.StringIO()
    log = tmp_path / "log.txt"
    with Progress(console=Console(file=buf), log_path=log, log_interval=1.0) as pr:
        pr.hold_lines()
        pr.log("privtune tune: strategy=random-search")
        pr.plan_ahead([("features", 100)])
        pr.hide_timing()
        pr.start_phase("search", total=20, work=100, kind="features")
        for _ in range(20):
            clock[0] += 7.0  # slow steps: a line every second would count them
            pr.advance(1, examples=5)
        pr.end_phase()
        pr.log("the selected trial is released")
    text = log.read_text()
    assert text == buf.getvalue()
    lines = text.splitlines()
    assert lines[0] == "privtune tune: strategy=random-search" and lines[-1] == "the selected trial is released"
    assert [ln for ln in lines if ln.startswith("search:")] == [f"search: {2 * i}/20 steps" for i in range(1, 10)]
    assert "done search: 20/20 steps" in lines
    for ln in lines:
        assert not re.search(r"\d\d:\d\d|left|\bin \d|ex/s", ln), ln


def test_a_held_line_keeps_the_time_it_was_made(tmp_path):
    log = tmp_path / "log.txt"
    with Progress(quiet=True, log_path=log) as pr:
        pr.hold_lines()
        pr.log("first")
        assert log.read_text() == ""  # held until the plan says whether times may be shown
        pr.release_lines()
        pr.log("second")
    lines = log.read_text().splitlines()
    assert lines[0].endswith("  first") and lines[0][:4].isdigit() and lines[1].endswith("  second")


def test_redirected_train_prints_its_progress_lines(tmp_path, capsys):
    """`privtune train` with its output redirected printed nothing until the end (13 minutes on a real run)."""
    from privtune.models.testing import make_toy_text_files
    from privtune.training import train

    files = make_toy_text_files(tmp_path / "data", {"train": ("train.tsv", 120, 0), "dev": ("dev.tsv", 30, 2)})
    capsys.readouterr()
    train(files["train"], eval_data=files["dev"], model=files["model"], mode="bitfit", epsilon=2.0, delta=1e-3,
          steps=4, batch_size=20, learning_rate=1e-2, ledger=f"sqlite:///{tmp_path / 'l.db'}",
          output_dir=tmp_path / "run", progress=True, labels=[0, 1])
    err = capsys.readouterr().err  # captured: not a terminal
    assert "start DP bitfit (4 steps)" in err and "done DP bitfit: 4/4 steps" in err
    log = (tmp_path / "run" / "log.txt").read_text()
    progress_lines = [line for line in log.splitlines() if "DP bitfit" in line]
    assert progress_lines and all(line in err for line in progress_lines)  # the log's lines, as they were written
    assert "\x1b[" not in err and "━" not in err  # plain lines, no live display


def test_work_done_outside_a_phase_is_taken_off_the_plan_and_measured(tmp_path, monkeypatch):
    """The scores of η trials are forward passes outside any phase: planned, they stayed ahead for ever and the
    estimate at the end of a bitfit tune was 16× the time left."""
    import privtune.report.progress as progress_module

    clock = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    with Progress(quiet=True, log_path=tmp_path / "log.txt") as pr:
        pr.plan_ahead([("predict", 500), ("predict", 1000)])
        pr.record_work("predict", 500, 10.0)  # a score: 0.02 s per example
        pr.start_phase("evaluating", total=1000, unit="examples", work=1000, kind="predict")
        assert pr.time_left() == pytest.approx((20.0, 20.0))  # only the evaluation is left
