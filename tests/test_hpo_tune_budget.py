"""privtune.tune and the budget: --mode auto per strategy, the reservation covering what runs, the dataset
identity in the ledger, random search's certificate, the NOT PRIVATE grid oracle, bad inputs before spending."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import privtune
from privtune.accounting import compute_epsilon, event_from_dict, verify_certificate
from privtune.cli import main
from privtune.errors import (BudgetExceededError, DataError, InfeasibleBudgetError, InvalidParameterError,
                             PrivtuneWarning)
from privtune.finetune import usefulness
from privtune.hpo import common
from privtune.hpo import random_search as rs
from privtune.ledger import Ledger, dataset_fingerprint
from privtune.models.testing import make_toy_text_dataset, make_toy_text_files, write_toy_tsv



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("tune_budget"), {"train": ("train.tsv", 160, 0), "public": ("public.tsv", 40, 1), "dev": ("dev.tsv", 40, 2)})


def _tune(files, tmp_path, data=None, **kw):
    args = dict(eval_data=files["dev"], public_eval_data=files["public"], model=files["model"], mode="last-layer",
                epsilon=2.0, delta=1e-3, ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run",
                seed=0, quiet=True, labels=[0, 1])
    args.update(kw)
    return privtune.tune(files["train"] if data is None else data, **args)


def _entries(url, fp):
    return Ledger(url).status(fp).entries


def _commits_within_reservation(url, fp) -> bool:
    return not any(r.payload.get("exceeded_reservation") for r in Ledger(url).history(fp) if r.action == "commit")


# ---------------------------------------------------------------------------------------------------------
# --mode auto: pilots only the modes the strategy trains; the reservation covers the mode the pilots pick
# ---------------------------------------------------------------------------------------------------------


def _force_pilot_winner(monkeypatch, winner):
    orig = common.Selector.score

    def score(self, outputs, label=""):
        s, evs = orig(self, outputs, label)
        if label.startswith(f"mode-auto pilot {winner}"):
            return 10.0, evs  # this mode wins the pilot, whatever it scored
        return s, evs

    monkeypatch.setattr(common.Selector, "score", score)


@pytest.mark.parametrize("strategy,winner", [
    ("hyperfree", "bitfit"), ("hyperfree", "lora"), ("linear-scaling", "bitfit"), ("linear-scaling", "lora"),
    ("single-step", "bitfit"), ("random-search", "lora"), ("grid-oracle", "bitfit"),
])
def test_mode_auto_with_a_forced_pilot_winner_is_covered_and_committed(files, tmp_path, monkeypatch, strategy,
                                                                        winner):
    monkeypatch.setattr(usefulness, "FINETUNE_AT_CHANCE_N_EPS", 0)  # toy data (n·ε = 480): still pilot every mode
    _force_pilot_winner(monkeypatch, winner)
    url = f"sqlite:///{tmp_path / 'l.db'}"
    opts = {"strategy_options": {"trials": 3}} if strategy == "random-search" else {}
    if strategy == "grid-oracle":
        opts = {"strategy_options": {"lr_points": 2, "steps_grid": [5]}}
    extra = {"epochs": 1, "batch_size": 40} if strategy in ("hyperfree", "linear-scaling") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a commit above its reservation warns (or is refused)
        warnings.simplefilter("default", PrivtuneWarning)  # not about the budget: a toy model may predict one class
        r = _tune(files, tmp_path, strategy=strategy, mode="auto", epsilon=3.0, **opts, **extra)
    pilots = [t for t in r.trials if t["phase"] == "mode-auto pilot"]
    if strategy in ("hyperfree", "linear-scaling"):  # they train every candidate mode: three pilots
        assert {t["hyperparameters"]["mode"] for t in pilots} == {"last-layer", "bitfit", "lora"}
        assert r.metrics["mode"] == winner
    else:  # last layer only: nothing to choose, nothing spent on pilots
        assert pilots == [] and r.metrics["mode"] == "last-layer"
    if strategy == "grid-oracle":
        assert r.model is None and not (tmp_path / "l.db").exists()
        return
    cert = json.loads((r.run_dir / "certificate.json").read_text())
    events = [event_from_dict(e) for e in cert["events"]]
    assert cert["epsilon"] <= 3.0 + 1e-9
    assert compute_epsilon(events, cert["delta"], accountant=cert["accountant"]) == pytest.approx(cert["epsilon"])
    fp = r.metrics["dataset_id"]
    entries = _entries(url, fp)
    assert len(entries) == 1 and entries[0].state == "committed"  # not left reserved
    assert _commits_within_reservation(url, fp)
    assert Ledger(url).status(fp).reserved_epsilon == 0.0


@pytest.mark.parametrize("lead,winner", [(0.01, "last-layer"), (0.45, "bitfit")])
def test_mode_auto_pilots_within_the_public_splits_noise_are_ties_won_by_the_first_candidate(
        files, tmp_path, monkeypatch, lead, winner):
    """Pilot scores the 40 public rows cannot tell apart (Selector.tie_margin) are ties, won by the first
    candidate; a lead beyond the margin wins.  Measured at full size: bitfit 56.20 % vs full 56.40 % at
    chance, and the argmax chose DP full fine-tuning by noise."""
    monkeypatch.setattr(usefulness, "FINETUNE_AT_CHANCE_N_EPS", 0)  # toy data (n·ε = 480): still pilot every mode
    orig = common.Selector.score

    def score(self, outputs, label=""):
        s, evs = orig(self, outputs, label)
        if label.startswith("mode-auto pilot"):
            return 0.5 + (lead if label.startswith("mode-auto pilot bitfit") else 0.0), evs
        return s, evs

    monkeypatch.setattr(common.Selector, "score", score)
    r = _tune(files, tmp_path, strategy="hyperfree", mode="auto", epsilon=3.0, epochs=1, batch_size=40)
    pilots = {t["hyperparameters"]["mode"]: t["score"] for t in r.trials if t["phase"] == "mode-auto pilot"}
    assert set(pilots) == {"last-layer", "bitfit", "lora"} and max(pilots, key=pilots.get) == "bitfit"
    assert r.metrics["mode"] == winner


def test_strategy_mode_combinations_that_cannot_work_fail_before_the_ledger(files, tmp_path, monkeypatch):
    monkeypatch.setattr(usefulness, "FINETUNE_AT_CHANCE_N_EPS", 0)  # toy data: --mode auto plans every candidate
    url = f"sqlite:///{tmp_path / 'l.db'}"
    for strategy in ("single-step", "random-search", "grid-oracle"):
        for mode in ("bitfit", "lora", "full"):
            with pytest.raises(InvalidParameterError, match="trains last-layer only"):
                _tune(files, tmp_path, strategy=strategy, mode=mode)
    # a candidate of --mode auto whose plan is impossible fails before anything is reserved
    with pytest.raises(InvalidParameterError, match="candidate mode 'bitfit'.*steps_grid"):
        _tune(files, tmp_path, strategy="linear-scaling", mode="auto", strategy_options={"steps_grid": [5, 10]})
    # a bad strategy option is the user's, whatever the candidate: one error without the auto-mode preamble
    with pytest.raises(InvalidParameterError, match="backbone_lr_scale") as bad:
        _tune(files, tmp_path, strategy="hyperfree", mode="auto", strategy_options={"backbone_lr_scale": 2})
    assert "candidate mode" not in str(bad.value)
    # overrides that the strategy would ignore are refused, not dropped
    with pytest.raises(InvalidParameterError, match="`optimizer` does not apply"):
        _tune(files, tmp_path, strategy="random-search", optimizer="adam")
    with pytest.raises(InvalidParameterError, match="`trials` does not apply"):
        _tune(files, tmp_path, strategy="hyperfree", trials=5)
    assert not (tmp_path / "l.db").exists() or not Ledger(url).datasets()


# ---------------------------------------------------------------------------------------------------------
# the dataset in the ledger: same identity as `privtune train`, whole file, relative paths
# ---------------------------------------------------------------------------------------------------------


def test_relative_data_path_from_its_own_folder(files, tmp_path, monkeypatch):
    write_toy_tsv(tmp_path / "train.tsv", make_toy_text_dataset(160, seed=0))
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'rel.db'}"
    r = _tune(files, tmp_path, data="train.tsv", strategy="single-step", ledger=url)
    dataset_id = r.metrics["dataset_id"]
    assert dataset_id.startswith("ds-") and r.metrics["ledger_registered_new_dataset"] is True
    (ds,) = Ledger(url).datasets()  # the same dataset as `privtune train` would charge: the file's content
    assert ds["dataset_id"] == dataset_id and ds["fingerprint"] == Ledger(url).fingerprint(tmp_path / "train.tsv")
    assert Ledger(url).status(dataset_id).spent_epsilon == pytest.approx(r.certificate.epsilon, rel=1e-3)


def test_private_validation_charges_the_whole_file(files, tmp_path):
    url = f"sqlite:///{tmp_path / 'pv.db'}"
    Ledger(url).init_dataset(files["train"], epsilon=20.0, delta=1e-3)
    dataset_id = Ledger(url).status(files["train"]).dataset_id
    plain = _tune(files, tmp_path, strategy="random-search", ledger=url, output_dir=tmp_path / "a",
                  strategy_options={"trials": 3})
    private = _tune(files, tmp_path, strategy="random-search", ledger=url, output_dir=tmp_path / "b",
                    public_eval_data=None, selection="private-validation", strategy_options={"trials": 3})
    assert private.certificate.metadata["selection"] == "private_validation_noisy"
    assert plain.metrics["dataset_id"] == private.metrics["dataset_id"] == dataset_id
    assert len(Ledger(url).datasets()) == 1  # the 90 % left after the split did not get a fresh budget
    entries = _entries(url, dataset_id)
    assert [e.state for e in entries] == ["committed", "committed"]


# ---------------------------------------------------------------------------------------------------------
# random search: K is never capped; every trial and the final run are in the certificate
# ---------------------------------------------------------------------------------------------------------


def test_repeat_and_select_trial_count_is_not_truncated():
    rng = np.random.default_rng(0)
    ks = np.array([rs._draw_k(rng, 10.0, 0.0) for _ in range(20000)])
    assert ks.min() >= 1 and abs(ks.mean() - 10.0) < 0.6
    tail = rs._tail_probability(10.0, 0.0, 100)
    assert tail == pytest.approx(0.005, rel=0.1)  # what a cap at 100 would have broken
    assert (ks > 100).mean() == pytest.approx(tail, rel=0.35) and ks.max() > 100
    with pytest.raises(InfeasibleBudgetError, match="limit 100"):
        rs.plan(rs.RandomSearchConfig(trials=150, accounting="repeat-and-select"), 4.0, 1e-5)
    p = rs.plan(rs.RandomSearchConfig(trials=10, accounting="repeat-and-select"), 4.0, 1e-5)
    assert p.p_trials_above_10x_mean == pytest.approx(tail)
    assert any("never capped" in n for n in p.notes)


@pytest.mark.parametrize("accounting", ["repeat-and-select", "composition"])
def test_random_search_certificate_lists_what_is_published_and_the_final_run(files, tmp_path, accounting):
    r = _tune(files, tmp_path, strategy="random-search", strategy_options={"trials": 3, "accounting": accounting})
    cert = json.loads((r.run_dir / "certificate.json").read_text())
    verify_certificate(r.run_dir / "certificate.json")
    records = cert["metadata"]["trial_records"]
    assert records[-1]["phase"] == "final run"
    assert all("hyperparameters" in t and "score" in t and t["events"] for t in records[:-1])
    labels = [e["label"] for e in cert["events"]]
    if accounting == "repeat-and-select":  # the bound covers the selected trial only: nothing else is published
        assert len(records) == 2 and "realised_trials" not in r.history["strategy"]
        assert "selected_trial" not in records[-1]["hyperparameters"]
        assert len(cert["events"]) == 1 and "repeat-and-select" in labels[0]
        assert "repeat-and-select" in cert["metadata"]["trials_accounting"]
        assert all("NOT composed again" in t["accounted"] for t in records[:-1])
    else:
        k = r.history["strategy"]["realised_trials"]
        assert len(records) == k + 1
        assert records[-1]["hyperparameters"]["selected_trial"] == r.history["strategy"]["best_index"]
        assert sum("random-search trial" in lab for lab in labels) == k  # one event per trial
        assert all(t["accounted"] == "its events are listed in `events`" for t in records[:-1])


# ---------------------------------------------------------------------------------------------------------
# the grid oracle is NOT PRIVATE: labelled everywhere, and it leaves the persistent ledger alone
# ---------------------------------------------------------------------------------------------------------


def test_grid_oracle_does_not_touch_the_ledger_and_is_labelled_in_the_cli(files, tmp_path, capsys):
    db = tmp_path / "oracle.db"
    out = tmp_path / "oracle"
    rc = main(["tune", "--data", files["train"], "--eval-data", files["dev"], "--public-eval-data", files["public"],
               "--model", str(files["model"]), "--mode", "last-layer", "--strategy", "grid-oracle", "--epsilon", "1",
               "--delta", "1e-3", "--ledger", f"sqlite:///{db}", "--output", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0 and not db.exists()
    eps_lines = [ln for ln in text.splitlines() if "ε =" in ln]
    assert eps_lines and all("NOT PRIVATE" in ln for ln in eps_lines), text
    assert "certificate: ε" not in text and "remaining ε" not in text and "registered" not in text
    m = json.loads((out / "metrics.json").read_text())
    assert m["not_private"] is True and m["ledger_url"] is None and m["ledger_remaining_epsilon"] is None


# ---------------------------------------------------------------------------------------------------------
# bad inputs: refused before any budget is spent
# ---------------------------------------------------------------------------------------------------------


def test_budget_the_ledger_cannot_fit_is_refused_before_training(files, tmp_path, monkeypatch):
    import privtune.finetune as ft

    url = f"sqlite:///{tmp_path / 'small.db'}"
    Ledger(url).init_dataset(files["train"], epsilon=0.5, delta=1e-3)

    def no_data(*a, **k):  # features are computed only after the reservation
        raise AssertionError("the training data was read before the reservation")

    monkeypatch.setattr(ft, "cache_features", no_data)
    with pytest.raises(BudgetExceededError):
        _tune(files, tmp_path, strategy="single-step", ledger=url, epsilon=2.0)
    st = Ledger(url).status(dataset_fingerprint(files["train"]))
    assert st.entries == () and st.spent_epsilon == 0.0 and st.reserved_epsilon == 0.0


def test_empty_training_set_and_overlapping_eval_data(files, tmp_path):
    url = f"sqlite:///{tmp_path / 'bad.db'}"
    empty = tmp_path / "empty.tsv"
    empty.write_text("label\tsentence\n", encoding="utf-8")
    with pytest.raises(DataError, match="no examples"):
        _tune(files, tmp_path, data=str(empty), ledger=url)
    with pytest.raises(DataError, match="empty"):
        _tune(files, tmp_path, data=type(make_toy_text_dataset(4))(texts=[], labels=[]), ledger=url)
    overlap = write_toy_tsv(tmp_path / "overlap.tsv", make_toy_text_dataset(160, seed=0))  # the training rows
    with pytest.raises(DataError, match="`eval_data` overlaps the training data"):
        _tune(files, tmp_path, eval_data=overlap, ledger=url)
    assert not (tmp_path / "bad.db").exists() or not Ledger(url).datasets()


def test_tune_optimizer_reaches_hyperfree_and_single_step(files, tmp_path):
    r = _tune(files, tmp_path, strategy="hyperfree", optimizer="sgd", output_dir=tmp_path / "h")
    assert r.metrics["hyperparameters"]["optimizer"] == "sgd"
    r = _tune(files, tmp_path, strategy="single-step", optimizer="adam", output_dir=tmp_path / "s",
              ledger=f"sqlite:///{tmp_path / 's.db'}")
    assert r.metrics["hyperparameters"]["optimizer"] == "adam"
    with pytest.raises(InvalidParameterError, match="conflicts"):
        _tune(files, tmp_path, strategy="hyperfree", optimizer="sgd", strategy_options={"optimizer": "adam"},
              output_dir=tmp_path / "c")


def test_the_reservation_covers_the_most_expensive_candidate_by_the_ledgers_measure(tmp_path):
    import importlib

    from privtune.accounting import GaussianEvent
    from privtune.hpo import single_step

    tune_mod = importlib.import_module("privtune.hpo.tune")
    led = Ledger(f"sqlite:///{tmp_path / 'c.db'}")
    fp = "ab" * 32
    led.init_dataset(fp, epsilon=5.0, delta=1e-2, accountant="rdp")  # not the run's δ nor its accountant
    cfg = single_step.SingleStepConfig()
    plans = {"cheap": single_step.plan(cfg, 1.0, 1e-5), "dear": single_step.plan(cfg, 1.5, 1e-5)}
    originals = dict(plans)
    reserved = tune_mod._cover_candidates(led, fp, plans, 1.5, 1e-5, "pld")
    assert reserved == plans["dear"].events
    assert all(originals[m].epsilon_cap is None for m in plans)  # armed copies replaced them; plans are immutable
    for p in plans.values():
        assert p.epsilon_cap == pytest.approx(plans["dear"].planned_epsilon())
        assert p.covered(plans["cheap"].events) and p.covered(plans["dear"].events)
        assert not p.covered(plans["dear"].events + [GaussianEvent(50.0, 1)])
    # an in-run calibration is pulled under the reservation when the ledger's measure needs it
    dear = plans["dear"]
    p = dear.covered_by(dear.epsilon_cap, lambda evs: common.epsilon_of(evs, 1e-5) <= 1.5 * (1 - 3e-5))
    sigma = common.calibrate_in_plan(p, [], sample_rate=1.0, steps=4, sampling="full_batch")
    assert common.epsilon_of([GaussianEvent(sigma, 4)], 1e-5) <= 1.5 * (1 - 3e-5)
    p = dear.covered_by(dear.epsilon_cap, lambda evs: False)
    with pytest.raises(InfeasibleBudgetError, match="reserved budget"):
        common.calibrate_in_plan(p, [], sample_rate=1.0, steps=4, sampling="full_batch")


def test_in_run_calibration_stays_within_a_reservation_measured_at_another_delta(files, tmp_path):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    Ledger(url).init_dataset(files["train"], epsilon=10.0, delta=1e-2, accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("default", PrivtuneWarning)  # not about the budget: a toy model may predict one class
        r = _tune(files, tmp_path, strategy="linear-scaling", ledger=url)  # final σ calibrated after the fit
    fp = r.metrics["dataset_id"]
    assert [e.state for e in _entries(url, fp)] == ["committed"] and _commits_within_reservation(url, fp)
    assert r.certificate.epsilon <= 2.0 + 1e-9


def test_clip_and_clipping_reach_the_strategy_or_are_refused():
    import importlib

    from privtune.hpo import hyperfree, linear_scaling
    from privtune.hpo.common import PlanRequest
    from privtune.hpo.registry import REGISTRY

    tune_mod = importlib.import_module("privtune.hpo.tune")  # the package re-exports the function `tune`
    request = PlanRequest(total_epsilon=1.0, delta=1e-5, n_train=500)
    ls, hf = REGISTRY["linear-scaling"], REGISTRY["hyperfree"]
    p = ls.plan(ls.make_config({}, clip=0.5), "last-layer", request)
    assert isinstance(p.config, linear_scaling.LinearScalingConfig) and p.config.clip == 0.5
    p = hf.plan(hf.make_config({}, clipping="automatic"), "bitfit", request)
    assert isinstance(p.config, hyperfree.HyperfreeConfig) and p.config.clipping == "automatic"
    with pytest.raises(InvalidParameterError, match="conflicts"):
        hf.make_config({"clipping": "flat"}, clipping="automatic")
    with pytest.raises(InvalidParameterError, match="`clip`"):
        tune_mod.tune(None, strategy="hyperfree", clip=2.0, write_files=False)
    with pytest.raises(InvalidParameterError, match="`clipping`"):
        tune_mod.tune(None, strategy="single-step", clipping="automatic", write_files=False)
