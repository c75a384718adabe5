"""The full-size SST-2 bench's kept results agree with themselves.

Git keeps the JSON that ``bench/sst2_full.py`` writes for every cell (``bench/results/sst2_full/full/``) and for
every search trial (``runs/<cell>_eps<ε>_seed<s>/trial<i>.json``). A search cell must release its best trial on
the public split (never the best on dev), and its recorded time must be its trials' time. The pages that show
these numbers are checked by tests/test_docs_benchmarks.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "sst2_full" / "full"
CELL_FILE = re.compile(r"^(?P<cell>[a-z0-9.-]+)_eps(?P<eps>[0-9.]+)_seed(?P<seed>\d+)\.json$")
SEARCHES = ("random", "random-full", "oracle", "oracle-full")


def _kept_cells(*cells: str) -> list:
    """The kept cell files (of ``cells`` if given), one test parameter each, named by the file."""
    return [pytest.param(p, id=p.stem) for p in sorted(RESULTS.glob("*.json"))
            if (m := CELL_FILE.match(p.name)) and (not cells or m["cell"] in cells)]


def test_the_results_folder_keeps_cells():
    assert _kept_cells(), f"no cell JSON under {RESULTS}: docs/benchmarks.md would have no SST-2 section"


@pytest.mark.parametrize("path", _kept_cells())
def test_a_kept_cell_holds_what_the_page_shows(path):
    kept = json.loads(path.read_text(encoding="utf-8"))
    assert 0.0 <= kept["dev_accuracy"] <= 1.0
    assert kept["seconds"] > 0 and kept["compute_vs_final"] >= 1.0
    m = CELL_FILE.match(path.name)
    assert kept["certificate_epsilon"] <= float(m["eps"]) * (1 + 1e-9), f"{path.name}: certificate above its ε"


@pytest.mark.parametrize("path", _kept_cells(*SEARCHES))
def test_a_search_cell_releases_its_best_trial_on_the_public_split(path):
    kept = json.loads(path.read_text(encoding="utf-8"))
    trials = sorted((RESULTS / "runs" / path.stem).glob("trial*.json"), key=lambda p: int(p.stem[5:]))
    assert trials, f"{path.name}: its trials are not kept under runs/{path.stem}/"
    runs = [json.loads(t.read_text(encoding="utf-8")) for t in trials]
    best = max(runs, key=lambda t: t["public_accuracy"])  # first of equals, as the bench selects
    assert kept["dev_accuracy"] == best["dev_accuracy"]
    assert round(sum(t["seconds"] for t in runs), 1) == kept["seconds"]
