"""`privtune audit` never charges for an audit it cannot finish: everything knowable is checked before the
ledger reservation (output directory, model, max_length), and an interrupted audit resumes under its
reservation (--resume) instead of reserving again."""

from __future__ import annotations

import errno
import json
import os

import pytest

from privtune._release import FAULT_ENV, InjectedFault
from privtune.audit import AuditSpec, audit
from privtune.audit.blackbox import AUDIT_STATE
from privtune.audit.result import AuditResult
from privtune.cli import main
from privtune.errors import InvalidParameterError, ModelError
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files

ARGS = dict(mode="last-layer", epsilon=2.0, delta=1e-3, steps=3, batch_size=20, num_canaries=20, whitebox=False)


def _audit(files, *, seed=0, public_data=False, spec=None, **inputs):
    """The reliability tests' audit: ARGS with ``seed`` (and the ``spec`` overrides), on the toy model."""
    built = AuditSpec.create(**{**ARGS, "seed": seed, "public_data": public_data, **(spec or {})})
    return audit(files["train"], built, model=files["model"], labels=[0, 1], **inputs)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("audit_rel"), {"train": ("train.tsv", 60, 0)})


def _ledger(files, tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'l.db'}"
    Ledger(url).init_dataset(files["train"], 10.0, 1e-3)
    return url


def _actions(url, files) -> list[str]:
    return [r.action for r in Ledger(url).history(files["train"])]


def _cli(files, url, *extra) -> list[str]:
    return ["audit", "--data", str(files["train"]), "--model", str(files["model"]), "--labels", "0,1", "--mode",
            "last-layer", "--epsilon", "2", "--delta", "1e-3", "--steps", "3", "--batch-size", "20", "--canaries",
            "20", "--no-whitebox", "--seed", "0", "--ledger", url, "--quiet", *extra]


def test_output_that_is_a_file_is_refused_before_the_reservation(files, tmp_path, capsys):
    url = _ledger(files, tmp_path)
    (tmp_path / "afile.json").write_text("x")
    assert main(_cli(files, url, "--output", str(tmp_path / "afile.json"))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Nothing was charged" in err
    assert _actions(url, files) == ["init"]  # nothing reserved, nothing committed


def test_output_whose_subdirectory_is_a_file_is_refused_before_the_reservation(files, tmp_path):
    url = _ledger(files, tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "blackbox").write_text("x")
    with pytest.raises(InvalidParameterError, match="blackbox"):
        _audit(files, ledger=url, output_dir=tmp_path / "out", seed=0)
    assert _actions(url, files) == ["init"]


def test_read_only_output_is_refused_before_the_reservation(files, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        probe = ro / "probe"
        try:  # root without the capability check writes anyway: nothing to test then
            probe.touch()
            probe.unlink()
            pytest.skip("this user writes into a 0555 directory")
        except PermissionError:
            pass
        url = _ledger(files, tmp_path)
        with pytest.raises(InvalidParameterError, match="cannot be written"):
            _audit(files, ledger=url, output_dir=ro / "out", seed=0)
        assert _actions(url, files) == ["init"]
    finally:
        os.chmod(ro, 0o755)


def test_read_only_output_is_refused_before_the_reservation_simulated(files, tmp_path, monkeypatch, capsys):
    """The same refusal where the tests run as root (permissions do not bind root): writes under the directory
    fail as they would in a read-only one."""
    from test_cli_output_errors import _deny_writes_under

    url = _ledger(files, tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    _deny_writes_under(monkeypatch, ro)
    assert main(_cli(files, url, "--output", str(ro))) == 2
    err = capsys.readouterr().err
    monkeypatch.undo()
    assert err.startswith("error: ") and err.count("\n") == 1 and "cannot be written" in err
    assert _actions(url, files) == ["init"] and list(ro.iterdir()) == []


def test_missing_model_is_refused_before_the_reservation(files, tmp_path, capsys):
    url = _ledger(files, tmp_path)
    argv = _cli(files, url, "--output", str(tmp_path / "out"))
    argv[argv.index("--model") + 1] = str(tmp_path / "missing_model")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err
    assert _actions(url, files) == ["init"]
    assert not (tmp_path / "out").exists()  # a refused audit leaves no output directory


def test_max_length_beyond_the_model_is_refused_before_the_reservation(files, tmp_path):
    url = _ledger(files, tmp_path)
    with pytest.raises(InvalidParameterError, match="position embeddings hold 64 tokens"):
        _audit(files, ledger=url, max_length=100, seed=0)
    assert _actions(url, files) == ["init"]


def test_refused_reservation_leaves_no_output_directory(files, tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    Ledger(url).init_dataset(files["train"], 0.5, 1e-3)  # the audit plans ε = 2
    with pytest.raises(Exception, match="budget|exceed"):
        _audit(files, ledger=url, output_dir=tmp_path / "out", seed=0)
    assert _actions(url, files) == ["init"] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("seed", [0, None])
def test_interrupted_audit_resumes_under_its_reservation(files, tmp_path, monkeypatch, seed):
    """A crash after the reservation (here: after the last training step) leaves one open reservation; a
    new audit in the same directory is refused, and --resume commits that reservation once."""
    url = _ledger(files, tmp_path)
    out = tmp_path / "out"
    monkeypatch.setenv(FAULT_ENV, "after-last-step")
    with pytest.raises(InjectedFault):
        _audit(files, ledger=url, output_dir=out, seed=seed)
    monkeypatch.delenv(FAULT_ENV)
    assert _actions(url, files) == ["init", "reserve"]
    assert (out / AUDIT_STATE).is_file() and oct((out / AUDIT_STATE).stat().st_mode & 0o777) == "0o600"
    with pytest.raises(InvalidParameterError, match="interrupted audit"):
        _audit(files, ledger=url, output_dir=out, seed=seed)
    with pytest.raises(InvalidParameterError, match="arguments differ"):
        _audit(files, ledger=url, output_dir=out, seed=seed, resume=True, spec={"steps": 4})
    assert _actions(url, files) == ["init", "reserve"]
    rep = _audit(files, ledger=url, output_dir=out, seed=seed, resume=True)
    assert _actions(url, files) == ["init", "reserve", "resume", "commit"]
    st = Ledger(url).status(files["train"])
    assert len([e for e in st.entries if e.charged]) == 1
    assert st.used_epsilon == pytest.approx(rep.blackbox.claimed_epsilon, rel=1e-3)
    assert (out / "blackbox" / "audit.json").is_file() and not (out / AUDIT_STATE).exists()


def test_resume_repeats_the_same_audit(files, tmp_path, monkeypatch):
    """Same canaries, same membership, same training noise: a resumed audit equals an uninterrupted one."""
    ref = _audit(files, public_data=True, seed=0)
    url = _ledger(files, tmp_path)
    monkeypatch.setenv(FAULT_ENV, "after-reserve")
    with pytest.raises(InjectedFault):
        _audit(files, ledger=url, output_dir=tmp_path / "o", seed=0)
    monkeypatch.delenv(FAULT_ENV)
    rep = _audit(files, ledger=url, output_dir=tmp_path / "o", seed=0, resume=True)
    assert rep.blackbox.scores == ref.blackbox.scores and rep.blackbox.included == ref.blackbox.included


def test_full_disk_while_writing_the_audit_is_one_error_and_resume_writes_it_without_a_new_charge(
        files, tmp_path, monkeypatch, capsys):
    url = _ledger(files, tmp_path)
    out = tmp_path / "out"
    real = AuditResult.save

    def full_disk(self, directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))

    monkeypatch.setattr(AuditResult, "save", full_disk)
    assert main(_cli(files, url, "--output", str(out))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "No space" in err and "--resume" in err
    assert _actions(url, files) == ["init", "reserve", "commit"]
    monkeypatch.setattr(AuditResult, "save", real)
    assert main(_cli(files, url, "--output", str(out), "--resume")) == 0
    assert _actions(url, files) == ["init", "reserve", "commit"]  # no second charge
    assert json.loads((out / "blackbox" / "audit.json").read_text())["kind"] == "black-box"
    assert not (out / AUDIT_STATE).exists()


def test_a_charged_cli_audit_without_output_writes_a_run_folder_that_resume_can_finish(
        files, tmp_path, monkeypatch, capsys):
    """Without --output a charged audit still keeps its seeds on disk (runs/audit-<time>/), so that one killed
    after its reservation is finished by --resume into that folder instead of being charged again."""
    monkeypatch.chdir(tmp_path)
    url = _ledger(files, tmp_path)
    monkeypatch.setenv(FAULT_ENV, "after-last-step")
    with pytest.raises(InjectedFault):
        main(_cli(files, url))
    monkeypatch.delenv(FAULT_ENV)
    (out,) = (tmp_path / "runs").iterdir()
    assert out.name.startswith("audit-") and (out / AUDIT_STATE).is_file()
    assert f"--output runs/{out.name} --resume" in capsys.readouterr().out  # said before anything is charged
    assert _actions(url, files) == ["init", "reserve"]
    assert main(_cli(files, url, "--output", str(out.relative_to(tmp_path)), "--resume")) == 0
    assert _actions(url, files) == ["init", "reserve", "resume", "commit"]  # one charge
    assert (out / "blackbox" / "audit.json").is_file() and not (out / AUDIT_STATE).exists()
    # the folders it wrote: the black-box audit's alone (--no-whitebox)
    assert f"written: runs/{out.name}/blackbox/audit.{{json,png,html}}" in capsys.readouterr().out


def test_a_refused_cli_audit_without_output_leaves_no_run_folder(files, tmp_path, monkeypatch, capsys):
    """...and names none: the folder's line comes once every check has passed."""
    monkeypatch.chdir(tmp_path)
    url = _ledger(files, tmp_path)
    argv = _cli(files, url)
    argv[argv.index("--model") + 1] = str(tmp_path / "missing_model")
    assert main(argv) == 2
    assert _actions(url, files) == ["init"] and not (tmp_path / "runs").exists()
    assert "runs/audit-" not in capsys.readouterr().out


def test_an_uncharged_cli_audit_without_output_writes_nothing(files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(_cli(files, f"sqlite:///{tmp_path / 'l.db'}", "--public-data")) == 0
    assert not (tmp_path / "runs").exists()


def test_resume_without_an_interrupted_audit_is_refused(files, tmp_path):
    url = _ledger(files, tmp_path)
    with pytest.raises(InvalidParameterError, match="no interrupted audit"):
        _audit(files, ledger=url, output_dir=tmp_path / "out", seed=0, resume=True)
    assert _actions(url, files) == ["init"] and not (tmp_path / "out").exists()


def test_model_error_names_the_path(tmp_path):
    from privtune.models.classifier import check_model

    with pytest.raises(ModelError, match="does not exist"):
        check_model(tmp_path / "nope")


@pytest.mark.parametrize("kw, match", [(dict(optimizer="bogus"), "optimizer"), (dict(clip=-1.0), "clip"),
                                       (dict(learning_rate=0.0), "learning_rate"), (dict(clipping="nope"), "clipping")])
def test_a_bad_training_option_is_refused_before_the_reservation(files, tmp_path, kw, match):
    """The training options are checked when the audit's spec is built, not by the training run after the charge."""
    url = _ledger(files, tmp_path)
    with pytest.raises(InvalidParameterError, match=match):
        _audit(files, ledger=url, output_dir=tmp_path / "out", seed=0, spec=kw)
    assert _actions(url, files) == ["init"] and not (tmp_path / "out").exists()


def test_a_batch_size_with_full_batch_sampling_is_refused_before_the_reservation(files, tmp_path):
    """Every full-batch step takes the whole union of the data and the included canaries (its size depends on the
    canaries' draw): a batch size is refused before anything is reserved, not by the training run after it."""
    url = _ledger(files, tmp_path)
    with pytest.raises(InvalidParameterError, match="does not apply to sampling='full_batch'"):
        _audit(files, ledger=url, output_dir=tmp_path / "out", spec={"sampling": "full_batch", "batch_size": 20})
    assert _actions(url, files) == ["init"] and not (tmp_path / "out").exists()
