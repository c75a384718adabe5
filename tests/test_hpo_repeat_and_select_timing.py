"""Repeat-and-select random search publishes no timing.

Papernot & Steinke's bound for releasing the best of K trials holds only while K stays secret.  A run's
duration grows with K, so any time in what the run writes or prints (a timestamp on each log line, a phase's
duration, a time-left estimate, an examples/s rate, the report's "generated at" time) lets a reader count the
trials.  The test runs the same search twice with K forced to 1 and to 4 and each trial made slow, so that
any time would differ between the two runs, and checks that the run directory and the printed output are the
same, byte for byte.

What is pinned, and why: ``_draw_k`` is forced (K = 1 vs K = 4), and the selection is pinned to the first
trial.  Which trial wins legitimately depends on K (the best of four is not the best of one) and that
trial's values are what the run releases; with the first trial chosen in both runs, the released trial is
the same one (drawn first, from the same seeds), so everything the run writes must be equal.  Both runs start
from the same ledger (the dataset registered once, the ledger's files restored before the second run), since
the ledger gives a dataset a random id when it registers it.  Nothing in the files or the output is masked.
"""

from __future__ import annotations

import re
import shutil
import time

import pytest

import privtune
from privtune.hpo import backends
from privtune.hpo import random_search as rs
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files

_CLOCK = re.compile(r"\d\d:\d\d(:\d\d)?|\bin \d+(\.\d+)? s\b|\d+s left|ex/s")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("ps_timing"), {
        "train": ("train.tsv", 120, 0), "public": ("public.tsv", 40, 1), "dev": ("dev.tsv", 30, 2)})


def _run(files, root, ledger, k, monkeypatch, capsys) -> tuple[dict, str]:
    """One repeat-and-select tune with K = ``k`` in ``root`` (emptied first) on the ``ledger`` database: every
    file it wrote, and what it printed."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    monkeypatch.setattr(rs, "_draw_k", lambda rng, mean, shape: k)
    capsys.readouterr()
    privtune.tune(files["train"], eval_data=files["dev"], public_eval_data=files["public"], model=files["model"],
                  mode="last-layer", strategy="random-search", epsilon=2.0, delta=1e-3, seed=5, quiet=False,
                  strategy_options={"trials": 3, "accounting": "repeat-and-select"},
                  ledger=f"sqlite:///{ledger}", output_dir=root / "run")
    printed = capsys.readouterr()
    written = {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "run").rglob("*")) if p.is_file()}
    return written, printed.out + printed.err


def test_repeat_and_select_writes_and_prints_the_same_bytes_for_any_number_of_trials(files, tmp_path, monkeypatch,
                                                                                         capsys):
    real_run = backends.FeatureBackend.run

    def slow_trial(self, *a, **k):  # each trial takes over a second: K trials show in any clock
        time.sleep(1.1)
        return real_run(self, *a, **k)

    monkeypatch.setattr(backends.FeatureBackend, "run", slow_trial)
    monkeypatch.setattr(rs, "choose_best", lambda trials: trials[0])
    ledger = tmp_path / "ledger" / "ledger.db"
    ledger.parent.mkdir()
    Ledger(f"sqlite:///{ledger}").init_dataset(files["train"], 10.0, 1e-3)
    before = {p: p.read_bytes() for p in ledger.parent.iterdir()}
    root = tmp_path / "same-place"  # one place for both runs: paths in the files are equal too
    one, printed_one = _run(files, root, ledger, 1, monkeypatch, capsys)
    for p in ledger.parent.iterdir():
        p.unlink()
    for p, data in before.items():
        p.write_bytes(data)
    four, printed_four = _run(files, root, ledger, 4, monkeypatch, capsys)
    assert "log.txt" in str(sorted(one)) and "random-search" in printed_one  # the output is not empty
    assert sorted(one) == sorted(four)
    differ = [name for name in one if one[name] != four[name]]
    assert not differ, f"files that differ between K = 1 and K = 4: {differ}"
    assert printed_one == printed_four
    for name, data in list(one.items()) + [("printed output", printed_one.encode())]:
        if name.endswith((".png", ".safetensors", ".bin", ".pt")):
            continue
        found = _CLOCK.search(data.decode("utf-8", errors="replace"))
        assert not found, f"time in {name}: {found.group(0)!r}"
