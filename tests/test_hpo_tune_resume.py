"""`privtune tune` interrupted and resumed: the same reservation, completed trials replayed (not recomputed),
the same release as an uninterrupted run; the saved config.yaml reproduces the run; the config template's
examples are valid for `tune` itself."""

from __future__ import annotations

import json
import stat

import pytest
import torch

import privtune
import privtune.hpo.backends as backends
from privtune.cli import main
from privtune.errors import InvalidParameterError
from privtune.finetune import usefulness
from privtune.hpo.tune import STATE_FILE
from privtune.hpo.registry import REGISTRY
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("resume"), {"train": ("train.tsv", 160, 0), "train2": ("train2.tsv", 160, 5),
                                         "public": ("public.tsv", 40, 1), "dev": ("dev.tsv", 40, 2)})


class _Interrupt:
    """Counts calls of a trial function and raises KeyboardInterrupt (Ctrl-C) on call number `at`."""

    def __init__(self, monkeypatch, module, name):
        self.orig, self.calls, self.at = getattr(module, name), 0, None
        monkeypatch.setattr(module, name, self)

    def __call__(self, *a, **k):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.orig(*a, **k)

    def reset(self, at=None):
        self.calls, self.at = 0, at


def _args(files, tmp_path, **kw):
    args = dict(eval_data=files["dev"], public_eval_data=files["public"], model=files["model"], mode="last-layer",
                epsilon=2.0, delta=1e-3, seed=0, quiet=True)
    args.update(kw)
    return args


def _entries(url, fp):
    return Ledger(url).status(fp).entries


def _same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("strategy,options,n_runs", [
    ("linear-scaling", None, 7),                                          # 6 trials + final run
    ("random-search", {"accounting": "composition", "trials": 4}, 4),     # the best trial is released
])
def test_interrupted_tune_resumes_exactly(files, tmp_path, monkeypatch, capfd, strategy, options, n_runs):
    trial = _Interrupt(monkeypatch, backends, "fit")
    args = _args(files, tmp_path, strategy=strategy, strategy_options=options)
    ref = privtune.tune(files["train"], ledger=f"sqlite:///{tmp_path / 'ref.db'}", output_dir=tmp_path / "ref",
                        **args)
    assert trial.calls == n_runs and not (tmp_path / "ref" / STATE_FILE).exists()

    url, out = f"sqlite:///{tmp_path / 'l.db'}", tmp_path / "run"
    trial.reset(at=2)  # Ctrl-C during the second trial
    with pytest.raises(KeyboardInterrupt):
        privtune.tune(files["train"], ledger=url, output_dir=out, **args)
    err = capfd.readouterr().err
    assert "reservation stays charged" in err and f"privtune tune --resume --config {out / 'config.yaml'}" in err
    assert "reservation stays charged" in (out / "log.txt").read_text()
    state = out / STATE_FILE
    assert state.is_file() and stat.S_IMODE(state.stat().st_mode) == 0o600
    assert not (out / "certificate.json").exists()
    fp = files["train"]  # the data file: its dataset id differs per ledger (ref.db, l.db)
    (entry,) = _entries(url, fp)
    assert entry.state == "reserved"  # charged: the interrupted run may have read data
    # a new run may not silently start over the interrupted one
    with pytest.raises(InvalidParameterError, match="interrupted run"):
        privtune.tune(files["train"], ledger=url, output_dir=out, **args)

    trial.reset()
    res = privtune.tune(files["train"], ledger=url, output_dir=out, resume=True, **args)
    assert trial.calls == n_runs - 1  # the completed first trial was replayed, not recomputed
    assert res.metrics["resumed"] == {"replayed_trials": 1}
    assert res.certificate.epsilon == ref.certificate.epsilon
    assert res.metrics["hyperparameters"] == ref.metrics["hyperparameters"]
    assert [t["score"] for t in res.trials] == [t["score"] for t in ref.trials]
    assert res.accuracy == ref.accuracy and _same_model(res.model, ref.model)
    (entry,) = _entries(url, fp)  # ONE ledger entry: the reservation was continued, not reopened
    assert entry.state == "committed" and entry.resumed == 1
    assert not state.exists()  # it held the noise seeds
    # a finished run cannot be "resumed"
    with pytest.raises(InvalidParameterError, match="finished run"):
        privtune.tune(files["train"], ledger=url, output_dir=out, resume=True, **args)


def test_resume_model_modes_mode_auto_hyperfree(files, tmp_path, monkeypatch):
    """The default strategy with --mode auto: Ctrl-C in the bitfit pilot (the 2nd charged pilot); the resumed
    run replays the completed pilots, recomputes the rest with the same seeds and releases the same model."""
    monkeypatch.setattr(usefulness, "FINETUNE_AT_CHANCE_N_EPS", 0)  # toy data (n·ε = 320): still pilot every mode
    fit = _Interrupt(monkeypatch, backends, "fit")  # every pilot runs through fit (heads on features too)
    args = _args(files, tmp_path, mode="auto", strategy="hyperfree", epochs=1, batch_size=40, seed=None)
    url, out = f"sqlite:///{tmp_path / 'l.db'}", tmp_path / "run"
    fit.reset(at=3)  # pilots: last-layer (fit #1), bitfit (fit #2), lora (fit #3)
    with pytest.raises(KeyboardInterrupt):
        privtune.tune(files["train"], ledger=url, output_dir=out, **args)
    seed = json.loads((out / STATE_FILE).read_text().splitlines()[0])["seed"]  # drawn from the OS
    assert "seed" not in (out / "config.yaml").read_text()  # the OS seed is never written to a shareable file
    fit.reset()
    res = privtune.tune(files["train"], ledger=url, output_dir=out, resume=True, **args)
    # recomputed: the interrupted pilot, hyperfree's three η-placement trials when a model mode won, and the
    # final run (never stored: recomputed from its seed; it runs through the backend too)
    assert fit.calls == 1 + (3 if res.metrics["mode"] != "last-layer" else 0) + 1
    assert res.metrics["resumed"] == {"replayed_trials": 2}
    (entry,) = _entries(url, res.metrics["dataset_id"])
    assert entry.state == "committed" and entry.resumed == 1 and not (out / STATE_FILE).exists()
    # the uninterrupted run with the same master seed releases exactly the same thing
    ref = privtune.tune(files["train"], ledger=f"sqlite:///{tmp_path / 'ref.db'}", output_dir=tmp_path / "ref",
                        **dict(args, seed=seed))
    assert res.certificate.epsilon == ref.certificate.epsilon
    assert res.metrics["mode"] == ref.metrics["mode"] and res.metrics["hyperparameters"] == ref.metrics[
        "hyperparameters"]
    assert [t["score"] for t in res.trials] == [t["score"] for t in ref.trials]
    assert _same_model(res.model, ref.model)


def test_resume_refusals(files, tmp_path, monkeypatch):
    trial = _Interrupt(monkeypatch, backends, "fit")
    url, out = f"sqlite:///{tmp_path / 'l.db'}", tmp_path / "run"
    args = _args(files, tmp_path, strategy="linear-scaling")
    with pytest.raises(InvalidParameterError, match="no interrupted run"):
        privtune.tune(files["train"], ledger=url, output_dir=tmp_path / "empty", resume=True, **args)
    monkeypatch.chdir(tmp_path)  # without output_dir, tune's default RUN_DIR is runs/<timestamp>/ in the cwd
    with pytest.raises(InvalidParameterError, match="needs `output_dir`"):
        privtune.tune(files["train"], ledger=url, resume=True, **args)
    with pytest.raises(InvalidParameterError, match="grid-oracle"):
        privtune.tune(files["train"], ledger=url, output_dir=out, resume=True, **dict(args, strategy="grid-oracle"))
    trial.reset(at=3)
    with pytest.raises(KeyboardInterrupt):
        privtune.tune(files["train"], ledger=url, output_dir=out, **args)
    trial.reset()
    with pytest.raises(InvalidParameterError, match="epsilon: was 2.0, now 3.0"):
        privtune.tune(files["train"], ledger=url, output_dir=out, resume=True, **dict(args, epsilon=3.0))
    with pytest.raises(InvalidParameterError, match="configuration differs"):
        privtune.tune(files["train2"], ledger=url, output_dir=out, resume=True, **args)
    # same options, different content behind the same path: the data fingerprint catches it
    saved = open(files["train"], encoding="utf-8").read()
    try:
        with open(files["train"], "w", encoding="utf-8") as f:
            f.write(open(files["train2"], encoding="utf-8").read())
        with pytest.raises(InvalidParameterError, match="training data differs"):
            privtune.tune(files["train"], ledger=url, output_dir=out, resume=True, **args)
    finally:
        with open(files["train"], "w", encoding="utf-8") as f:
            f.write(saved)
    assert trial.calls == 0  # nothing ran for any refused resume
    # the interrupted run's reservation must still be open in the ledger: never replay trials outside it
    led = Ledger(url)
    (ds,) = led.datasets()
    (entry,) = led.status(ds["fingerprint"]).entries
    led._release(ds["fingerprint"], entry.entry_id, "test: released by hand", command="test")
    with pytest.raises(InvalidParameterError, match="no open reservation"):
        privtune.tune(files["train"], ledger=url, output_dir=out, resume=True, **args)
    assert trial.calls == 0 and len(led.status(ds["fingerprint"]).entries) == 1  # and nothing new was reserved
    # a damaged state file is refused, not half-trusted
    state = out / STATE_FILE
    lines = state.read_text().splitlines()
    state.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(privtune.errors.PrivtuneError, match="damaged"):
        privtune.tune(files["train"], ledger=url, output_dir=out, resume=True, **args)


def test_cli_ctrl_c_then_resume_with_the_saved_config(files, tmp_path, monkeypatch, capsys):
    trial = _Interrupt(monkeypatch, backends, "fit")
    out, db = tmp_path / "cli", tmp_path / "c.db"
    argv = ["tune", "--data", files["train"], "--eval-data", files["dev"], "--public-eval-data", files["public"],
            "--model", files["model"], "--mode", "last-layer", "--strategy", "linear-scaling", "--epsilon", "2",
            "--delta", "1e-3", "--ledger", f"sqlite:///{db}", "--output", str(out), "--quiet"]
    trial.reset(at=4)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "privtune tune --resume --config" in err and "reservation stays charged" in err
    trial.reset()
    assert main(["tune", "--resume", "--config", str(out / "config.yaml")]) == 0
    text = capsys.readouterr().out
    assert "resumed: 3 completed trial(s) replayed" in text and trial.calls == 4
    assert main(["account", "--certificate", str(out / "certificate.json")]) == 0
    fp = json.loads((out / "metrics.json").read_text())["dataset_id"]
    (entry,) = _entries(f"sqlite:///{db}", fp)
    assert entry.state == "committed"


# ----------------------------------------------------------------------------- RUN_DIR/config.yaml


def test_saved_config_is_complete_and_reruns_the_run(files, tmp_path, capsys):
    from privtune.config import resolve_options

    args = _args(files, tmp_path, strategy="linear-scaling", mode="last-layer", selection="public_validation",
                 trials=4, clip=0.5, strategy_options={"r_sampling": "uniform", "fit_space": "mu"},
                 accountant="pld", text_column="sentence", label_column="label", validation_fraction=0.2,
                 ledger=f"sqlite:///{tmp_path / 'a.db'}", output_dir=tmp_path / "a")
    first = privtune.tune(files["train"], **args)
    # the released config.yaml names the files; the copy kept outside the release has the paths that rerun it
    released = resolve_options("tune", tmp_path / "a" / "config.yaml", {})
    assert released["data"] == "train.tsv" and released["output"] == "a"
    saved = resolve_options("tune", tmp_path / "a" / "not_private" / "config.yaml", {})  # what `--config` reads
    expected = {k: v for k, v in args.items() if k != "output_dir"}
    expected.update(data=files["train"], model=str(files["model"]), output=str(tmp_path / "a"),
                    selection="public-validation")
    assert {k: saved[k] for k in expected} == expected
    assert "resume" not in saved and "write_files" not in saved
    # rerun from the file (new output and ledger): the same run
    assert main(["tune", "--config", str(tmp_path / "a" / "not_private" / "config.yaml"), "--output", str(tmp_path / "b"),
                 "--ledger", f"sqlite:///{tmp_path / 'b.db'}"]) == 0
    capsys.readouterr()
    second = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert second["epsilon"] == first.metrics["epsilon"]
    assert second["hyperparameters"] == json.loads(json.dumps(first.metrics["hyperparameters"]))
    assert second["accuracy"] == first.metrics["accuracy"] and second["trials"] == 4


def test_tune_refuses_epochs_and_steps_together(files, tmp_path):
    with pytest.raises(InvalidParameterError, match="epochs` or `steps`"):
        privtune.tune(files["train"], **_args(files, tmp_path, strategy="hyperfree", epochs=1, steps=3,
                                              ledger=f"sqlite:///{tmp_path / 'x.db'}", output_dir=tmp_path / "x"))
    assert not (tmp_path / "x.db").exists()


def test_config_template_examples_are_valid_for_tune(tmp_path):
    """`privtune config init --command tune`: every commented example, uncommented, is accepted by the loader
    AND by tune's own checks (the strategy_options example used to be rejected by every strategy)."""
    import dataclasses

    import importlib

    from privtune.config import SCHEMAS, check_config_file
    from privtune.hpo import hyperfree
    from privtune.hpo.common import SELECTIONS

    tune_mod = importlib.import_module("privtune.hpo.tune")  # the module (privtune.hpo.tune is also the function)

    p = tmp_path / "t.yaml"
    assert main(["config", "init", "--command", "tune", str(p)]) == 0
    text = p.read_text()
    keys = tuple(f"# {k}:" for k in SCHEMAS["tune"]) + ("#   ",)
    lines = [ln[2:] if ln.startswith(keys) else ln for ln in text.splitlines()]
    full = tmp_path / "full.yaml"
    full.write_text("\n".join(ln for ln in lines if not ln.startswith("steps:")) + "\n")
    opts = check_config_file(full, "tune")["tune"]
    assert set(opts) == set(SCHEMAS["tune"]) - {"steps"}
    assert opts["mode"] in tune_mod.MODES and opts["strategy"] == "hyperfree"
    assert opts["selection"] in SELECTIONS
    cfg = REGISTRY["hyperfree"].make_config(dict(opts["strategy_options"]))
    assert isinstance(cfg, hyperfree.HyperfreeConfig)
    cfg.validate()
    assert {f.name for f in dataclasses.fields(cfg)} >= set(opts["strategy_options"])
    # every tune() argument that can be saved has a configuration key (so config.yaml always loads back)
    import inspect

    params = set(inspect.signature(privtune.tune).parameters) - {"unknown", "write_files", "output_dir", "resume"}
    assert params - {"data"} <= set(SCHEMAS["tune"]) and "output" in SCHEMAS["tune"]
