"""At the unit level the number of training rows is private: `privtune train` and `privtune tune` (text and
images) write and print N_u, the cap k and noised values, never the row count, and no duration (feature caching
and every step take time in proportion to the rows).  The data sets have a row count that appears nowhere
else (337 text rows in 41 units, 113 images in 7 units)."""

from __future__ import annotations

import re

import pytest

from privtune.cli import main
from privtune.models.testing import make_toy_text_files

TEXT_ROWS, TEXT_UNITS = 337, 41
IMAGE_ROWS, IMAGE_UNITS = 113, 7


def _count(n: int) -> re.Pattern:
    return re.compile(rf"(?<![\w.]){n}(?![\w])")  # the number alone, not inside a float, id or longer number


def _released_text(run_dir) -> dict:
    """Every file of RUN_DIR that reads as text (log, metrics, certificate, config, report, model card, …),
    the private checkpoint directory aside."""
    out = {}
    for p in run_dir.rglob("*"):
        if p.is_file() and "checkpoints" not in p.parts:
            try:
                out[str(p.relative_to(run_dir))] = p.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
    return out


def _ledger_text(db) -> str:
    """Every row of every table of the SQLite ledger, as text (the ledger is written too)."""
    import sqlite3

    con = sqlite3.connect(str(db))
    try:
        tables = [t for (t,) in con.execute("select name from sqlite_master where type='table'")]
        return "\n".join(repr(row) for t in tables for row in con.execute(f'select * from "{t}"'))
    finally:
        con.close()


def _assert_count_nowhere(n: int, run_dir, printed: str) -> None:
    files = _released_text(run_dir)
    files["<ledger>"] = _ledger_text(run_dir.parent / "l.db")
    assert "log.txt" in files and "metrics.json" in files and "certificate.json" in files and "report.html" in files
    assert any(name.endswith("README.md") for name in files)  # the model card
    # pytest's base folder (/tmp/pytest-of-USER/pytest-N/) is in the paths a run records and prints: its N is
    # pytest's run counter, not the data's, so it is taken out before the search
    base = str(run_dir.parents[1])
    texts = {name: text.replace(base, "<tmp>") for name, text in {**files, "<printed>": printed}.items()}
    where = [name for name, text in texts.items() if _count(n).search(text)]
    assert not where, f"the private row count {n} appears in {where}"
    assert not re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", files["log.txt"]), "log.txt carries the time"
    assert not re.search(r" in \d+\.\d s|done in \d+ s", files["log.txt"] + printed), "a duration is shown"


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    f = make_toy_text_files(tmp_path_factory.mktemp("rows"), {"train": ("rows.tsv", TEXT_ROWS, 0),
                                                              "eval": ("dev.tsv", 24, 1)})
    lines = open(f["train"], encoding="utf-8").read().splitlines()
    (f["root"] / "train.tsv").write_text(
        "\n".join([lines[0] + "\tuser_id"] + [f"{line}\tu{i % TEXT_UNITS}" for i, line in enumerate(lines[1:])])
        + "\n", encoding="utf-8")
    f["train"] = str(f["root"] / "train.tsv")
    return f


def _run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out + err


@pytest.mark.parametrize("command, mode", [("train", "bitfit"), ("train", "last-layer"), ("tune", "last-layer"),
                                           ("tune", "auto")])
def test_text_runs_at_the_unit_level_publish_no_row_count(capsys, text, tmp_path, command, mode):
    run = tmp_path / "run"
    argv = [command, "--data", text["train"], "--eval-data", text["eval"], "--model", str(text["model"]),
            "--epsilon", "3", "--delta", "1e-3", "--labels", "0,1", "--seed", "0", "--mode", mode,
            "--privacy-unit", "user_id", "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(run)]
    if command == "train":
        argv += ["--steps", "2", "--batch-size", "5"]
    printed = _run(capsys, argv)  # not --quiet: the progress lines are printed too
    _assert_count_nowhere(TEXT_ROWS, run, printed)
    log = (run / "log.txt").read_text(encoding="utf-8")
    assert f"N_u={TEXT_UNITS} units of user_id" in log
    if mode in ("bitfit", "auto"):  # the usefulness warning (auto: the note on its pilots) counts units
        assert f"n = N_u = {TEXT_UNITS} units (user_id)" in log and "private examples" not in log
    import json

    metrics = json.loads((run / "metrics.json").read_text())
    assert not {"train_seconds", "steps_per_second", "wall_time_s"} & set(metrics)  # NOT PRIVATE at unit level


def test_example_level_runs_still_state_the_row_count(capsys, text, tmp_path):
    run = tmp_path / "run"
    _run(capsys, ["train", "--data", text["train"], "--eval-data", text["eval"], "--model", str(text["model"]),
                  "--epsilon", "3", "--delta", "1e-3", "--labels", "0,1", "--seed", "0", "--mode", "last-layer",
                  "--steps", "2", "--batch-size", "5", "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output",
                  str(run)])
    log = (run / "log.txt").read_text(encoding="utf-8")
    assert f"N={TEXT_ROWS} " in log and f"{TEXT_ROWS} training examples" in log


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    Image = pytest.importorskip("PIL.Image")
    from privtune.models.testing import make_tiny_image_model

    base = tmp_path_factory.mktemp("imgs")
    root = base / "train"
    rows = [("file", "owner")]
    for i in range(IMAGE_ROWS):
        cls = ("cat", "dog")[i % 2]
        (root / cls).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (250 - i if cls == "cat" else 10, 10 + i % 50, 10 if cls == "cat" else 250 - i)
                  ).save(root / cls / f"{i}.png")
        rows.append((f"{cls}/{i}.png", f"o{i % IMAGE_UNITS}"))
    (root / "units.tsv").write_text("\n".join("\t".join(r) for r in rows) + "\n", encoding="utf-8")
    public = base / "public"
    for i in range(8):
        cls = ("cat", "dog")[i % 2]
        (public / cls).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (240, 20, 20) if cls == "cat" else (20, 20, 240)).save(public / cls / f"p{i}.png")
    return {"train": str(root), "public": str(public), "model": str(make_tiny_image_model(base / "vit"))}


@pytest.mark.parametrize("command, mode", [("train", "bitfit"), ("tune", "last-layer")])
def test_image_runs_at_the_unit_level_publish_no_row_count(capsys, images, tmp_path, command, mode):
    run = tmp_path / "run"
    argv = [command, "--data", images["train"], "--model", images["model"], "--epsilon", "3", "--delta", "1e-2",
            "--labels", "cat,dog", "--seed", "0", "--mode", mode, "--privacy-unit", "owner",
            "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(run)]
    argv += (["--steps", "2", "--batch-size", "2", "--eval-data", images["public"]] if command == "train"
             else ["--public-eval-data", images["public"]])
    printed = _run(capsys, argv)
    _assert_count_nowhere(IMAGE_ROWS, run, printed)
    assert f"N_u={IMAGE_UNITS} units of owner" in (run / "log.txt").read_text(encoding="utf-8")
