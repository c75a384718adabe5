"""`privtune train/tune --privacy-unit COLUMN` on prompt → response data (tiny random causal LMs): the runs
sample units through the one unit code, the certificate names the unit and `privtune account` re-verifies it, the
ledger records it, a public split sharing a unit is refused before any charge, and the number of rows (157 here,
in 9 senders) appears in no written or printed file."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("sacrebleu")
pytest.importorskip("rouge_score")

from privtune.cli import main  # noqa: E402
from privtune.ledger import Ledger  # noqa: E402
from privtune.models.testing_causal_lm import make_tiny_causal_lm  # noqa: E402

PAIRS = [("hello how are you ?", "i am fine thanks ."), ("what do you like to eat ?", "italian food !"),
         ("are you good ?", "yes , thanks"), ("hello", "hello how are you ?")]
ROWS, SENDERS = 157, 9


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen-unit")
    make_tiny_causal_lm(d / "llama", arch="llama")
    train = [{"prompt": f"{PAIRS[i % 4][0]} {i % 5}", "response": PAIRS[i % 4][1], "sender": f"s{i % SENDERS}",
              "row": f"r{i}"} for i in range(ROWS)]
    return {"train": _write(d / "train.jsonl", train), "llama": str(d / "llama"),
            "public": _write(d / "public.jsonl", [{"prompt": f"{p} the", "response": r, "sender": f"p{i}"}
                                                  for i, (p, r) in enumerate(PAIRS)]),
            "public_shared": _write(d / "public_shared.jsonl", [{"prompt": f"{p} the", "response": r,
                                                                 "sender": "s3" if i == 2 else f"p{i}"}
                                                                for i, (p, r) in enumerate(PAIRS)]),
            "test": _write(d / "test.jsonl", [{"prompt": f"{p} a", "response": r} for p, r in PAIRS])}


def _run(capsys, argv):
    code = main([str(a) for a in argv])
    got = capsys.readouterr()
    return code, got.out + got.err


def _no_row_count(run, printed):
    count = re.compile(rf"(?<![\w.]){ROWS}(?![\w])")
    for p in run.rglob("*"):
        if p.is_file() and "checkpoints" not in p.parts:
            try:
                text = p.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            assert not count.search(text), f"the row count appears in {p.relative_to(run)}"
    assert not count.search(printed), "the row count is printed"


def _certified_at_unit_level(capsys, run, db):
    cert = json.loads((run / "certificate.json").read_text())
    assert cert["neighbouring"] == "add/remove all rows of one sender"
    assert all(e["sample_rate"] == pytest.approx(3 / SENDERS) for e in cert["events"])  # q = B/N_u
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["hyperparameters"]["privacy_unit"] == {"unit": "sender", "column": "sender",
                                                          "max_rows_per_unit": 2, "num_units": SENDERS}
    assert main(["account", "--certificate", str(run / "certificate.json")]) == 0
    shown = capsys.readouterr().out
    assert "VERIFIED" in shown and "adding or removing all rows of one sender" in shown
    entries = Ledger(f"sqlite:///{db}").status(metrics["dataset_id"]).entries
    assert [e.privacy_unit for e in entries] == ["sender"]
    assert f"N_u={SENDERS} units of sender" in (run / "log.txt").read_text(encoding="utf-8")
    import yaml

    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["privacy_unit"] == "sender" and config["max_rows_per_unit"] == 2


def test_train_generation_at_the_unit_level(capsys, files, tmp_path):
    run, db = tmp_path / "run", tmp_path / "l.db"
    code, printed = _run(capsys, ["train", "--data", files["train"], "--eval-data", files["test"], "--model",
                                  files["llama"], "--epsilon", "8", "--delta", "1e-2", "--steps", "2",
                                  "--batch-size", "3", "--privacy-unit", "sender", "--max-rows-per-unit", "2",
                                  "--seed", "0", "--ledger", f"sqlite:///{db}", "--output", str(run)])
    assert code == 0, printed
    _no_row_count(run, printed)
    _certified_at_unit_level(capsys, run, db)


def test_tune_generation_at_the_unit_level(capsys, files, tmp_path):
    run, db = tmp_path / "run", tmp_path / "l.db"
    code, printed = _run(capsys, ["tune", "--data", files["train"], "--eval-data", files["test"],
                                  "--public-eval-data", files["public"], "--model", files["llama"], "--mode", "lora",
                                  "--strategy", "random-search", "--trials", "2", "--epsilon", "8", "--delta", "1e-2",
                                  "--epochs", "1", "--batch-size", "3", "--privacy-unit", "sender",
                                  "--max-rows-per-unit", "2", "--seed", "0", "--ledger", f"sqlite:///{db}",
                                  "--output", str(run)])
    assert code == 0, printed
    _no_row_count(run, printed)
    _certified_at_unit_level(capsys, run, db)
    assert json.loads((run / "certificate.json").read_text())["metadata"]["privacy_unit"]["num_units"] == SENDERS


@pytest.mark.parametrize("argv", [
    ["tune", "--public-eval-data", "{public_shared}", "--trials", "2", "--strategy", "random-search"],
    ["train", "--eval-data", "{public_shared}", "--steps", "1"],
    ["tune", "--public-eval-data", "{public}", "--trials", "2", "--strategy", "random-search", "--delta", "0.2"],
])
def test_generation_unit_refusals_come_before_any_charge(capsys, files, tmp_path, argv):
    argv = [a.format(**files) for a in argv]
    db = tmp_path / "l.db"
    code, printed = _run(capsys, [*argv, "--data", files["train"], "--model", files["llama"], "--mode", "lora",
                                  "--epsilon", "8", "--batch-size", "3", "--privacy-unit", "sender", "--quiet",
                                  *([] if "--delta" in argv else ["--delta", "1e-2"]),
                                  "--ledger", f"sqlite:///{db}", "--output", str(tmp_path / "run")])
    assert code != 0 and "Traceback" not in printed
    assert ("shares privacy units" in printed and "s3" not in printed) or "not below 1/N_u = 1/9" in printed, printed
    assert not db.exists() or not Ledger(f"sqlite:///{db}").datasets()
    assert not (tmp_path / "run" / "certificate.json").exists()


def test_one_row_per_unit_fits_the_example_level_generator(files):
    """With a unit per row, fitting a generator at the unit level (NoiseSpec(privacy_unit=...), the one unit
    code) is the example-level fit, bit for bit (same start and seed); with 9 senders it is not."""
    import copy

    from privtune.data.generation import load_generation_dataset
    from privtune.models.generator import apply_generation_mode, load_generator
    from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec
    from privtune.tasks.generation import Generation
    from privtune.training import fit

    data = load_generation_dataset(files["train"])
    start = load_generator(files["llama"], max_length=32)
    apply_generation_mode(start, "lora")

    def fitted(**unit):
        model = copy.deepcopy(start)
        fit(model, data, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.1, steps=2, **unit),
            optimizer=OptimizerSpec(learning_rate=1e-2), clipping=ClippingSpec(clip=1.0),
            options=LoopOptions(seed=0), device="cpu", task=Generation())
        return model.state_dict()

    rows = fitted()
    per_row = fitted(privacy_unit=list(range(ROWS)), max_rows_per_unit=1)
    assert all(torch.equal(rows[k], per_row[k]) for k in rows)
    senders = fitted(privacy_unit=[i % SENDERS for i in range(ROWS)], max_rows_per_unit=2)
    assert any(not torch.equal(rows[k], senders[k]) for k in rows)
