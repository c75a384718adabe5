"""Tuning trials as Ray tasks (issue 16, item 2): the same release as in process, one ledger written by the
driver alone, a dead worker's trial retried under the same reservation, one clear error for a bad address or
a missing Ray.  Ray is an optional extra: the tests that need it skip, with the reason, where it is not
installed; the others run everywhere."""

from __future__ import annotations

import json
import pickle
import sys

import pytest
import torch

import privtune
from privtune.cli import main
from privtune.errors import InvalidParameterError, PrivtuneError
from privtune.hpo import executors
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files

RAY_MISSING = "Ray is an optional extra (pip install 'privtune[ray]') and is not installed here"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("ray"), {"train": ("train.tsv", 160, 0),
                                                                "public": ("public.tsv", 40, 1),
                                                                "dev": ("dev.tsv", 40, 2)})


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module (2 CPUs, no dashboard)."""
    ray = pytest.importorskip("ray", reason=RAY_MISSING)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _tune(files, out, **kw):
    args = dict(eval_data=files["dev"], public_eval_data=files["public"], model=files["model"], mode="last-layer",
                epsilon=2.0, delta=1e-3, ledger=f"sqlite:///{out}.db", output_dir=out, seed=3, quiet=True)
    args.update(kw)
    return privtune.tune(files["train"], **args)


def _entries(res, ledger_path):
    return Ledger(f"sqlite:///{ledger_path}").status(res.metrics["dataset_id"]).entries


def _same_release(a, b):
    """What a run publishes: certificate (ε and every event), chosen hyperparameters, trials, model."""
    ca = json.loads((a.run_dir / "certificate.json").read_text())
    cb = json.loads((b.run_dir / "certificate.json").read_text())
    assert cb["epsilon"] == ca["epsilon"] and cb["events"] == ca["events"]
    assert b.metrics["hyperparameters"] == a.metrics["hyperparameters"]
    assert b.metrics["trials"] == a.metrics["trials"]
    assert [(t["hyperparameters"], t["score"], t["events"]) for t in b.trials] == \
        [(t["hyperparameters"], t["score"], t["events"]) for t in a.trials]
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.allclose(sa[k], sb[k], rtol=0, atol=1e-6) for k in sa)


STRATEGIES = [("random-search", {"trials": 4, "accounting": "composition"}),
              ("random-search", {"trials": 3, "accounting": "repeat-and-select"}),
              ("linear-scaling", None)]


@pytest.fixture(scope="module")
def local_runs(files, tmp_path_factory):
    """The in-process reference run of each strategy (seed 3)."""
    root = tmp_path_factory.mktemp("local")
    return {i: _tune(files, root / f"run{i}", strategy=s, strategy_options=o) for i, (s, o) in enumerate(STRATEGIES)}


@pytest.mark.parametrize("case", range(len(STRATEGIES)), ids=[f"{s}-{(o or {}).get('accounting', 'sweeps')}"
                                                              for s, o in STRATEGIES])
def test_ray_trials_release_what_the_in_process_run_releases(files, tmp_path, ray_local, local_runs, monkeypatch,
                                                             case):
    """(a) same certificate, events, hyperparameters and model as executor='local' with the same seed;
    (b) the ledger is written by the driver only: one reservation, committed with the local run's charge, and
    the tasks get no ledger, journal or run directory."""
    strategy, options = STRATEGIES[case]
    shipped, ledger_when_shipped = [], []
    real_put = ray_local.put

    def put(obj, **k):  # what each batch of tasks receives, and the ledger's state when it is sent
        led = Ledger(f"sqlite:///{tmp_path / 'ray.db'}")
        ledger_when_shipped.append([e.state for d in led.datasets() for e in led.status(d["fingerprint"]).entries])
        shipped.append(pickle.dumps(obj))
        return real_put(obj, **k)

    monkeypatch.setattr(ray_local, "put", put)
    ref = local_runs[case]
    res = _tune(files, tmp_path / "ray", strategy=strategy, strategy_options=options, executor="ray")
    _same_release(ref, res)
    assert shipped, "the trials did not run as Ray tasks"
    assert ledger_when_shipped[0] == ["reserved"]  # the whole plan was reserved before the first task started
    for blob in shipped:  # a task gets the backend (features) and its trial: never the ledger or the state file
        assert b"privtune.ledger" not in blob and b"_Journal" not in blob and str(tmp_path).encode() not in blob
    (entry,) = _entries(res, tmp_path / "ray.db")
    (ref_entry,) = _entries(ref, ref.run_dir.parent / f"{ref.run_dir.name}.db")
    assert entry.state == ref_entry.state == "committed"
    assert entry.events == ref_entry.events and entry.epsilon_after == ref_entry.epsilon_after
    assert Ledger(f"sqlite:///{tmp_path / 'ray.db'}").verify().ok
    assert "executor: ray" in (res.run_dir / "config.yaml").read_text()


def test_model_trials_on_ray_release_what_the_in_process_run_releases(files, tmp_path, ray_local):
    """The model path: DP-BiTFiT sweeps and final run of linear scaling as Ray tasks (the backend carries the
    model and the private dataset), the same release as in process."""
    args = dict(strategy="linear-scaling", mode="bitfit", trials=2, steps=2, batch_size=40)
    ref = _tune(files, tmp_path / "local", **args)
    res = _tune(files, tmp_path / "ray", executor="ray", **args)
    _same_release(ref, res)


def test_a_dead_worker_is_retried_under_the_same_reservation(files, tmp_path, ray_local, local_runs, monkeypatch):
    """(c) the first trial task kills its worker (a real crash, os._exit): Ray re-runs it with the same seeds;
    the run commits the one reservation it made, with the in-process run's certificate, and publishes nothing
    about the retry."""
    marker = tmp_path / "killed"
    monkeypatch.setenv(executors.KILL_ONCE_ENV, str(marker))
    strategy, options = STRATEGIES[0]
    res = _tune(files, tmp_path / "ray", strategy=strategy, strategy_options=options, executor="ray")
    assert marker.exists()  # a worker did die, and the run still completed: its trial was retried
    _same_release(local_runs[0], res)
    (entry,) = _entries(res, tmp_path / "ray.db")
    assert entry.state == "committed" and entry.resumed == 0  # the reservation made before the trials, only
    published = "".join((res.run_dir / name).read_text() for name in ("log.txt", "metrics.json", "history.json",
                                                                      "certificate.json", "config.yaml"))
    published = published.replace(str(tmp_path), "RUN")  # this test's own name says "retried"
    for word in ("retr", "attempt", "died", "worker"):
        assert word not in published.lower()


def test_retries_exhausted_stop_the_run_charged_and_resume_continues_it(files, tmp_path, ray_local, local_runs,
                                                                        monkeypatch):
    """A worker that dies and may not be retried stops the run with one error; its reservation stays charged,
    and --resume (here in process) finishes it under that same reservation with the same release."""
    monkeypatch.setenv(executors.KILL_ONCE_ENV, str(tmp_path / "killed"))
    strategy, options = STRATEGIES[0]
    out = tmp_path / "ray"
    with pytest.raises(PrivtuneError, match="reservation stays charged"):
        _tune(files, out, strategy=strategy, strategy_options=options,
              executor=executors.RayExecutor(max_retries=0))
    res_led = Ledger(f"sqlite:///{out}.db")
    (ds,) = res_led.datasets()
    (entry,) = res_led.status(ds["fingerprint"]).entries
    assert entry.state == "reserved"  # charged: trials may have run
    monkeypatch.delenv(executors.KILL_ONCE_ENV)
    res = _tune(files, out, strategy=strategy, strategy_options=options, resume=True)
    _same_release(local_runs[0], res)
    (entry,) = res_led.status(ds["fingerprint"]).entries
    assert entry.state == "committed" and entry.resumed == 1


# ----------------------------------------------------------------------------- one clear error each


def _cli(files, tmp_path, *extra):
    return ["tune", "--data", files["train"], "--eval-data", files["dev"], "--public-eval-data", files["public"],
            "--model", files["model"], "--mode", "last-layer", "--strategy", "random-search", "--epsilon", "2",
            "--delta", "1e-3", "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(tmp_path / "run"),
            "--quiet", *extra]


@pytest.mark.parametrize("address, message", [
    ("not an address", "must be 'auto', 'local', HOST:PORT or ray://HOST:PORT"),
    ("ray://head:99999", "must be 'auto', 'local', HOST:PORT or ray://HOST:PORT"),
    ("127.0.0.1:1", "nothing answers at 127.0.0.1:1"),
])
def test_bad_ray_address_is_one_clear_error_before_anything_is_charged(files, tmp_path, capsys, address, message):
    pytest.importorskip("ray", reason=RAY_MISSING)
    assert main(_cli(files, tmp_path, "--executor", "ray", "--ray-address", address)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "l.db").exists() and not (tmp_path / "run").exists()


def test_ray_not_installed_is_one_clear_error(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    assert main(_cli(files, tmp_path, "--executor", "ray")) == 2
    err = capsys.readouterr().err
    assert "needs Ray, which is not installed" in err and "pip install \"privtune[ray]\"" in err
    assert "Traceback" not in err and not (tmp_path / "l.db").exists()


@pytest.mark.parametrize("kw, message", [
    (dict(strategy="hyperfree", executor="ray"), "trains one run"),
    (dict(strategy="single-step", executor="ray"), "trains one run"),
    (dict(strategy="random-search", ray_address="auto"), "applies to executor='ray' only"),
    (dict(strategy="random-search", executor="dask"), "executor"),
])
def test_executor_refusals_cost_nothing(files, tmp_path, kw, message):
    with pytest.raises(InvalidParameterError, match=message):
        _tune(files, tmp_path / "run", **kw)
    assert not (tmp_path / "run.db").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("env, message", [
    ("127.0.0.1:1", "$RAY_ADDRESS='127.0.0.1:1': nothing answers at 127.0.0.1:1"),
    ("not an address", "$RAY_ADDRESS must be 'auto', 'local', HOST:PORT"),
])
def test_bad_ray_address_environment_variable_is_probed_like_the_option(files, tmp_path, capsys, monkeypatch,
                                                                        env, message):
    """Without --ray-address Ray joins $RAY_ADDRESS, retrying an unreachable one for many minutes: it is
    checked before Ray is started, like --ray-address, and nothing is charged."""
    ray = pytest.importorskip("ray", reason=RAY_MISSING)

    def no_init(*args, **kwargs):
        raise AssertionError("ray.init was called with an unreachable $RAY_ADDRESS")

    monkeypatch.setenv("RAY_ADDRESS", env)
    # as in a fresh process (another test of this module may have started Ray here), where Ray would join
    # $RAY_ADDRESS
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_init)
    assert main(_cli(files, tmp_path, "--executor", "ray")) == 2
    err = capsys.readouterr().err
    assert message in err and "unset RAY_ADDRESS" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "l.db").exists() and not (tmp_path / "run").exists()
