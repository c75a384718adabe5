"""A full disk after the ledger reservation (the model's safetensors writer, a checkpoint, tune's state file) is
one `error:` line that says what failed and that --resume finishes the run; the reservation stays charged once
and --resume completes it without a second charge."""

from __future__ import annotations

import errno

import pytest
from safetensors import SafetensorError

import privtune.run.release as pipeline
from privtune import _release
from privtune.cli import main
from privtune.errors import UnknownDatasetError
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("disk"), {"train": ("train.tsv", 60, 0),
                                                                  "eval": ("dev.tsv", 20, 1)})


def _argv(files, tmp_path) -> list[str]:
    return ["train", "--data", str(files["train"]), "--eval-data", str(files["eval"]), "--model", str(files["model"]),
            "--mode", "last-layer", "--labels", "0,1", "--epsilon", "2", "--delta", "1e-3", "--steps", "3",
            "--batch-size", "20", "--seed", "0", "--ledger", f"sqlite:///{tmp_path / 'l.db'}",
            "--output", str(tmp_path / "run"), "--quiet"]


def _actions(files, tmp_path) -> list[str]:
    return [r.action for r in Ledger(f"sqlite:///{tmp_path / 'l.db'}").history(files["train"])]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "--resume" in err and "No space left on device" in err
    return err


def test_safetensors_full_disk_during_the_release(files, tmp_path, monkeypatch, capsys):
    def full_disk(run_dir, model, certificate):
        # what safetensors raises on a full disk: not an OSError
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    real = pipeline.write_model
    monkeypatch.setattr(pipeline, "write_model", full_disk)
    assert main(_argv(files, tmp_path)) == 2
    assert "run's files" in _one_error_line(capsys)
    assert _actions(files, tmp_path)[-1] == "reserve"  # charged (never refunded), not committed
    monkeypatch.setattr(pipeline, "write_model", real)
    assert main(_argv(files, tmp_path) + ["--resume"]) == 0
    assert _actions(files, tmp_path) == ["init", "reserve", "resume", "commit"]
    assert (tmp_path / "run" / "model" / "privtune_head.safetensors").is_file()


def test_full_disk_at_a_checkpoint_after_the_reservation(files, tmp_path, monkeypatch, capsys):
    real = _release.private_torch_save
    calls = []

    def full_after_first(obj, path):
        calls.append(path)
        if len(calls) > 1:  # the step-0 state (before the reservation) is written; the next one finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(obj, path)

    monkeypatch.setattr(_release, "private_torch_save", full_after_first)
    assert main(_argv(files, tmp_path)) == 2
    assert "checkpoint" in _one_error_line(capsys)
    assert _actions(files, tmp_path)[-1] == "reserve"
    monkeypatch.setattr(_release, "private_torch_save", real)
    assert main(_argv(files, tmp_path) + ["--resume"]) == 0
    assert _actions(files, tmp_path) == ["init", "reserve", "resume", "commit"]


def test_full_disk_at_the_first_checkpoint_charges_nothing(files, tmp_path, monkeypatch, capsys):
    def full(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(_release, "private_torch_save", full)
    assert main(_argv(files, tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Nothing was charged" in err
    with pytest.raises(UnknownDatasetError):
        Ledger(f"sqlite:///{tmp_path / 'l.db'}").status(files["train"])
    assert not (tmp_path / "run").exists()


def test_safetensors_full_disk_during_the_tune_release(files, tmp_path, monkeypatch, capsys):
    argv = ["tune", "--data", str(files["train"]), "--eval-data", str(files["eval"]), "--model", str(files["model"]),
            "--mode", "last-layer", "--labels", "0,1", "--epsilon", "2", "--delta", "1e-3", "--seed", "0",
            "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(tmp_path / "run"), "--quiet"]

    def full_disk(run_dir, model, certificate):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    real = pipeline.write_model
    monkeypatch.setattr(pipeline, "write_model", full_disk)
    assert main(argv) == 2
    assert "run's files" in _one_error_line(capsys)
    assert _actions(files, tmp_path)[-1] == "reserve"
    monkeypatch.setattr(pipeline, "write_model", real)
    assert main(argv + ["--resume"]) == 0
    assert _actions(files, tmp_path) == ["init", "reserve", "resume", "commit"]
    assert (tmp_path / "run" / "certificate.json").is_file()


def test_the_run_log_is_best_effort_on_a_full_disk(tmp_path):
    """A failing run logs its error to log.txt before it prints it: on a full disk that write must not replace
    the one clear error with a traceback."""
    import errno

    from privtune.report.progress import RunLog

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    log = RunLog(tmp_path / "log.txt")
    log.write("before")
    log._fh.close()
    log._fh = FullDisk()
    log.write("failed after the ledger reservation")  # no exception
    log.close()
    assert (tmp_path / "log.txt").read_text(encoding="utf-8").endswith("before\n")
