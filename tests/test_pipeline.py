"""The run stages shared by train and tune (issue 14 item 2): one ledger registration built on
Ledger.ensure_dataset, one JSON and one log writer, and the certificate inside the released model/."""

from __future__ import annotations

import json
import re

import pytest

import privtune
from privtune import pipeline
from privtune.errors import LedgerError
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files
from privtune.training import train


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("pipeline"), {
        "train": ("train.tsv", 80, 0), "public": ("public.tsv", 30, 1), "dev": ("dev.tsv", 30, 2)})


def test_train_release_carries_the_certificate_inside_model(files, tmp_path):
    out = train(files["train"], eval_data=files["dev"], model=files["model"], mode="bitfit", epsilon=2.0,
                delta=1e-3, steps=2, batch_size=20, learning_rate=1e-2, ledger=f"sqlite:///{tmp_path / 'l.db'}",
                output_dir=tmp_path / "run", progress=False, labels=[0, 1]).output_dir
    inside = out / "model" / "certificate.json"
    assert inside.is_file()
    assert json.loads(inside.read_text()) == json.loads((out / "certificate.json").read_text())


def test_tune_release_carries_the_certificate_inside_model(files, tmp_path):
    r = privtune.tune(files["train"], eval_data=files["dev"], public_eval_data=files["public"], model=files["model"],
                      mode="last-layer", epsilon=2.0, delta=1e-3, ledger=f"sqlite:///{tmp_path / 'l.db'}",
                      output_dir=tmp_path / "run", quiet=True, strategy="hyperfree", labels=[0, 1], steps=2,
                      batch_size=20)
    inside = r.run_dir / "model" / "certificate.json"
    assert inside.is_file()
    assert json.loads(inside.read_text()) == json.loads((r.run_dir / "certificate.json").read_text())


def test_register_dataset_registers_once_with_the_runs_total(tmp_path):
    led = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    st, new = pipeline.register_dataset(led, "a" * 64, total_epsilon=3.0, delta=1e-5, name=None, command="train")
    assert new and st.total_epsilon == 3.0 and st.delta == 1e-5
    st2, new2 = pipeline.register_dataset(led, "a" * 64, total_epsilon=9.0, delta=1e-5, name=None, command="tune")
    assert not new2 and st2.total_epsilon == 3.0  # a later run's ε is not a new total
    assert st2.dataset_id == st.dataset_id


def test_register_dataset_keeps_the_clear_error_for_a_taken_name(tmp_path):
    led = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    pipeline.register_dataset(led, "a" * 64, total_epsilon=3.0, delta=1e-5, name="sst2", command="train")
    with pytest.raises(LedgerError) as e:
        pipeline.register_dataset(led, "b" * 64, total_epsilon=3.0, delta=1e-5, name="sst2", command="train")
    assert "sst2" in str(e.value)


def test_write_json_and_run_log(tmp_path):
    pipeline.write_json(tmp_path / "m.json", {"b": 1, "a": tmp_path}, sort_keys=True)
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": str(tmp_path), "b": 1}
    assert not list(tmp_path.glob("*.tmp"))
    log = pipeline.run_log(tmp_path / "log.txt")
    log("one")
    log("two")
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert [re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d  ", "", x) for x in lines] == ["one", "two"]
    pipeline.run_log(None)("nothing")  # no RUN_DIR: a no-op
