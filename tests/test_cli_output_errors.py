"""Bad output paths and damaged files: one `error:` line and exit status 2, nothing charged, nothing half-made
left behind (issue 18, items 1 and 7)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import privtune
from privtune.cli import main
from privtune.errors import BudgetExceededError, InvalidParameterError
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files
from privtune.training import train

AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
ROOT_REASON = ("running as root: CAP_DAC_OVERRIDE ignores directory permissions, so a read-only directory cannot be "
               "made here; the simulated-PermissionError test next to this one covers the same path")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("outerr"), {"train": ("train.tsv", 80, 0),
                                                                   "eval": ("dev.tsv", 24, 1)})


@pytest.fixture(scope="module")
def finished_run(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("fin") / "run"
    train(str(files["train"]), eval_data=str(files["eval"]), model=str(files["model"]), mode="last-layer", labels=["0", "1"],
          epsilon=2.0, delta=1e-3, steps=2, batch_size=20, seed=0, progress=False,
          ledger=f"sqlite:///{out.parent / 'l.db'}", output_dir=out)
    return out


def _train_argv(files, out, db, *extra):
    return ["train", "--data", str(files["train"]), "--eval-data", str(files["eval"]), "--model", str(files["model"]),
            "--mode", "last-layer", "--labels", "0,1", "--epsilon", "2", "--delta", "1e-3", "--steps", "2", "--batch-size", "20",
            "--ledger", f"sqlite:///{db}", "--output", str(out), "--quiet", *extra]


def _one_error_line(capsys, *words):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def _nothing_charged(db):
    if not Path(db).exists():
        return
    led = Ledger(f"sqlite:///{db}")
    for ds in led.datasets():
        assert not [e for e in led.status(ds["fingerprint"]).entries if e.charged]


# ------------------------------------------------------------------------------------------ output paths


def test_train_output_is_an_existing_file(files, tmp_path, capsys):
    out = tmp_path / "cert.json"
    out.write_text("{}")
    assert main(_train_argv(files, out, tmp_path / "l.db")) == 2
    _one_error_line(capsys, "existing file", "Nothing was charged")
    _nothing_charged(tmp_path / "l.db")
    assert out.read_text() == "{}"


@pytest.mark.parametrize("command", ["train", "tune"])
def test_a_file_named_model_in_the_output_dir_is_refused_before_the_ledger(files, tmp_path, capsys, command):
    out = tmp_path / "run"
    out.mkdir()
    (out / "model").write_text("hi")
    db = tmp_path / "l.db"
    if command == "train":
        argv = _train_argv(files, out, db)
    else:
        argv = ["tune", "--data", str(files["train"]), "--eval-data", str(files["eval"]), "--model",
                str(files["model"]), "--mode", "last-layer", "--labels", "0,1", "--strategy", "hyperfree", "--epsilon", "2", "--delta",
                "1e-3", "--ledger", f"sqlite:///{db}", "--output", str(out), "--quiet"]
    assert main(argv) == 2
    _one_error_line(capsys, "model", "Nothing was charged")
    _nothing_charged(db)


def _deny_writes_under(monkeypatch, root: Path):
    """Simulate a read-only directory (the tests run as root, which ignores permissions): creating a directory
    or opening a file for writing under ``root`` raises PermissionError."""
    real_mkdir, real_open = Path.mkdir, os.open
    root = Path(root)

    def under(p) -> bool:
        p = Path(p)
        return p == root or root in p.parents

    def mkdir(self, *a, **k):
        if under(self):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *a, **k)

    def open_(path, flags, *a, **k):
        if under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)


def test_train_read_only_output_dir_simulated(files, tmp_path, capsys, monkeypatch):
    out = tmp_path / "ro"
    out.mkdir()
    _deny_writes_under(monkeypatch, out)
    assert main(_train_argv(files, out, tmp_path / "l.db")) == 2
    _one_error_line(capsys, "cannot be written", "Nothing was charged")
    monkeypatch.undo()
    _nothing_charged(tmp_path / "l.db")
    assert list(out.iterdir()) == []


@pytest.mark.skipif(AS_ROOT, reason=ROOT_REASON)
def test_train_read_only_output_dir(files, tmp_path, capsys):  # pragma: no cover - not run as root
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert main(_train_argv(files, out, tmp_path / "l.db")) == 2
    finally:
        out.chmod(0o755)
    _one_error_line(capsys, "cannot be written")
    _nothing_charged(tmp_path / "l.db")


def test_config_init_into_a_read_only_directory_simulated(tmp_path, capsys, monkeypatch):
    real = Path.write_text

    def write_text(self, *a, **k):
        if self.parent == tmp_path / "ro":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(Path, "write_text", write_text)
    assert main(["config", "init", str(tmp_path / "ro" / "x.yaml")]) == 2
    _one_error_line(capsys, "cannot be written")


@pytest.mark.skipif(AS_ROOT, reason=ROOT_REASON)
def test_config_init_into_a_read_only_directory(tmp_path, capsys):  # pragma: no cover - not run as root
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main(["config", "init", str(ro / "x.yaml")]) == 2
    finally:
        ro.chmod(0o755)
    _one_error_line(capsys, "cannot be written")


def test_ledger_42_from_python_is_one_clear_error(files, tmp_path):
    with pytest.raises(InvalidParameterError, match="`ledger` must be a Ledger"):
        train(str(files["train"]), model=str(files["model"]), mode="last-layer", labels=["0", "1"], epsilon=1.0, delta=1e-3, steps=2,
              batch_size=20, ledger=42, output_dir=tmp_path / "y08", progress=False)
    assert not (tmp_path / "y08").exists()


# ------------------------------------------------------------------------------------ refused runs


@pytest.mark.parametrize("command", ["train", "tune"])
def test_a_run_refused_by_the_ledger_leaves_no_run_dir(files, tmp_path, command):
    db = f"sqlite:///{tmp_path / 'l.db'}"
    common = dict(eval_data=str(files["eval"]), model=str(files["model"]), mode="last-layer", labels=["0", "1"], epsilon=2.0,
                  delta=1e-3, seed=0, ledger=db)
    if command == "train":
        def run(out):
            return train(str(files["train"]), steps=2, batch_size=20, progress=False, output_dir=out, **common)
    else:
        def run(out):
            return privtune.tune(str(files["train"]), strategy="hyperfree", quiet=True, output_dir=out, **common)
    run(tmp_path / "first")  # registers the dataset with total ε = 2 and spends it
    with pytest.raises(BudgetExceededError):
        run(tmp_path / "second" / "run")
    assert not (tmp_path / "second").exists()


def test_a_bad_ledger_url_leaves_no_run_dir(files, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _train_argv(files, out, tmp_path / "l.db")
    argv[argv.index("--ledger") + 1] = "garbage://nope"
    assert main(argv) == 2
    _one_error_line(capsys)
    assert not out.exists()


# ------------------------------------------------------------------------------------ predict, report


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_predict_with_damaged_head_weights(files, finished_run, tmp_path, capsys, damage):
    m = tmp_path / "m"
    shutil.copytree(finished_run / "model", m)
    head = m / "privtune_head.safetensors"
    if damage == "missing":
        head.unlink()
    else:
        head.write_bytes(os.urandom(100))
    assert main(["predict", "--model", str(m), "--data", str(files["eval"])]) == 2
    _one_error_line(capsys, "privtune_head.safetensors")


def test_report_exits_non_zero_on_a_corrupt_certificate(finished_run, tmp_path, capsys):
    rp = tmp_path / "rp"
    rp.mkdir()
    for name in ("metrics.json", "history.json", "config.yaml"):
        shutil.copy(finished_run / name, rp / name)
    (rp / "certificate.json").write_text('{"epsilon": ')
    assert main(["report", str(rp), "--no-model-card"]) == 2
    err = capsys.readouterr().err
    assert "certificate.json" in err and "Traceback" not in err
    assert (rp / "report.html").is_file()  # still written: it names the problem too
    shutil.copy(finished_run / "certificate.json", rp / "certificate.json")
    assert main(["report", str(rp), "--no-model-card"]) == 0


# ------------------------------------------------------------------------------------ linear-scaling trials


def test_linear_scaling_refuses_an_odd_number_of_trials(files, tmp_path, capsys):
    """`--trials 3` used to run 2 trials silently: two sweeps of trials // 2 runs each."""
    argv = ["tune", "--data", str(files["train"]), "--eval-data", str(files["eval"]), "--model", str(files["model"]),
            "--mode", "last-layer", "--labels", "0,1", "--strategy", "linear-scaling", "--trials", "3", "--epsilon", "2", "--delta",
            "1e-3", "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 2
    _one_error_line(capsys, "even", "Pass 2 or 4")
    _nothing_charged(tmp_path / "l.db")


def test_linear_scaling_trials_4_runs_4_trials(files, tmp_path):
    r = privtune.tune(str(files["train"]), eval_data=str(files["eval"]), model=str(files["model"]),
                      mode="last-layer", labels=["0", "1"], strategy="linear-scaling", trials=4, epsilon=2.0, delta=1e-3, seed=0,
                      quiet=True, ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run")
    assert len(r.trials) == 4
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["trials"] == 4
