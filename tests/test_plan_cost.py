"""The plan knows the model's cost: every candidate mode is priced before the run from the backbone's size and a
timed forward pass on a dummy input, the estimates are logged, and a time budget makes --mode auto pilot only the
modes that fit and refuses an explicit mode above it before anything is charged."""

from __future__ import annotations

import re

import pytest
import torch

from privtune.cli import main
from privtune.finetune.cost import backbone_cost, estimate_seconds
from privtune.models import load_classifier
from privtune.models.testing import make_toy_text_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("plan_cost"), {
        "train": ("train.tsv", 400, 0), "public": ("public.tsv", 60, 1), "dev": ("dev.tsv", 40, 2)})


def test_backbone_cost_counts_size_and_flops_and_prices_modes_by_kind(files):
    clf = load_classifier(files["model"], num_labels=2, seed=0)
    cost = backbone_cost(clf)
    assert cost.parameters == sum(p.numel() for p in clf.backbone.parameters())
    assert cost.flops_per_example and cost.flops_per_example > 2 * 0.5 * cost.parameters  # ≥ one MAC per weight
    assert cost.forward_seconds > 0 and "tokens" in cost.input_words
    work = 1000
    full, bitfit, head = (estimate_seconds(cost, [(k, work)]) for k in ("model:full", "model:bitfit", "features"))
    assert full > bitfit > 100 * head  # DP fine-tuning costs more than bitfit, a head on features almost nothing
    assert estimate_seconds(cost, [("forward", work)]) == pytest.approx(work * cost.forward_seconds)


def _tune(files, tmp_path, *extra):
    return ["tune", "--data", str(files["train"]), "--public-eval-data", str(files["public"]), "--model",
            str(files["model"]), "--delta", "1e-3", "--epsilon", "60", "--ledger", f"sqlite:///{tmp_path / 'l.db'}",
            "--output", str(tmp_path / "run"), "--quiet", *extra]


def test_an_explicit_mode_above_the_time_budget_is_refused_before_anything_is_charged(files, tmp_path, capsys):
    assert main(_tune(files, tmp_path, "--mode", "full", "--time-budget", "1e-9")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: mode full is estimated at") and err.count("\n") == 1, err
    assert "above `time_budget` = 1e-09 min" in err and "parameters" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "l.db").exists()


def test_auto_logs_every_estimate_and_pilots_only_what_fits_the_budget(files, tmp_path, capsys, monkeypatch):
    import importlib

    from privtune.finetune.cost import BackboneCost

    tune_module = importlib.import_module("privtune.hpo.tune")  # the module (privtune.hpo.tune is also the function)
    # one measured cost for both runs: the machine's load must not move the estimates between them
    fixed = backbone_cost(load_classifier(files["model"], num_labels=2, seed=0))
    monkeypatch.setattr(tune_module, "backbone_cost", lambda clf, *where: fixed)
    seen = {}
    real = tune_module._mode_estimates

    def spy(*args):
        out = real(*args)
        seen.update(out)
        return out

    monkeypatch.setattr(tune_module, "_mode_estimates", spy)
    # n·ε = 24,000: --mode auto pilots the fine-tuning modes
    assert main(_tune(files, tmp_path, "--mode", "auto", "--steps", "2")) == 0
    log = (tmp_path / "run" / "log.txt").read_text()
    line = next(x for x in log.splitlines() if "time estimate before the run" in x)
    assert "M parameters" in line and "GFLOP per example" in line
    assert set(re.findall(r"([a-z-]+) ≈ ", line)) == set(seen) and {"bitfit", "full"} <= set(seen)
    assert seen["full"] > seen["bitfit"] and isinstance(fixed, BackboneCost)
    capsys.readouterr()
    budget = (seen["bitfit"] + seen["full"]) / 2 / 60  # minutes: bitfit fits, full does not
    run2 = tmp_path / "run2"
    args = _tune(files, tmp_path, "--mode", "auto", "--steps", "2", "--time-budget", f"{budget:.6g}")
    args[args.index("--output") + 1] = str(run2)
    args[args.index("--ledger") + 1] = f"sqlite:///{tmp_path / 'l2.db'}"  # the first run spent its dataset's budget
    assert main(args) == 0
    log2 = (run2 / "log.txt").read_text()
    assert "full not piloted: estimated above the time budget" in log2
    assert "pilot" in log2 and "pilot full" not in log2.lower() and "full pilot" not in log2.lower()


def test_the_forward_cost_is_timed_where_the_run_trains_and_the_model_stays_put(files):
    """``device`` and ``batch_size`` time the backbone where the run will train; the model is left where it was
    (here the CPU, the only device: the batch size does not apply to a CPU)."""
    clf = load_classifier(files["model"], num_labels=2, seed=0)
    before = {n: p.detach().clone() for n, p in clf.named_parameters()}
    cost = backbone_cost(clf, "cpu", 256)
    assert cost.forward_seconds > 0 and next(clf.parameters()).device.type == "cpu"
    assert all(torch.equal(before[n], p) for n, p in clf.named_parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_forward_cost_on_a_gpu_is_timed_on_the_gpu(files):
    clf = load_classifier(files["model"], num_labels=2, seed=0)
    gpu = backbone_cost(clf, "cuda", 64)
    assert gpu.forward_seconds > 0 and next(clf.parameters()).device.type == "cpu"
    assert "here" in gpu.describe()
