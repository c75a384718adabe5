"""privtune.run.pipeline: every budget-spending command (train, tune, and the training run of the black-box
audit) goes through one function, `execute`, and the same stage functions in the same order."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import privtune
from privtune.audit import AuditSpec, audit
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files
from privtune.run import budget as run_budget
from privtune.run import pipeline as run_pipeline
from privtune.run import release as run_release

SRC = Path(privtune.__file__).resolve().parent


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("run"), {
        "train": ("train.tsv", 60, 0), "public": ("public.tsv", 30, 1), "dev": ("dev.tsv", 30, 2)})


@pytest.fixture
def calls(monkeypatch):
    """Every stage function of run.pipeline (and the one reservation path of run.budget) replaced by a spy
    that records (stage, job class) and calls the real one."""
    seen: list = []

    def spy(name, real):
        def stage(*args, **kwargs):
            job = args[0] if args and hasattr(args[0], "command") else None
            seen.append((name, type(job).__name__ if job is not None else None))
            return real(*args, **kwargs)
        return stage

    for name in run_pipeline.STAGES:
        monkeypatch.setattr(run_pipeline, name, spy(name, getattr(run_pipeline, name)))
    monkeypatch.setattr(run_budget, "reserve", spy("ledger", run_budget.reserve))
    return seen


def _stages(seen):
    return [name for name, _ in seen if name != "ledger"]


def test_train_goes_through_every_stage_in_order(files, tmp_path, calls):
    r = privtune.train(files["train"], eval_data=files["dev"], model=files["model"], mode="bitfit", epsilon=2.0,
                       delta=1e-3, steps=2, batch_size=20, ledger=f"sqlite:///{tmp_path / 'l.db'}",
                       output_dir=tmp_path / "run", progress=False, labels=[0, 1])
    assert _stages(calls) == list(run_pipeline.STAGES)
    assert r.run_dir == r.output_dir == tmp_path / "run"  # train's result names the folder as tune's does
    assert {job for name, job in calls if name in ("load", "plan", "certify")} == {"TrainJob"}
    assert [n for n, _ in calls].count("ledger") == 1  # the one reservation path


def test_tune_goes_through_the_same_stages(files, tmp_path, calls):
    r = privtune.tune(files["train"], eval_data=files["dev"], public_eval_data=files["public"],
                      model=files["model"], mode="last-layer", epsilon=2.0, delta=1e-3,
                      ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run", quiet=True,
                      strategy="hyperfree", labels=[0, 1], steps=2, batch_size=20)
    assert _stages(calls) == list(run_pipeline.STAGES)
    assert {job for name, job in calls if name in ("load", "plan", "certify")} == {"TuneJob"}
    assert [n for n, _ in calls].count("ledger") == 1
    # one split name for both commands: the release names the reported split by its file name, never a path
    metrics = json.loads((r.run_dir / "metrics.json").read_text())
    assert metrics["reported_split"] == "dev.tsv"
    assert r.certificate.metadata["reported_split"] == "dev.tsv"


def test_the_black_box_audit_trains_through_the_same_stages(files, tmp_path, calls):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    led = Ledger(url)
    led.init_dataset(files["train"], 10.0, 1e-3)
    spec = AuditSpec.create(whitebox=False, mode="bitfit", epsilon=2.0, delta=1e-3, steps=2, batch_size=20,
                            num_canaries=10, seed=0)
    audit(files["train"], spec, model=files["model"], ledger=url, labels=[0, 1])
    assert _stages(calls) == list(run_pipeline.STAGES)
    assert {job for name, job in calls if name == "certify"} == {"TrainJob"}


def test_a_refused_reservation_stops_before_run(files, tmp_path, calls):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    Ledger(url).init_dataset(files["train"], 0.5, 1e-3)  # less than the run asks for
    with pytest.raises(privtune.errors.PrivtuneError):
        privtune.train(files["train"], model=files["model"], mode="bitfit", epsilon=2.0, delta=1e-3, steps=2,
                       batch_size=20, ledger=url, output_dir=tmp_path / "run", progress=False, labels=[0, 1])
    assert _stages(calls) == ["load", "plan", "prepare", "reserve"]
    assert not (tmp_path / "run").exists()  # nothing charged, nothing left behind


def test_split_name_publishes_file_names_only(tmp_path):
    assert run_release.split_name(tmp_path / "data" / "dev.tsv") == "dev.tsv"
    assert run_release.split_name(str(tmp_path / "dev.tsv")) == "dev.tsv"

    class InMemory:
        source = "my split"

    assert run_release.split_name(InMemory()) == "my split"
    assert run_release.split_name(object(), "eval_data") == "eval_data"


def test_effective_config_writes_in_memory_objects_as_a_loud_placeholder(tmp_path):
    config, unsaved = run_release.effective_config(
        {"data": object(), "model": tmp_path / "m", "steps": 3, "seed": None}, path_keys=("data", "model"))
    assert unsaved == ["data"] and config["data"].startswith("<in-memory object")
    assert config["model"] == str(tmp_path / "m") and config["steps"] == 3 and "seed" not in config


# the stage work that exists once, in run/: no command module does it itself
_ONCE = {
    "from_events": "the certificate (run.pipeline.certify)",
    "write_release": "the RUN_DIR writer (run.pipeline.write)",
    "register_dataset": "the ledger registration (run.budget)",
    "ensure_dataset": "the ledger registration (run.budget)",
}


def test_no_command_certifies_writes_or_registers_on_its_own():
    offenders = []
    for path in (SRC / "training.py", SRC / "hpo" / "tune.py", SRC / "audit" / "blackbox.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _ONCE:
                offenders.append(f"{path.name}:{node.lineno} {node.func.attr} ({_ONCE[node.func.attr]})")
    assert not offenders, offenders
    assert not (SRC / "training.py").read_text().count("_RELEASED_FILES")
    assert not (SRC / "hpo" / "tune.py").read_text().count("_RELEASED_FILES")
