"""The full-size SST-2 bench's split (bench/sst2_full.py, issue 15) survives a fresh checkout.

Git keeps the bench's results and ``split.json`` but not the split's rows (``train.tsv``, ``public.tsv``): on a
new checkout the bench must rebuild the same rows, so that the kept results (e.g. half of a random search's
trials) and the trials run next are on one split, and must refuse to go on when the rebuilt split differs.  A search
cell shared between processes (``--trials``) is written by whichever process finishes last."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def bench(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])  # as when run as a script; undone after the test
    spec = importlib.util.spec_from_file_location("sst2_full_under_test", BENCH / "sst2_full.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sst2 = tmp_path / "sst2"
    sst2.mkdir()
    # nested phrases as in SST-2: every sentence comes with some of its own sub-phrases
    sentences = [f"the film number {i} is {'good' if i % 2 else 'bad'} and long" for i in range(40)]
    rows = []
    for i, s in enumerate(sentences):
        w = s.split()
        rows += [(s, i % 2), (" ".join(w[2:5]), i % 2), (" ".join(w[:3]), i % 2)]
    (sst2 / "train.tsv").write_text("label\tsentence\n" + "".join(f"{y}\t{t}\n" for t, y in rows), encoding="utf-8")
    (sst2 / "dev.tsv").write_text("label\tsentence\n1\tan unseen dev sentence here\n", encoding="utf-8")
    monkeypatch.setattr(module, "SST2", sst2)
    yield module
    sys.modules.pop("sst2_full_under_test", None)


def _rows(folder: Path) -> tuple[str, str]:
    return (folder / "train.tsv").read_text(encoding="utf-8"), (folder / "public.tsv").read_text(encoding="utf-8")


def test_split_is_containment_disjoint_and_recorded_without_machine_paths(bench, tmp_path):
    folder = tmp_path / "results"
    split = bench.make_split(5, None, folder)
    assert split["n_public"] == 5 and split["n_private"] > 0
    private = [line.split("\t", 1)[1] for line in _rows(folder)[0].splitlines()[1:]]
    public = [line.split("\t", 1)[1] for line in _rows(folder)[1].splitlines()[1:]]
    assert not bench.containment_violations(private, public)
    kept = json.loads((folder / "split.json").read_text())
    assert (kept["train"], kept["public"]) == ("train.tsv", "public.tsv")  # found beside split.json, wherever it is
    assert str(tmp_path) not in json.dumps(kept)  # nor the dev set's path on this machine


def test_missing_rows_are_rebuilt_identically(bench, tmp_path):
    folder = tmp_path / "results"
    first = bench.make_split(5, None, folder)
    rows = _rows(folder)
    for name in ("train.tsv", "public.tsv"):  # what a fresh checkout lacks: git ignores them
        (folder / name).unlink()
    again = bench.make_split(5, None, folder)
    assert _rows(folder) == rows
    assert {k: again[k] for k in ("n_private", "n_public")} == {k: first[k] for k in ("n_private", "n_public")}


def test_a_rebuilt_split_that_differs_from_the_kept_one_is_refused(bench, tmp_path):
    folder = tmp_path / "results"
    bench.make_split(5, None, folder)
    kept = json.loads((folder / "split.json").read_text())
    (folder / "split.json").write_text(json.dumps({**kept, "n_private": kept["n_private"] + 1}))
    (folder / "train.tsv").unlink()
    with pytest.raises(SystemExit, match="belong to another split"):
        bench.make_split(5, None, folder)


def _fake_fit(bench, monkeypatch, during=None):
    """``_dp_fit`` without training: a zero-step run that returns the model and no events; ``during(seed)`` runs in
    its place (what another process does while this one trains)."""
    import privtune.training as training

    def fit(train, q, steps, sigma, lr, seed, **kw):
        if during is not None:
            during(seed)
        return object(), []

    monkeypatch.setattr(bench, "_dp_fit", fit)
    monkeypatch.setattr(training, "evaluate", lambda model, data: {"accuracy": 0.5})
    monkeypatch.setattr(bench._IterateAverages, "evaluate", lambda self, model, datasets: {})


def test_the_process_that_finishes_last_assembles_a_shared_search_cell(bench, tmp_path, monkeypatch):
    # two processes share a two-point oracle (--trials 0 and --trials 1); the one running trial 1 starts while
    # trial 0 is missing and finishes after the other process wrote it: it must write the cell, not leave it
    folder = tmp_path / "results"
    split = bench.make_split(5, None, folder)
    split = {**{k: str(folder / split[k]) for k in ("train", "public")}, "dev": str(bench.SST2 / "dev.tsv")}
    points = [(1e-2, 1), (4e-2, 1)]
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    _fake_fit(bench, monkeypatch)
    assert bench._search_cell(split, 8.0, 0, points, charged=False, folder=elsewhere, only={0}) is None
    ours = tmp_path / "ours"
    ours.mkdir()
    # trial 0 lands in our folder while our trial 1 runs (the other process finishing first)
    _fake_fit(bench, monkeypatch, during=lambda seed: (ours / "trial0.json").write_text(
        (elsewhere / "trial0.json").read_text()))
    cell = bench._search_cell(split, 8.0, 0, points, charged=False, folder=ours, only={1})
    assert cell is not None and [t["learning_rate"] for t in cell["trials"]] == [1e-2, 4e-2]
    assert not list(ours.glob("*.part"))  # every trial file was renamed into place whole
