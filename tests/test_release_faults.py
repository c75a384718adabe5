"""Fault injection at every stage boundary of a run: ε is charged exactly once (never zero once data was
touched), and one documented command (`--resume`) brings the run to its released model.

The stages (PRIVTUNE_TEST_FAULT, read only by privtune._release.fault_point) are, in order: after the ledger
reservation, mid-training (after a checkpoint), after the last step, while writing each released file into
the staging directory, after moving the model / the certificate into RUN_DIR, while writing the report, and
after the ledger commit.  `STAGE` raises there; `STAGE@kill` sends SIGKILL to the process there (no finally,
no except, no atexit), in a forked child (fork: no second import of torch, so the kills stay fast).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import traceback

import pytest
import torch

import privtune
from privtune._release import FAULT_ENV, STAGING_DIR, InjectedFault
from privtune.errors import InvalidParameterError
from privtune.hpo.tune import STATE_FILE
from privtune.ledger import Ledger, dataset_fingerprint
from privtune.models.testing import make_toy_text_files
from privtune.training import train

TRAIN_STAGES = ["after-reserve", "mid-training", "after-last-step", "write-model", "write-metrics.json",
                "write-history.json", "write-config.yaml", "write-certificate.json", "publish-model",
                "publish-certificate.json", "write-report", "after-commit"]
TRAIN_KILLS = TRAIN_STAGES


def _stub_report(run_dir):
    """The report's plots take seconds (matplotlib); these tests are about when files are written, not what
    the report shows (the reference runs write the real one)."""
    out = os.path.join(run_dir, "report.html")
    with open(out, "w", encoding="utf-8") as f:
        f.write("<html>stub</html>")
    return out


@pytest.fixture(autouse=True)
def _fast_report(monkeypatch):
    import privtune.report

    monkeypatch.setattr(privtune.report, "write_report", _stub_report)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("faults"), {"train": ("train.tsv", 80, 0),
                                                                   "eval": ("dev.tsv", 24, 1)})


# The kill tests fork a child; a child of a process that has initialised CUDA cannot use CUDA, so every run here
# stays on the CPU (what these tests check is the ledger and the release, not the device).
def _train_args(files, tmp_path) -> dict:
    return dict(device="cpu", eval_data=str(files["eval"]), model=str(files["model"]), mode="last-layer", labels=["0", "1"],
                epsilon=2.0, delta=1e-3, steps=3, batch_size=20, seed=0, progress=False,
                ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=str(tmp_path / "run"))


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory):
    """An uninterrupted run: what every interrupted-then-resumed run must end up releasing and charging."""
    tmp = tmp_path_factory.mktemp("ref")
    r = train(str(files["train"]), **_train_args(files, tmp))
    used = Ledger(f"sqlite:///{tmp / 'l.db'}").status(r.metrics["dataset_id"]).used_epsilon
    # each ledger gives the dataset its own random id: the runs under test find it by the file's content
    return r, used, dataset_fingerprint(files["train"])


def _charged(url, fp):
    st = Ledger(url).status(fp)
    return [e for e in st.entries if e.charged], st.used_epsilon


def _check_finished(res, reference, url, run):
    ref, ref_used, fp = reference
    charged, used = _charged(url, fp)
    assert len(charged) == 1 and charged[0].state == "committed"  # charged exactly once
    assert used == pytest.approx(ref_used, rel=1e-9) and used > 0
    for name in ("model/config.json", "model/privtune_head.safetensors", "certificate.json", "metrics.json",
                 "history.json", "config.yaml", "report.html"):
        assert (run / name).is_file(), name
    assert not (run / "checkpoints").exists() and not (run / STAGING_DIR).exists()
    assert json.loads((run / "certificate.json").read_text())["epsilon"] == pytest.approx(ref.certificate.epsilon)
    a, b = ref.model.state_dict(), res.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same release as the uninterrupted run
    assert res.metrics["accuracy"] == ref.metrics["accuracy"]


def _check_interrupted(reference, url, stage):
    ref, ref_used, fp = reference
    charged, used = _charged(url, fp)
    assert len(charged) == 1 and used == pytest.approx(ref_used, rel=1e-9)  # charged: data may have been read
    assert charged[0].state == ("committed" if stage == "after-commit" else "reserved")


@pytest.mark.parametrize("stage", TRAIN_STAGES)
def test_train_failure_at_each_stage_then_resume(files, tmp_path, monkeypatch, reference, stage):
    args = _train_args(files, tmp_path)
    monkeypatch.setenv(FAULT_ENV, stage)
    with pytest.raises(InjectedFault):
        train(str(files["train"]), **args)
    _check_interrupted(reference, args["ledger"], stage)
    monkeypatch.delenv(FAULT_ENV)
    with pytest.raises(InvalidParameterError, match="--resume"):  # a plain rerun may not start over it
        train(str(files["train"]), **args)
    res = train(str(files["train"]), resume=True, **args)
    _check_finished(res, reference, args["ledger"], tmp_path / "run")
    with pytest.raises(InvalidParameterError, match="no checkpoint"):  # finished: nothing left to resume
        train(str(files["train"]), resume=True, **args)


def _killed_at(stage, run, *args, **kwargs) -> None:
    """Run ``run(*args, **kwargs)`` in a forked child that gets SIGKILL at ``stage``; the child must die there."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.environ[FAULT_ENV] = f"{stage}@kill"
            run(*args, **kwargs)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(3)  # reached only when the kill did not happen
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child exited with status {status}"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill tests fork a child (POSIX only)")
@pytest.mark.parametrize("stage", TRAIN_KILLS)
def test_train_killed_at_each_stage_then_resume(files, tmp_path, reference, stage):
    args = _train_args(files, tmp_path)
    _killed_at(stage, train, str(files["train"]), **args)
    _check_interrupted(reference, args["ledger"], stage)
    res = train(str(files["train"]), resume=True, **args)
    _check_finished(res, reference, args["ledger"], tmp_path / "run")


def test_cli_resume_is_the_one_command(files, tmp_path, monkeypatch, reference, capsys):
    """The documented command: the same `privtune train` line with --resume."""
    from privtune.cli import main

    a = _train_args(files, tmp_path)
    argv = ["train", "--data", str(files["train"]), "--eval-data", a["eval_data"], "--model", a["model"],
            "--mode", "last-layer", "--labels", "0,1", "--epsilon", "2", "--delta", "1e-3", "--steps", "3", "--batch-size", "20",
            "--seed", "0", "--ledger", a["ledger"], "--output", a["output_dir"], "--quiet"]
    monkeypatch.setenv(FAULT_ENV, "publish-model")
    with pytest.raises(InjectedFault):
        main(argv)
    monkeypatch.delenv(FAULT_ENV)
    assert main(argv) == 2 and "--resume" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 0
    charged, used = _charged(a["ledger"], dataset_fingerprint(files["train"]))
    assert len(charged) == 1 and used == pytest.approx(reference[1], rel=1e-9)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill tests fork a child (POSIX only)")
def test_train_killed_before_its_first_checkpoint_resumes_without_a_second_charge(files, tmp_path, reference):
    """Item 2: the run id and a step-0 state exist from the reservation on (before: `--resume` found no
    checkpoint and the rerun opened a second reservation)."""
    args = _train_args(files, tmp_path)
    _killed_at("after-reserve", train, str(files["train"]), **args)
    ckpt = tmp_path / "run" / "checkpoints" / "checkpoint.pt"
    assert ckpt.is_file() and torch.load(ckpt, weights_only=False)["step"] == 0
    res = train(str(files["train"]), resume=True, **args)
    _check_finished(res, reference, args["ledger"], tmp_path / "run")


# ----------------------------------------------------------------------------------------------- tune


TUNE_STAGES = ["after-reserve", "after-last-step", "write-model", "write-certificate.json", "publish-model",
               "write-report", "after-commit"]


def _tune_args(files, tmp_path) -> dict:
    return dict(device="cpu", eval_data=str(files["eval"]), model=str(files["model"]), mode="last-layer", strategy="hyperfree",
                labels=["0", "1"], epsilon=2.0, delta=1e-3, seed=0, quiet=True, ledger=f"sqlite:///{tmp_path / 'l.db'}",
                output_dir=str(tmp_path / "run"))


@pytest.fixture(scope="module")
def tune_reference(files, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tref")
    r = privtune.tune(str(files["train"]), **_tune_args(files, tmp))
    used = Ledger(f"sqlite:///{tmp / 'l.db'}").status(r.metrics["dataset_id"]).used_epsilon
    # each ledger gives the dataset its own random id: the runs under test find it by the file's content
    return r, used, dataset_fingerprint(files["train"])


def _check_tune_finished(res, tune_reference, url, run):
    ref, ref_used, fp = tune_reference
    charged, used = _charged(url, fp)
    assert len(charged) == 1 and charged[0].state == "committed"
    assert used == pytest.approx(ref_used, rel=1e-9) and used > 0
    for name in ("model/config.json", "certificate.json", "metrics.json", "history.json", "config.yaml"):
        assert (run / name).is_file(), name
    assert not (run / STATE_FILE).exists() and not (run / STAGING_DIR).exists()
    assert res.certificate.epsilon == ref.certificate.epsilon and res.accuracy == ref.accuracy


@pytest.mark.parametrize("stage", TUNE_STAGES)
def test_tune_failure_at_each_stage_then_resume(files, tmp_path, monkeypatch, tune_reference, stage):
    args = _tune_args(files, tmp_path)
    monkeypatch.setenv(FAULT_ENV, stage)
    with pytest.raises(InjectedFault):
        privtune.tune(str(files["train"]), **args)
    _check_interrupted(tune_reference, args["ledger"], stage)
    monkeypatch.delenv(FAULT_ENV)
    res = privtune.tune(str(files["train"]), resume=True, **args)
    _check_tune_finished(res, tune_reference, args["ledger"], tmp_path / "run")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill tests fork a child (POSIX only)")
@pytest.mark.parametrize("stage", ["publish-model", "after-commit"])
def test_tune_killed_then_resume(files, tmp_path, tune_reference, stage):
    args = _tune_args(files, tmp_path)
    _killed_at(stage, privtune.tune, str(files["train"]), **args)
    _check_interrupted(tune_reference, args["ledger"], stage)
    res = privtune.tune(str(files["train"]), resume=True, **args)
    _check_tune_finished(res, tune_reference, args["ledger"], tmp_path / "run")


# ------------------------------------------------------------------------------------- file modes


def test_private_state_is_0600_in_0700_directories_whatever_the_umask(files, tmp_path, monkeypatch):
    """Checkpoints hold the noise generator's state; the staging directory holds the unreleased model."""
    old = os.umask(0o022)
    try:
        args = _train_args(files, tmp_path)
        monkeypatch.setenv(FAULT_ENV, "write-certificate.json")  # stop with checkpoint and staging in place
        with pytest.raises(InjectedFault):
            train(str(files["train"]), **args)
    finally:
        os.umask(old)
    run = tmp_path / "run"

    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(run / "checkpoints") == 0o700
    assert mode(run / "checkpoints" / "checkpoint.pt") == 0o600
    assert mode(run / STAGING_DIR) == 0o700
    for p in (run / STAGING_DIR).iterdir():
        assert mode(p) == 0o700, p


def test_tune_state_file_is_0600_even_if_it_existed_with_more(tmp_path):
    from privtune.hpo._resume import _write_state_lines

    path = tmp_path / STATE_FILE
    path.write_text("")
    os.chmod(path, 0o644)
    _write_state_lines(path, [{"x": 1}])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_full_disk_while_writing_is_one_error_and_resume_finishes(files, tmp_path, monkeypatch, reference, capsys):
    """A full disk while writing the release: one `error:` line naming --resume, the reservation stays charged
    (not committed, never refunded), and --resume writes the files without a second charge."""
    import errno

    import privtune.run.release as pipeline
    from privtune.cli import main

    real = pipeline.write_json

    def full_disk(path, obj, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    a = _train_args(files, tmp_path)
    argv = ["train", "--data", str(files["train"]), "--eval-data", a["eval_data"], "--model", a["model"],
            "--mode", "last-layer", "--labels", "0,1", "--epsilon", "2", "--delta", "1e-3", "--steps", "3", "--batch-size", "20",
            "--seed", "0", "--ledger", a["ledger"], "--output", a["output_dir"], "--quiet"]
    monkeypatch.setattr(pipeline, "write_json", full_disk)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--resume" in err and "No space" in err
    _check_interrupted(reference, a["ledger"], "write-metrics.json")
    assert not (tmp_path / "run" / "certificate.json").exists()
    monkeypatch.setattr(pipeline, "write_json", real)
    res = train(str(files["train"]), resume=True, **a)
    _check_finished(res, reference, a["ledger"], tmp_path / "run")
