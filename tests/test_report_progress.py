"""privtune.report.progress: rich display, quiet mode, plain log file, interruption."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from privtune.report.progress import Progress, RunLog


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
    assert "done trial 1/2: 3/3 steps" in text and "loss 0.69" in text and "ε 0.25/1" in text
    assert "trial 1/2 done: score 0.8" in text
    assert "done final run: 2/2 steps" in text and "ε 0.9/1" in text
    assert "examples/s" in text


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
