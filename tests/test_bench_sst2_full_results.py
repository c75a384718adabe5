"""The README's full-size SST-2 table (issue 15) says what the bench's kept results say.

Git keeps the JSON that ``bench/sst2_full.py`` writes for every cell (``bench/results/sst2_full/full/``) and for
every search trial (``runs/<cell>_eps<ε>_seed<s>/trial<i>.json``). The README's CPU table is written by hand from
them; these tests read both and fail when a kept cell's dev accuracy, wall time or compute ratio is not the one the
README shows in that cell's place, or when a search cell's selected trial is not its best on the public split."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "sst2_full" / "full"
CELL_FILE = re.compile(r"^(?P<cell>[a-z0-9.-]+)_eps(?P<eps>[0-9.]+)_seed(?P<seed>\d+)\.json$")
# where each cell sits in the README's CPU table: (column after "total ε", part of an "A / B" cell)
COLUMNS = {"default": (1, None), "bitfit": (2, None), "full": (3, None), "random": (4, 0), "random-full": (4, 1),
           "oracle": (5, 0), "oracle-full": (5, 1)}


def _kept_cells(*cells: str) -> list:
    """The kept cell files (of ``cells`` if given), one test parameter each, named by the file."""
    wanted = set(cells or COLUMNS)
    return [pytest.param(p, id=p.stem) for p in sorted(RESULTS.glob("*.json"))
            if (m := CELL_FILE.match(p.name)) and m["cell"] in wanted]


def _cpu_table() -> dict[str, list[str]]:
    """The README's CPU table (the one after "**On the CPU**"): ε as written → its cells."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("**On the CPU**"))
    rows, in_table = {}, False
    for line in lines[start:]:
        if line.startswith("| total ε"):
            in_table = True
        elif in_table and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows[cells[0]] = cells
        elif in_table and not line.startswith("|"):
            break
    return rows


def test_the_results_folder_keeps_cells():
    assert _kept_cells(), f"no cell JSON under {RESULTS}: the README's CPU table has nothing to be checked against"


@pytest.mark.parametrize("path", _kept_cells())
def test_readme_cpu_table_shows_each_kept_cell(path):
    m = CELL_FILE.match(path.name)
    kept = json.loads(path.read_text(encoding="utf-8"))
    row = _cpu_table().get(f"{float(m['eps']):g}")
    assert row is not None, f"README's CPU table has no row for ε = {m['eps']} ({path.name} is kept)"
    column, part = COLUMNS[m["cell"]]
    text = row[column] if part is None else row[column].split(" / ")[part]
    dev = f"{100 * kept['dev_accuracy']:.1f}"
    assert re.search(rf"(?<![0-9.]){re.escape(dev)}(?![0-9])", text), \
        f"{path.name}: dev {dev} % is not in the README's cell for it: {text!r}"
    if m["cell"] in ("random", "random-full", "oracle", "oracle-full"):  # one seed: its time and compute are shown
        assert f"{kept['seconds'] / 60:.1f} min" in text, f"{path.name}: {kept['seconds'] / 60:.1f} min not in {text!r}"
        assert f"{kept['compute_vs_final']:.1f}×" in text, f"{path.name}: compute ratio not in {text!r}"


@pytest.mark.parametrize("path", _kept_cells("random", "random-full", "oracle", "oracle-full"))
def test_a_search_cell_releases_its_best_trial_on_the_public_split(path):
    kept = json.loads(path.read_text(encoding="utf-8"))
    trials = sorted((RESULTS / "runs" / path.stem).glob("trial*.json"), key=lambda p: int(p.stem[5:]))
    assert trials, f"{path.name}: its trials are not kept under runs/{path.stem}/"
    runs = [json.loads(t.read_text(encoding="utf-8")) for t in trials]
    best = max(runs, key=lambda t: t["public_accuracy"])  # first of equals, as the bench selects
    assert kept["dev_accuracy"] == best["dev_accuracy"]
    assert round(sum(t["seconds"] for t in runs), 1) == kept["seconds"]
