"""privtune.report.write_report on synthetic but realistic run directories.

The run directories are built here from synthetic trials whose privacy events and ε
come from the real accounting functions (no training), in the RUN_DIR layout that
`privtune train` / `privtune tune` write.  `make_run` is also used by the browser test.
"""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import privtune.accounting as acct
from privtune.accounting.events import DPSGDEvent, GaussianEvent, RepeatAndSelectEvent, event_to_dict
from privtune.config import save_effective_config
from privtune.errors import InvalidParameterError
from privtune.report import write_report

DELTA = 1e-5


def _full_batch_sigma(eps: float, steps: int) -> float:
    mu = acct.gdp.mu_from_epsilon(eps, DELTA)
    return math.sqrt(steps) / mu


def _save_certificate(run_dir: Path, events: list, metadata: dict) -> float:
    eps = float(acct.compute_epsilon(events, DELTA))
    cert_cls = getattr(acct, "Certificate", None)
    if cert_cls is not None:  # the real certificate once the accounting module has it
        cert = cert_cls.from_events(events, DELTA, accountant="pld", metadata=metadata)
        cert.save(run_dir / "certificate.json")
        return float(cert.epsilon)
    (run_dir / "certificate.json").write_text(json.dumps({
        "epsilon": eps, "delta": DELTA, "accountant": "pld", "neighbouring": "add/remove one example",
        "events": [event_to_dict(e) for e in events],
        "sampling_assumptions": ["full-batch steps: every example in every step (no amplification claimed)"],
        "versions": {"privtune": "0.1.0"}, "metadata": metadata,
    }, indent=2))
    return eps


def make_run(run_dir: Path, strategy: str = "linear-scaling", *, reference: bool = True, clipping: bool = True,
             seed: int = 0) -> Path:
    """Write a realistic RUN_DIR for ``strategy`` (linear-scaling, hyperfree, random-search, grid-oracle, train)."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "model").mkdir(exist_ok=True)
    (run_dir / "model" / "config.json").write_text("{}")
    total_eps = 1.0
    trials, trial_events = [], []
    strat: dict = {"name": strategy}
    if strategy in ("linear-scaling", "grid-oracle", "random-search", "hyperfree"):
        sweeps = [(0.05, 3), (0.1, 3)] if strategy == "linear-scaling" else [(0.08, 6)]
        if strategy == "hyperfree":
            sweeps = []
        best_rs = []
        for sweep, (eps_t, n) in enumerate(sweeps):
            # r log-uniform; the best r grows with the trial budget, as linear scaling expects
            rs = [3.0, 12.0, 40.0] if strategy == "linear-scaling" and sweep == 0 else (
                [10.0, 25.0, 90.0] if strategy == "linear-scaling" else np.exp(rng.uniform(0.0, np.log(200.0), n)))
            peak = 12.0 if sweep == 0 else 25.0
            scores = []
            for r in rs:
                steps = int(rng.choice([20, 50, 100]))
                ev = [GaussianEvent(_full_batch_sigma(eps_t, steps), count=steps, label=f"trial {len(trials) + 1}")]
                score = float(0.80 - 0.01 * (np.log(r) - np.log(peak)) ** 2 + rng.normal(0, 0.002))
                scores.append(score)
                trials.append({"index": len(trials) + 1, "phase": f"sweep {sweep + 1}",
                               "hyperparameters": {"r": float(r), "learning_rate": float(r / steps), "steps": steps},
                               "events": [event_to_dict(e) for e in ev], "score": score,
                               "score_source": "public_validation"})
                if strategy != "grid-oracle":
                    trial_events += ev
            best_rs.append(float(rs[int(np.argmax(scores))]))
        cum: list = []
        for t in trials:
            from privtune.accounting.events import event_from_dict

            cum += [event_from_dict(d) for d in t["events"]]
            t["epsilon_after"] = float(acct.compute_epsilon(cum, DELTA))
        if strategy == "random-search":
            inner = trials[0]["events"]
            from privtune.accounting.events import event_from_dict

            trial_events = [RepeatAndSelectEvent(events=tuple(event_from_dict(d) for d in inner), mean=6, shape=1)]
            strat["scores"] = [t["score"] for t in trials]
    steps_f = 300
    if trial_events:
        sigma_f = acct.calibrate_noise_multiplier(total_eps, DELTA, sample_rate=0.02, steps=steps_f,
                                                  spent_events=trial_events)
    else:
        sigma_f = acct.calibrate_noise_multiplier(total_eps, DELTA, sample_rate=0.02, steps=steps_f)
    final_ev = [DPSGDEvent(sigma_f, 0.02, steps_f, label="final run")]
    final_eps = float(acct.compute_epsilon(final_ev, DELTA))
    if strategy == "linear-scaling":
        e1, e2 = 0.05, 0.1
        slope = (best_rs[1] - best_rs[0]) / (e2 - e1)
        intercept = best_rs[0] - slope * e1
        r_star = float(np.clip(slope * final_eps + intercept, 1.0, 500.0))
        strat.update({"trial_epsilons": [e1, e2], "best_r": best_rs,
                      "fit": {"slope": slope, "intercept": intercept, "space": "epsilon"},
                      "r_star": r_star, "final_epsilon": final_eps, "notes": []})
    lr = [0.05] * steps_f
    if strategy == "hyperfree":
        lr = list(0.05 * np.exp(np.cumsum(rng.normal(0, 0.05, steps_f))))
        strat["lr_trajectory"] = lr
    steps = list(range(1, steps_f + 1))
    loss = list(0.69 * np.exp(-np.arange(steps_f) / 120) + 0.3 + rng.normal(0, 0.03, steps_f))
    evals = [{"step": s, "accuracy": float(0.5 + 0.33 * (1 - math.exp(-s / 80)))} for s in range(25, steps_f + 1, 25)]
    history = {"final_run": {"step": steps, "train_loss": [float(v) for v in loss], "eval": evals, "lr": lr},
               "trials": trials}
    if strategy != "train":
        history["strategy"] = strat
    if clipping:
        history["clipping_diagnostics"] = {
            "step": list(range(10, steps_f + 1, 10)),
            "fraction_clipped": [float(0.9 * math.exp(-s / 200)) for s in range(10, steps_f + 1, 10)],
            "norm_quantiles": {"10%": 0.4, "50%": 1.3, "90%": 3.1},
            "mse_optimal_clip": 1.7, "label": "NOT PRIVATE",
        }
    is_train = strategy == "train"
    metadata = {"strategy": None if is_train else strategy, "selection": "public_validation",
                "seed": seed, "command": "train" if is_train else "tune"}
    eps = _save_certificate(run_dir, trial_events + final_ev, metadata)
    metrics = {"accuracy": 0.832, "epsilon": eps, "delta": DELTA, "mode": "last-layer",
               "hyperparameters": {"learning_rate": 0.05, "steps": steps_f, "noise_multiplier": sigma_f, "clip": 1.0},
               "reported_split": "test", "dataset_id": "ds-0123456789abcdef",
               "ledger_url": "sqlite:///ledger.db", "ledger_remaining_epsilon": 7.0}
    if not is_train:
        metrics.update({"strategy": strategy, "selection": "accuracy on a validation split declared public"})
    if reference:
        metrics["nonprivate_reference"] = {"accuracy": 0.871, "label": "NOT PRIVATE"}
    if strategy == "grid-oracle":
        metrics["not_private"] = True
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (run_dir / "history.json").write_text(json.dumps(history))
    cfg = {"epsilon": total_eps, "delta": DELTA, "mode": "last-layer", "output": str(run_dir)}
    if not is_train:
        cfg["strategy"] = strategy
    save_effective_config(cfg, run_dir, command="train" if is_train else "tune")
    (run_dir / "log.txt").write_text("2026-01-01 00:00:00  start final run\n")
    return run_dir


def _images(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)]


@pytest.fixture(scope="module")
def ls_run(tmp_path_factory):
    """A linear-scaling run with every optional part, and its reports (written once per module): the shareable
    one in RUN_DIR, and the one that includes the NOT PRIVATE parts in RUN_DIR/not_private (returned)."""
    run = make_run(tmp_path_factory.mktemp("ls") / "run")
    write_report(run)
    return run, write_report(run, include_non_private=True)


def test_linear_scaling_report_is_complete_and_self_contained(ls_run):
    run, out = ls_run
    assert out == run / "not_private" / "report.html"
    html = out.read_text()
    # self-contained: no network, images inlined as PNG
    assert "http://" not in html and "https://" not in html and "<script" not in html
    imgs = _images(html)
    assert len(imgs) == 5 and all(i.startswith(b"\x89PNG") for i in imgs)
    for name in ("budget.png", "strategy.png", "learning_curves.png", "accuracy_vs_reference.png", "clipping.png"):
        assert (run / "not_private" / name).read_bytes().startswith(b"\x89PNG")
    assert not (run / "not_private" / "trials.png").exists()
    # the shareable report of the same run leaves every NOT PRIVATE part out
    shared = (run / "report.html").read_text()
    assert len(_images(shared)) == 3 and "Clipping diagnostics" not in shared and "non-private reference" not in shared
    assert not (run / "clipping.png").exists() and not (run / "accuracy_vs_reference.png").exists()
    assert "Parts of this report are missing" not in html and "could not be drawn" not in html
    # budget: totals, accountant, ledger, certificate verified and the re-verification command
    cert = json.loads((run / "certificate.json").read_text())
    assert f"{cert['epsilon']:.4g}" in html and "PLD" in html and "ε remaining for this dataset" in html
    assert "VERIFIED" in html and "VERIFICATION FAILED" not in html
    assert "privtune account --certificate certificate.json" in html  # run in RUN_DIR: the page names no path
    # NOT PRIVATE labels on the reference and the clipping diagnostics
    assert html.count("NOT PRIVATE") >= 4
    assert "Linear scaling" in html and "sweep 2" in html


def test_budget_curve_is_composed_not_summed(ls_run):
    from privtune.report.plots import budget_points
    from privtune.report.run import load_run

    run_dir = ls_run[0]
    bp = budget_points(load_run(run_dir))
    assert bp.kind == "trials" and bp.labels[-1] == "final run" and len(bp.cumulative) == 7
    assert all(a <= b + 1e-9 for a, b in zip(bp.cumulative, bp.cumulative[1:]))  # monotone
    # composed, not additive: well below the running sum once there are several trials
    assert bp.cumulative[5] < sum(bp.individual[:6]) * 0.9
    # the first point is the first trial alone; the last is the certificate's ε recomputed
    first = json.loads((run_dir / "history.json").read_text())["trials"][0]
    assert bp.cumulative[0] == pytest.approx(first["epsilon_after"], rel=1e-6)
    cert = json.loads((run_dir / "certificate.json").read_text())
    assert bp.cumulative[-1] == pytest.approx(cert["epsilon"], rel=1e-3)
    assert bp.cumulative[-1] <= 1.0 + 1e-9 and bp.tuning_epsilon < bp.total_epsilon


def test_tampered_certificate_fails_verification_in_the_report(ls_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ls_run[0], run)
    for name in ("history.json", "metrics.json"):
        (run / name).unlink()
    cert = json.loads((run / "certificate.json").read_text())
    cert["epsilon"] = cert["epsilon"] / 2  # claims less than its events cost
    (run / "certificate.json").write_text(json.dumps(cert))
    html = write_report(run).read_text()
    assert "VERIFICATION FAILED" in html and "VERIFIED<" not in html


@pytest.mark.parametrize("strategy, image", [("hyperfree", "strategy.png"), ("random-search", "trials.png"),
                                              ("grid-oracle", "trials.png"), ("train", None)])
def test_other_strategies(tmp_path, strategy, image):
    run = make_run(tmp_path / strategy, strategy, reference=False, clipping=False)
    html = write_report(run).read_text()
    assert "could not be drawn" not in html
    if image:
        assert (run / image).is_file()
    assert (run / "budget.png").is_file() and (run / "learning_curves.png").is_file()
    assert not (run / "accuracy_vs_reference.png").exists()
    if strategy == "grid-oracle":
        assert "tuning was not charged" in html and "NOT PRIVATE" in html
        assert "nothing was charged to the ledger" in html and "ε remaining for this dataset" not in html
    else:
        assert "NOT PRIVATE" not in html
    if strategy == "random-search":
        assert "repeat-and-select" in html  # the note that the curve is plain composition
    if strategy == "train":
        assert "training run" in html and "Hyperparameters" in html  # chosen hyperparameters, no trials table
        assert "<h3>Trials</h3>" not in html


def test_cli_regenerates_removes_stale_plots_and_tolerates_missing_parts(ls_run, tmp_path, capsys):
    from privtune.cli import main

    run = tmp_path / "run"
    shutil.copytree(ls_run[0], run)
    (run / "history.json").unlink()
    (run / "config.yaml").unlink()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "report.html" in out and "README.md" in out
    assert not (run / "strategy.png").exists() and not (run / "clipping.png").exists()
    assert (run / "budget.png").exists()  # from the certificate alone (ε along the final run)
    (run / "metrics.json").write_text("{not json")
    (run / "certificate.json").unlink()
    html = write_report(run).read_text()
    assert "metrics.json could not be read" in html and "certificate.json is missing" in html
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "run_dir" in capsys.readouterr().err


def test_not_a_run_dir(tmp_path):
    with pytest.raises(InvalidParameterError, match="run_dir"):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidParameterError, match="not a privtune run directory"):
        write_report(tmp_path / "empty")


def _tiny_tune_files(root: Path) -> dict:
    from privtune.models.testing import make_tiny_text_model, make_toy_text_dataset

    def write(path, ds):
        path.write_text("label\tsentence\n" + "".join(f"{y}\t{t}\n" for t, y in zip(ds.texts, ds.labels)))
        return str(path)

    root.mkdir(parents=True, exist_ok=True)
    return {"model": make_tiny_text_model(root / "st", sentence_transformers=True),
            "train": write(root / "train.tsv", make_toy_text_dataset(160, seed=0)),
            "public": write(root / "public.tsv", make_toy_text_dataset(40, seed=1)),
            "dev": write(root / "dev.tsv", make_toy_text_dataset(40, seed=2))}


@pytest.mark.parametrize("mode", ["last-layer", "bitfit"])
def test_hyperfree_run_has_public_accuracy_curve_in_history_and_report(tmp_path, mode, monkeypatch):
    """A real `privtune tune` (hyperfree, the default) records the final run's learning curves: the privatised
    loss and accuracy on the PUBLIC validation split only (never the reported split), and the report shows them."""
    import privtune
    from privtune.models.classifier import Classifier

    f = _tiny_tune_files(tmp_path / "data")
    public_texts = set(Path(f["public"]).read_text().splitlines()[1:])
    dev_texts = {ln.split("\t", 1)[1] for ln in Path(f["dev"]).read_text().splitlines()[1:]}
    seen, orig = [], Classifier.predict_logits

    def predict(self, ds, **kw):  # every evaluation pass over a split
        seen.append("dev" if set(ds.texts) & dev_texts else "other")
        return orig(self, ds, **kw)

    monkeypatch.setattr(Classifier, "predict_logits", predict)
    r = privtune.tune(f["train"], eval_data=f["dev"], public_eval_data=f["public"], model=f["model"], mode=mode,
                      strategy="hyperfree", epsilon=2.0, delta=1e-3, epochs=2, batch_size=40, seed=0, quiet=True,
                      ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run")
    assert public_texts
    h = json.loads((r.run_dir / "history.json").read_text())["final_run"]
    steps = r.metrics["hyperparameters"]["steps"]
    assert len(h["eval"]) >= 2 and h["eval"][-1]["step"] == steps
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in h["eval"])
    assert "public validation" in h["eval_split"]
    assert h["train_loss"] and "privatised" in h["train_loss_label"] and len(h["train_loss_step"]) == len(
        h["train_loss"])
    if mode == "bitfit":  # the reported split is evaluated once, after the model is final, never for curves
        assert seen.count("dev") == 1 and seen[-1] == "dev"
    html = (r.run_dir / "report.html").read_text()
    assert (r.run_dir / "learning_curves.png").is_file() and "public validation split" in html


@pytest.mark.parametrize("clipping, expected", [("flat", "flat at C = 1"), ("automatic", "automatic (AUTO-S")])
def test_hyperfree_report_states_the_clipping_it_used(tmp_path, clipping, expected):
    run = make_run(tmp_path / "hf", "hyperfree", reference=False, clipping=False)
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["hyperparameters"]["clipping"] = clipping
    (run / "metrics.json").write_text(json.dumps(metrics))
    html = write_report(run).read_text()
    assert "Clipping here: " + expected in html


def test_report_has_an_audit_section_when_the_run_was_audited(ls_run, tmp_path):
    """`privtune audit --output RUN_DIR/audit` results appear in report.html as an "Audit" section with the
    score histograms of included and excluded canaries."""
    from privtune.audit.result import AuditResult

    run = tmp_path / "run"
    shutil.copytree(ls_run[0], run)
    assert "id='audit'" not in write_report(run).read_text(encoding="utf-8")  # no audit, no section
    rng = np.random.default_rng(0)
    included = [bool(b) for b in rng.integers(0, 2, 200)]
    scores = [float(s) for s in rng.normal(size=200) + 3.0 * np.asarray(included)]
    res = AuditResult(kind="white-box", claimed_epsilon=1.0, delta=1e-5, epsilon_lower_bound=2.5, confidence=0.95,
                      num_canaries=200, num_guesses=40, correct_guesses=40, scores=scores, included=included,
                      privacy="uses no data")
    res.save(run / "audit" / "whitebox")
    html = write_report(run).read_text(encoding="utf-8")
    section = html[html.index("<section id='audit'>"):]
    section = section[:section.index("</section>")]
    assert "white-box" in section and "2.5" in section and "VIOLATION" in section
    assert len(_images(section)) == 1  # the histogram, inlined
    assert AuditResult.from_dict(json.loads((run / "audit" / "whitebox" / "audit.json").read_text())) == res


def test_report_states_no_time_at_the_unit_level(tmp_path):
    """With the start time in the run directory's default name, the report's "generated" time would give the
    run's duration, which grows with the number of rows: private at the unit level."""
    run = make_run(tmp_path / "run", "train")
    assert " · generated " in write_report(run).read_text(encoding="utf-8")
    cert_path = run / "certificate.json"
    cert = json.loads(cert_path.read_text(encoding="utf-8"))
    cert["neighbouring"] = "add/remove all rows of one user_id"
    cert_path.write_text(json.dumps(cert), encoding="utf-8")
    html = write_report(run).read_text(encoding="utf-8")
    assert " · generated " not in html and "all rows of one user_id" in html
