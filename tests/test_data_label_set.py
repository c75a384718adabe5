"""The label set is public input (issue 13 item 1; issue 18 items 4 and 5).

* the label set comes from a declaration (``labels=`` / ``--labels`` / config ``labels``), a public split or the
  model, never from the private rows: a rare private label cannot change the released model's shape;
* every split (training, eval, public, predict) must use the declared set: nothing is remapped, and missing,
  fractional and mixed labels are refused in TSV/CSV as in JSONL;
* refusals that read the private data never print a row's text or label;
* ``train --eval-data`` that overlaps the training data is refused, as in ``tune``.
"""

from __future__ import annotations

import json

import pytest

import privtune
from privtune.data import load_text_dataset
from privtune.data.datasets import check_label_set
from privtune.errors import DataError, InvalidParameterError
from privtune.ledger import Ledger
from privtune.models.testing import make_tiny_text_model, make_toy_text_dataset, write_toy_tsv
from privtune.training import train


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_text_model(tmp_path_factory.mktemp("labels") / "st", sentence_transformers=True)


def _named_rows(n: int, seed: int = 0) -> list[tuple[str, str]]:
    ds = make_toy_text_dataset(n, seed=seed)
    return [("pos" if y else "neg", t) for t, y in zip(ds.texts, ds.labels)]


def _write(path, rows, sep="\t", header=("label", "sentence")) -> str:
    path.write_text(sep.join(header) + "\n" + "".join(f"{a}{sep}{b}\n" for a, b in rows), encoding="utf-8")
    return str(path)


def _fit(data, tiny, tmp_path, **kw):
    args = dict(model=tiny, mode="last-layer", noise_multiplier=1.0, delta=1e-3, steps=1, batch_size=10, seed=0,
                ledger=f"sqlite:///{tmp_path / 'l.db'}", progress=False)
    args.update(kw)
    return train(data, **args)


def _no_ledger_entries(tmp_path) -> bool:
    return not (tmp_path / "l.db").exists() or Ledger(f"sqlite:///{tmp_path / 'l.db'}").datasets() == []


# ------------------------------------------------------------------------------ the label set is declared


def test_a_rare_private_label_does_not_change_the_released_model(tiny, tmp_path):
    rows = _named_rows(40)
    secret = "the secret neutral review"
    d = _write(tmp_path / "d.tsv", rows)
    d1 = _write(tmp_path / "d1.tsv", rows + [("neutral", secret)])
    declared = ["neg", "pos", "neutral"]
    a = _fit(d, tiny, tmp_path, labels=declared)
    b = _fit(d1, tiny, tmp_path, labels=declared)
    for r in (a, b):  # same shape and metadata whether or not the neutral row is there
        assert r.model.num_labels == 3 and r.model.label_names == declared
        assert tuple(r.model.head.weight.shape) == (3, tuple(a.model.head.weight.shape)[1])
    # with a two-class declaration the neutral row is refused, without its text or label
    with pytest.raises(DataError, match=r"row 41 .*not one of the declared labels \[neg, pos\]") as e:
        _fit(d1, tiny, tmp_path / "x", labels=["neg", "pos"])
    assert secret not in str(e.value) and "neutral" not in str(e.value)


def test_the_label_set_is_never_inferred_from_the_private_file(tiny, tmp_path, capsys):
    from privtune.cli import main

    d = _write(tmp_path / "d.tsv", _named_rows(20))
    rc = main(["train", "--data", d, "--model", str(tiny), "--mode", "last-layer", "--noise-multiplier", "1",
               "--delta", "1e-3", "--steps", "1", "--output", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--labels" in err and "not declared" in err
    assert _no_ledger_entries(tmp_path) and not (tmp_path / "run" / "model").exists()


def test_cli_and_config_take_the_label_set(tmp_path, capsys):
    from privtune.cli import main
    from privtune.config import validate_options

    for command in ("train", "tune"):
        rc = main([command, "--data", str(tmp_path / "d.tsv"), "--labels", "pos", "--mode", "last-layer",
                   "--epsilon", "1", "--output", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert rc == 2 and "`labels` must name at least two classes" in err and err.count("\n") == 1
    assert validate_options("tune", {"labels": [0, 1]})["labels"] == ["0", "1"]
    assert validate_options("train", {"labels": "neg, pos"})["labels"] == ["neg", "pos"]
    with pytest.raises(InvalidParameterError, match="labels"):
        validate_options("train", {"labels": [0.5, True]})


def test_declared_order_is_the_class_order(tmp_path):
    d = _write(tmp_path / "d.tsv", [("neg", "a b"), ("pos", "c d")])
    ds = load_text_dataset(d, labels="pos,neg")
    assert ds.labels == [1, 0] and ds.label_names == ["pos", "neg"] and ds.num_labels == 2
    ints = _write(tmp_path / "i.tsv", [("1", "a b"), ("1", "c d")])
    one_class = load_text_dataset(ints, labels=[0, 1, 2])  # absent classes are fine once declared
    assert one_class.labels == [1, 1] and one_class.num_labels == 3 and one_class.label_names is None


@pytest.mark.parametrize("labels, match", [
    (["neg"], "at least two"), ("1,2", "0..K-1 in that order"), ("1,0", "0..K-1 in that order"),
    ("0,pos", "mixes integers and names"), ("neg,neg", "twice"), ("0.5,1.5", "not a whole number"),
    ("neg,nan", "NaN-like"), (42, "list of class labels"),
])
def test_bad_label_declarations_are_refused(labels, match):
    with pytest.raises(InvalidParameterError, match=match):
        check_label_set(labels)


def test_label_set_from_the_model_or_a_public_split(tiny, tmp_path):
    from privtune.models.classifier import saved_label_set

    d = _write(tmp_path / "d.tsv", _named_rows(20))
    first = _fit(d, tiny, tmp_path, labels=["pos", "neg"], output_dir=tmp_path / "run")
    meta = json.loads((tmp_path / "run" / "model" / "privtune_classifier.json").read_text())
    assert meta["label_names"] == ["pos", "neg"] and meta["num_labels"] == 2
    (tmp_path / "again").mkdir()
    again = _fit(d, tiny, tmp_path / "again", model=tmp_path / "run" / "model")  # no labels: the model's own set
    assert again.model.label_names == ["pos", "neg"] and first.model.label_names == ["pos", "neg"]
    assert saved_label_set(tmp_path / "run") == (2, ["pos", "neg"])
    from privtune.errors import ModelError

    with pytest.raises(ModelError, match=r"classes \[pos, neg\] but the run's label set"):  # no silent reorder
        _fit(d, tiny, tmp_path / "again", model=tmp_path / "run" / "model", labels=["neg", "pos"])
    # a Hugging Face config names classes only when id2label is not transformers' LABEL_i placeholder
    cfg = json.loads((tiny / "config.json").read_text())
    assert saved_label_set(tiny) is None
    named = tmp_path / "named"
    named.mkdir()
    (named / "config.json").write_text(json.dumps(dict(cfg, id2label={"0": "negative", "1": "positive"})))
    assert saved_label_set(named) == (2, ["negative", "positive"])
    (named / "config.json").write_text(json.dumps(dict(cfg, id2label={"0": "LABEL_0", "1": "LABEL_1"})))
    assert saved_label_set(named) is None
    # tune: the public split declares the label set; the private rows must be in it
    pub = _write(tmp_path / "pub.tsv", _named_rows(10, seed=3))
    ints = write_toy_tsv(tmp_path / "ints.tsv", make_toy_text_dataset(20, seed=4))
    with pytest.raises(DataError, match="declared labels are the names \\[neg, pos\\]"):
        privtune.tune(ints, public_eval_data=pub, model=tiny, mode="last-layer", strategy="single-step",
                      epsilon=1.0, delta=1e-3, ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "t",
                      quiet=True)


def test_single_class_private_file_is_not_refused(tiny, tmp_path):
    d = _write(tmp_path / "d.tsv", [("pos", f"good film {i}") for i in range(12)])
    r = _fit(d, tiny, tmp_path, labels=["neg", "pos"])
    assert r.model.num_labels == 2 and r.model.label_names == ["neg", "pos"]


# ------------------------------------------------------------------------------ every format, every split


BAD_COLUMNS = {
    "fraction": (["0.5", "1.5", "0.5", "1.5"], "not a whole number"),
    "mixed": (["0", "1", "pos", "1"], "mixes integer labels .* and class names"),
    "nan": (["0", "1", "nan", "1"], "empty value"),
    "NaN": (["0", "NaN", "1", "1"], "empty value"),
    "null": (["0", "1", "1", "null"], "empty value"),
    "None": (["None", "1", "0", "1"], "empty value"),
}


@pytest.mark.parametrize("suffix, sep", [(".tsv", "\t"), (".csv", ",")])
@pytest.mark.parametrize("case", sorted(BAD_COLUMNS))
def test_bad_label_columns_are_refused_in_tsv_and_csv_like_jsonl(tmp_path, suffix, sep, case):
    values, match = BAD_COLUMNS[case]
    texts = [f"private sentence number {i}" for i in range(len(values))]
    table = _write(tmp_path / f"d{suffix}", list(zip(values, texts)), sep=sep)
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"label": v, "sentence": t}) + "\n" for v, t in zip(values, texts)))
    for path in (table, jsonl):
        for kw in ({}, {"labels": [0, 1]}):  # with or without a declared label set
            with pytest.raises(DataError, match=match) as e:
                load_text_dataset(path, **kw)
            assert not any(t in str(e.value) for t in texts)


def test_train_refuses_bad_private_labels_before_any_budget(tiny, tmp_path, capsys):
    from privtune.cli import main

    values = ["0.5", "1.5"] * 10
    d = _write(tmp_path / "float.tsv", [(v, f"some text {i}") for i, v in enumerate(values)])
    rc = main(["train", "--data", d, "--labels", "0,1", "--model", str(tiny), "--mode", "last-layer",
               "--noise-multiplier", "1", "--delta", "1e-3", "--steps", "1", "--output", str(tmp_path / "r"),
               "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "whole number" in err and "0.5" not in err
    assert _no_ledger_entries(tmp_path)


def test_eval_labels_are_never_remapped(tiny, tmp_path):
    train_ints = write_toy_tsv(tmp_path / "train.tsv", make_toy_text_dataset(20, seed=0))
    eval_names = _write(tmp_path / "dev_names.tsv", _named_rows(10, seed=1))
    with pytest.raises(DataError, match="holds class names, but the declared classes are the integer"):
        _fit(train_ints, tiny, tmp_path, labels=[0, 1], eval_data=eval_names)
    eval_ints = write_toy_tsv(tmp_path / "dev_ints.tsv", make_toy_text_dataset(10, seed=1))
    train_names = _write(tmp_path / "train_names.tsv", _named_rows(20))
    with pytest.raises(DataError, match="integer class indices, but the declared labels are the names"):
        _fit(train_names, tiny, tmp_path, labels=["neg", "pos"], eval_data=eval_ints)
    assert _no_ledger_entries(tmp_path)


def test_predict_refuses_labels_the_model_does_not_know(tiny, tmp_path, capsys):
    from privtune.cli import main
    from privtune.models import load_classifier

    int_model = load_classifier(tiny, num_labels=2).save_pretrained(tmp_path / "int_model")
    named_model = load_classifier(tiny, num_labels=2, label_names=["neg", "pos"]).save_pretrained(tmp_path / "named")
    names = _write(tmp_path / "names.tsv", _named_rows(6))
    unknown = _write(tmp_path / "unknown.tsv", _named_rows(6) + [("neutral", "a plain film")])
    ints = write_toy_tsv(tmp_path / "ints.tsv", make_toy_text_dataset(6))
    for model, data, match in ((int_model, names, "holds class names"), (named_model, unknown, "not one of"),
                               (named_model, ints, "holds integer class indices")):
        rc = main(["predict", "--model", str(model), "--data", data, "--json"])
        out = capsys.readouterr()
        assert rc == 2 and match in out.err and out.out == "" and out.err.count("\n") == 1
        assert "neutral" not in out.err and "a plain film" not in out.err
    assert main(["predict", "--model", str(named_model), "--data", names, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 6


# ------------------------------------------------------------------------------ overlap checks


def test_train_refuses_eval_data_that_overlaps_the_training_data(tiny, tmp_path):
    ds = make_toy_text_dataset(20, seed=0)
    d = write_toy_tsv(tmp_path / "train.tsv", ds)
    with pytest.raises(DataError, match="`eval_data` overlaps the training data: 20 example") as e:
        _fit(d, tiny, tmp_path, labels=[0, 1], eval_data=d)
    assert not any(t in str(e.value) for t in ds.texts)
    assert _no_ledger_entries(tmp_path)


def test_tune_overlap_refusal_prints_no_private_text(tiny, tmp_path):
    ds = make_toy_text_dataset(20, seed=0)
    d = write_toy_tsv(tmp_path / "train.tsv", ds)
    part = write_toy_tsv(tmp_path / "pub.tsv", make_toy_text_dataset(20, seed=0).subset(range(3)))
    with pytest.raises(DataError, match="overlaps the training data: 3 example") as e:
        privtune.tune(d, public_eval_data=part, model=tiny, mode="last-layer", strategy="single-step", epsilon=1.0,
                      delta=1e-3, ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "t", quiet=True)
    assert not any(t.strip() in str(e.value) for t in ds.texts)
    assert _no_ledger_entries(tmp_path)


def test_model_card_lists_the_label_set_as_public(tmp_path):
    from privtune.report.model_card import _public_items
    from privtune.report.run import RunData

    items = _public_items(RunData(run_dir=tmp_path, config={"labels": ["neg", "pos"]}), "the base model")
    assert any("label set (neg, pos)" in item for item in items)
