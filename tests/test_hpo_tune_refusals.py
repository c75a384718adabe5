"""Refused `privtune tune` runs leave no RUN_DIR (docs/cli.md: "a refused run leaves no RUN_DIR") and their
errors name the right split and the right total."""

from __future__ import annotations

import pytest

from privtune.cli import main
from privtune.models.testing import make_toy_text_dataset, make_toy_text_files, write_toy_tsv


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("tune_refusals"), {
        "train": ("train.tsv", 160, 0), "public": ("public.tsv", 40, 1), "dev": ("dev.tsv", 40, 2)})


def _cli(files, tmp_path, *extra, mode="last-layer"):
    return ["tune", "--data", str(files["train"]), "--eval-data", str(files["dev"]), "--public-eval-data",
            str(files["public"]), "--model", str(files["model"]), "--mode", mode, "--delta", "1e-3",
            "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(tmp_path / "run"), "--quiet", *extra]


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("extra", [["--resume", "--epsilon", "1"], ["--epsilon", "1", "--resume", "--seed", "3"]])
def test_resume_with_nothing_to_resume_leaves_no_run_dir(files, tmp_path, capsys, extra):
    assert main(_cli(files, tmp_path, *extra)) == 2
    assert "no interrupted run" in _one_error(capsys)
    assert not (tmp_path / "run").exists()


INFEASIBLE = ("--strategy", "linear-scaling", "--epsilon", "1e-6")  # the sweeps alone cost more


def test_infeasible_budget_leaves_no_run_dir(files, tmp_path, capsys):
    assert main(_cli(files, tmp_path, *INFEASIBLE, mode="bitfit")) == 2
    assert "infeasible" in _one_error(capsys)
    assert not (tmp_path / "run").exists() and not (tmp_path / "l.db").exists()


def test_refusal_keeps_a_run_dir_that_existed(files, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert main(_cli(files, tmp_path, *INFEASIBLE, mode="bitfit")) == 2
    _one_error(capsys)
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine" and not (tmp_path / "run" / "log.txt").exists()


def test_mode_pilot_error_names_the_total_and_the_pilot_share(files, tmp_path, capsys, monkeypatch):
    import importlib

    tune_module = importlib.import_module("privtune.hpo.tune")  # the module (privtune.hpo.tune is also a function)

    def pilot_out_of_reach(modes, pilot_eps, delta, *args):
        # what calibrating a pilot raises when its ε is too small for any σ under the ceiling
        from privtune.hpo import common

        return common.calibrate_final(pilot_eps, delta, [], sample_rate=0.5, steps=10**6, what="a mode pilot",
                                      max_noise_multiplier=1.0)

    monkeypatch.setattr(tune_module, "_auto_candidates", lambda modes, n, eps, **_: ["last-layer", "bitfit"])
    monkeypatch.setattr(tune_module, "_plan_pilots", pilot_out_of_reach)
    assert main(_cli(files, tmp_path, "--epsilon", "0.001", mode="auto")) == 2
    err = _one_error(capsys)
    assert "total `epsilon` = 0.001" in err and "ε = 0.0001" in err and "mode pilot" in err
    assert not (tmp_path / "run").exists()


def test_an_unexpected_failure_before_the_reservation_leaves_no_run_dir(files, tmp_path, monkeypatch):
    """Not only privtune's own refusals: a failure of another library before anything is charged (a model that
    fails to load, say) leaves no half-made RUN_DIR to block the rerun."""
    import importlib

    tune_module = importlib.import_module("privtune.hpo.tune")

    def broken(*args, **kwargs):
        raise RuntimeError("a library failed while planning")

    monkeypatch.setattr(tune_module, "_plan_pilots", broken)
    monkeypatch.setattr(tune_module, "_auto_candidates", lambda modes, n, eps, **_: ["last-layer", "bitfit"])
    with pytest.raises(RuntimeError, match="a library failed"):
        main(_cli(files, tmp_path, "--epsilon", "1", mode="auto"))
    assert not (tmp_path / "run").exists() and not (tmp_path / "l.db").exists()


def test_eval_overlapping_the_public_split_names_both_splits(files, tmp_path, capsys):
    overlap = write_toy_tsv(tmp_path / "dev_overlap.tsv", make_toy_text_dataset(40, seed=1))  # = the public split
    argv = _cli(files, tmp_path, "--epsilon", "1")
    argv[argv.index("--eval-data") + 1] = str(overlap)
    assert main(argv) == 2
    err = _one_error(capsys)
    assert "`eval_data` overlaps `public_eval_data`: 40 example(s)" in err and "training data" not in err
