"""Data-parallel DP training over torch.distributed (engine/distributed.py): CPU, gloo, two processes.

Every multi-process test starts its processes with ``torch.multiprocessing.spawn`` (the Python API inside an
initialised process group) or with ``torchrun`` (the CLI), on a free local port, with tiny random models.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import privtune.engine.distributed  # noqa: F401 - before any worker makes a group (see its module note)
from privtune.models.testing import make_toy_text_files
from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec

WORLD = 2
MODES = ("last-layer", "bitfit", "full", "lora", "two-phase")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("ddp"), {"train": ("train.tsv", 40, 0),
                                                                "eval": ("dev.tsv", 12, 1)})


# ============================================================================ jobs run in every process


def _fit_every_mode(rank: int, files: dict, sigma: float) -> dict:
    """Train each mode for a few steps through privtune.fit; returns {mode: trainable state, loss history}."""
    from privtune.data import load_dataset
    from privtune.finetune import apply_mode, cache_features
    from privtune.models import load_classifier
    import privtune.training as training
    from privtune.training import fit

    data = load_dataset(files["train"], num_labels=2)
    out = {}
    batches: list = []  # the indices each step of this process trained on
    draw = training._BatchStream.next

    def recorded(stream):
        idx = draw(stream)
        batches.append(idx.clone())
        return idx

    training._BatchStream.next = recorded
    for mode in MODES:
        batches.clear()
        clf = load_classifier(files["model"], num_labels=2, seed=0)
        apply_mode(clf, mode)
        train_set = cache_features(clf, data) if mode == "last-layer" else data
        two_phase = {"mode": "two-phase", "phase1_steps": 1} if mode == "two-phase" else {}
        r = fit(clf, train_set, noise=NoiseSpec(noise_multiplier=sigma, sample_rate=0.3, steps=3),
                optimizer=OptimizerSpec(name="sgd", learning_rate=0.05), clipping=ClippingSpec(clip=0.5),
                options=LoopOptions(seed=7, max_physical_batch_size=4, **two_phase), device="cpu")
        trained = {k: v.detach().clone() for k, v in clf.named_parameters() if v.requires_grad}
        out[mode] = {"params": trained, "loss": r.history["train_loss"], "events": r.events,
                     "batches": list(batches)}
    training._BatchStream.next = draw
    return out


def _noise_release(rank: int, files: dict, steps: int) -> dict:
    """The released gradient of a Linear(200, 50) with σ = 1, C = 1, expected batch 8, and the same batches'
    noise-free release; every rank clips its own random examples."""
    from privtune.engine import PrivateGradient
    from privtune.engine.distributed import current

    group = current()
    torch.manual_seed(100 + rank)  # different examples on each rank
    model = torch.nn.Linear(200, 50)
    clean_model = torch.nn.Linear(200, 50)
    clean_model.load_state_dict(model.state_dict())
    noisy = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0,
                            process_group=group)  # noise seeded from the OS, as in a release
    clean = PrivateGradient(clean_model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=8.0,
                            process_group=group)
    noise = []
    for _ in range(steps):
        x, y = torch.randn(4, 200), torch.randint(0, 50, (4,))
        for m, pg in ((model, noisy), (clean_model, clean)):
            pg.backward(torch.nn.functional.cross_entropy(m(x), y, reduction="none"))
            pg.release()
        noise.append(torch.cat([(model.weight.grad - clean_model.weight.grad).flatten(),
                                (model.bias.grad - clean_model.bias.grad)]))
    return {"noise": torch.cat(noise), "grad": model.weight.grad.clone()}


def _train_run(rank: int, files: dict, root: str, **kw) -> dict:
    """privtune.train as torchrun runs it: every rank gets the same command, except that here rank r is given
    its own RUN_DIR, ledger and PRIVTUNE_HOME, so that what a rank > 0 wrote would show."""
    from privtune.training import train

    root = Path(root)
    os.environ["PRIVTUNE_HOME"] = str(root / f"home{rank}")
    args = dict(eval_data=files["eval"], model=files["model"], mode="bitfit", noise_multiplier=2.0, delta=1e-3,
                steps=3, batch_size=10, learning_rate=1e-2, ledger=f"sqlite:///{root / f'ledger{rank}.db'}",
                output_dir=root / f"run{rank}", seed=0, progress=False, labels=[0, 1], device="cpu")
    args.update(kw)
    r = train(files["train"], **args)
    return {"epsilon": r.certificate.epsilon, "params": {k: v.detach().clone() for k, v in r.model.named_parameters()
                                                         if v.requires_grad}}


def _fits_and_noise(rank: int, files: dict) -> dict:
    return {"fit": {sigma: _fit_every_mode(rank, files, sigma) for sigma in (0.0, 1.0)},
            "noise": _noise_release(rank, files, steps=3)}


def _train_then_train_again(rank: int, files: dict, root: str) -> dict:
    """A run, then the same run again into a new RUN_DIR: the first spends the dataset's whole budget (its total
    ε is registered as the planned ε), so rank 0's ledger refuses the second."""
    from privtune.errors import PrivtuneError

    first = _train_run(rank, files, root)
    # last-layer: each process caches the features of the examples it owns only
    head = _train_run(rank, files, root, mode="last-layer", output_dir=Path(root) / f"head{rank}",
                      ledger=f"sqlite:///{Path(root) / f'head-ledger{rank}.db'}")
    try:
        _train_run(rank, files, root, output_dir=Path(root) / f"again{rank}")
        second = {"error": None}
    except PrivtuneError as exc:
        second = {"error": type(exc).__name__, "message": str(exc)}
    return {"first": first, "second": second, "head": head}


def _train_shared_dir(rank: int, files: dict, root: str, fault_on_rank0: str | None = None, **kw) -> dict:
    """privtune.train exactly as torchrun runs it: the same RUN_DIR and ledger on every rank."""
    if fault_on_rank0 and rank == 0:
        os.environ["PRIVTUNE_TEST_FAULT"] = fault_on_rank0
    return _train_run(rank, files, root, output_dir=Path(root) / "run", ledger=f"sqlite:///{Path(root) / 'l.db'}",
                      **kw)


JOBS = {"fits_and_noise": _fits_and_noise, "train_then_train_again": _train_then_train_again,
        "train_shared_dir": _train_shared_dir}


def _worker(rank: int, world: int, port: int, job: str, out_dir: str, args: tuple, kwargs: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(JOBS[job](rank, *args, **kwargs), Path(out_dir) / f"rank{rank}.pt")
    except BaseException as exc:
        # Written before the group is left, so before a peer can fail on the closed connection: mp.spawn reports
        # whichever rank exits first (a race), so a test of a failure reads each rank's own error from here.
        (Path(out_dir) / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        dist.destroy_process_group()


def _joins_like_torchrun(rank: int, world: int, port: int, files: dict, out_dir: str) -> None:
    """A torchrun worker's life in privtune: the group is made by privtune (from torchrun's variables), a model
    is loaded and trained, and the group is left; writes whether the group object outlived shutdown()."""
    import gc
    import weakref

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from privtune.data import load_dataset
    from privtune.engine.distributed import current, shutdown
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier
    from privtune.training import fit

    assert current(device="cpu") is not None
    group = weakref.ref(dist.distributed_c10d._get_default_group())
    model = load_classifier(files["model"], num_labels=2, seed=0)
    apply_mode(model, "bitfit")
    fit(model, load_dataset(files["train"], num_labels=2),
        noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.25, steps=2),
        optimizer=OptimizerSpec(learning_rate=1e-2), options=LoopOptions(seed=0), device="cpu")
    shutdown()
    gc.collect()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"group_freed": group() is None}))


def _spawn(job: str, tmp_path: Path, *args, **kwargs) -> list:
    """Run ``JOBS[job](rank, *args, **kwargs)`` in WORLD processes of one gloo group; their results by rank."""
    out = Path(tempfile.mkdtemp(prefix=f"results-{job}-", dir=tmp_path))
    mp.spawn(_worker, args=(WORLD, _free_port(), job, str(out), args, kwargs), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _spawn_failing(job: str, tmp_path: Path, *args, **kwargs) -> dict[int, str]:
    """Run a job that fails: each rank's own error, "Type: message", by rank (a rank stopped by the launcher
    before it raised has none)."""
    out = Path(tempfile.mkdtemp(prefix=f"results-{job}-", dir=tmp_path))
    with pytest.raises(Exception):  # which rank's error mp.spawn raises is a race: read each rank's own
        mp.spawn(_worker, args=(WORLD, _free_port(), job, str(out), args, kwargs), nprocs=WORLD, join=True)
    return {r: (out / f"rank{r}.error").read_text() for r in range(WORLD) if (out / f"rank{r}.error").exists()}


# ============================================================================ tests


class _Rank:
    """A stand-in for ProcessGroup's partition (no collective needed to split a batch)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world_size = rank, world

    def partition(self, batch):
        from privtune.engine.distributed import ProcessGroup

        return ProcessGroup(self.rank, self.world_size, self.rank, "gloo").partition(batch)


@pytest.mark.parametrize("sampling", ["poisson", "shuffle", "full_batch"])
def test_the_ranks_shares_are_exactly_the_one_process_batch(sampling):
    from privtune.engine.distributed import ProcessGroup
    from privtune.training import _BatchStream

    q = 0.2 if sampling != "full_batch" else 1.0
    one = _BatchStream(sampling, 103, q, seed=5)
    ranks = [_BatchStream(sampling, 103, q, seed=5, group=ProcessGroup(r, 3, r, "gloo")) for r in range(3)]
    for _ in range(12):
        whole = one.next()
        shares = [s.next() for s in ranks]
        assert sorted(torch.cat(shares).tolist()) == sorted(whole.tolist())  # disjoint, union = the batch
        assert all(bool((share % 3 == r).all()) for r, share in enumerate(shares))  # rank r owns i ≡ r mod 3
    # per-rank state: a rank resumed from its state continues its own share of the same global batches
    resumed = _BatchStream(sampling, 103, q, seed=None, group=ProcessGroup(1, 3, 1, "gloo"))
    resumed.load_state_dict(ranks[1].state_dict())
    assert all(torch.equal(resumed.next(), ranks[1].next()) for _ in range(4))


def test_ranks_that_disagree_on_the_plan_stop_with_one_error_naming_no_data():
    from privtune.engine.distributed import DistributedError, ProcessGroup

    class TwoRanks(ProcessGroup):  # what all_gather returns when rank 1 loaded another file
        def all_gather(self, obj):
            return [obj, ("fingerprint-of-other-rows", 41, {"steps": 3})]

    group = TwoRanks(0, 2, 0, "gloo")
    group.agree("x", ("fingerprint-of-other-rows", 41, {"steps": 3}))  # equal values: no error
    describe = lambda v: f"N = {v[1]} and hyperparameters {v[2]}"  # noqa: E731
    with pytest.raises(DistributedError, match="rank 1") as err:
        group.agree("the training data and plan", ("fingerprint-of-rows", 40, {"steps": 3}), describe=describe)
    assert "N = 40" in str(err.value) and "N = 41" in str(err.value) and "fingerprint" not in str(err.value)
    with pytest.raises(DistributedError, match="differ in what is not shown") as err:  # same N, other rows
        group.agree("the training data and plan", ("fingerprint-of-rows", 41, {"steps": 3}), describe=describe)
    assert "fingerprint" not in str(err.value)


def test_privatise_sum_adds_the_noise_on_one_rank_only():
    from privtune.engine.distributed import ProcessGroup
    from privtune.engine.mechanisms import privatise_sum

    class Ranks(ProcessGroup):  # the all-reduce of a world where every other rank contributed zeros
        def all_reduce_sum_(self, tensors):
            pass

    for rank, noised in ((0, True), (1, False)):
        s = torch.zeros(1000)
        out = privatise_sum([s], 2.0, 1.0, 4.0, torch.Generator().manual_seed(0), Ranks(rank, 2, rank, "gloo")).value[0]
        assert bool(out.ne(0).any()) is noised
    torch.testing.assert_close(privatise_sum(torch.zeros(1000), 2.0, 1.0, 4.0, torch.Generator().manual_seed(0)).value,
                               privatise_sum([torch.zeros(1000)], 2.0, 1.0, 4.0, torch.Generator().manual_seed(0),
                                             Ranks(0, 2, 0, "gloo")).value[0])


def test_loop_hooks_are_refused_in_a_data_parallel_run(monkeypatch):
    from privtune.engine import distributed
    from privtune.errors import InvalidParameterError
    from privtune.finetune import FeatureSet
    from privtune.training import LoopHook, fit

    # refused before any collective: a stand-in group of 2 is enough
    monkeypatch.setattr(distributed, "current", lambda device=None: distributed.ProcessGroup(0, 2, 0, "gloo"))
    data = FeatureSet(torch.randn(20, 4), torch.randint(0, 2, (20,)), 2)
    with pytest.raises(InvalidParameterError, match="data-parallel"):
        fit(torch.nn.Linear(4, 2), data, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1),
            optimizer=OptimizerSpec(learning_rate=0.1), device="cpu", hooks=[LoopHook()])


@pytest.fixture(scope="module")
def fit_ranks(files, tmp_path_factory):
    """privtune.fit of every mode (σ = 0 and σ = 1) and a bare noise release, on two gloo processes."""
    return _spawn("fits_and_noise", tmp_path_factory.mktemp("fits"), files)


@pytest.mark.slow  # starts two Python processes (torch and transformers imports dominate)
@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_two_processes_train_every_mode_like_one_process(files, fit_ranks, sigma):
    from privtune.engine.distributed import current

    assert current() is None  # the test process itself is a one-process run
    one = _fit_every_mode(0, files, sigma)
    for mode in MODES:
        for rank in range(WORLD):
            got, want = fit_ranks[rank]["fit"][sigma][mode], one[mode]
            assert got["events"] == want["events"], mode  # accounting identical to one process
            # the work was split: each process trained on the examples it owns (i ≡ rank mod 2) only
            assert all(bool((b % WORLD == rank).all()) for b in got["batches"]), mode
            assert set(got["params"]) == set(want["params"]) and got["params"], mode
            for name, p in want["params"].items():
                # same seed: same global batches; with noise, rank 0 draws the one-process noise stream
                torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=1e-6,
                                           msg=f"{mode} σ={sigma} rank {rank} {name}")
        # and the shares of each step are exactly the one-process batch
        for step, whole in enumerate(one[mode]["batches"]):
            shares = torch.cat([fit_ranks[r]["fit"][sigma][mode]["batches"][step] for r in range(WORLD)])
            assert sorted(shares.tolist()) == sorted(whole.tolist()) and whole.numel() > 0, (mode, step)
        # the history is the whole batch's loss, as in one process (NOT PRIVATE monitoring)
        assert fit_ranks[0]["fit"][sigma][mode]["loss"] == pytest.approx(one[mode]["loss"], rel=1e-5)


@pytest.mark.slow  # starts two Python processes (torch and transformers imports dominate)
def test_noise_is_added_once_with_std_sigma_c_over_expected_batch(fit_ranks):
    ranks = [r["noise"] for r in fit_ranks]
    torch.testing.assert_close(ranks[0]["grad"], ranks[1]["grad"], rtol=0, atol=0)  # one release, every rank
    z = ranks[0]["noise"].double() * 8.0 / (1.0 * 1.0)  # released noise × expected batch / (σC)
    k = z.numel()
    assert k == 3 * (200 * 50 + 50)
    # With noise N(0, σ²C²) added once per logical batch, z ~ N(0, 1) i.i.d.: var(z) = 1 ± sqrt(2/k)
    # (k = 30150) and mean 0 ± 1/sqrt(k).  Bounds at 6 standard errors: false-positive rate < 1e-8 each.
    # Noise added by each of the 2 processes gives var 2; a σ/W share per process without √W, 0.5; none, 0.
    assert abs(float(z.var()) - 1.0) < 6 * math.sqrt(2.0 / k), float(z.var())
    assert abs(float(z.mean())) < 6 / math.sqrt(k), float(z.mean())


@pytest.fixture(scope="module")
def train_ranks(files, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return root, _spawn("train_then_train_again", root, files, str(root))


@pytest.mark.slow  # starts two Python processes (torch and transformers imports dominate)
def test_train_on_two_processes_writes_on_rank0_only_with_the_one_process_epsilon(files, train_ranks, tmp_path):
    root, ranks = train_ranks
    one = _train_run(0, files, str(tmp_path))  # the same run in one process
    run = root / "run0"
    for name in ("certificate.json", "metrics.json", "history.json", "config.yaml", "log.txt",
                 "model/privtune_classifier.json"):
        assert (run / name).is_file(), name
    # rank 1 was given its own RUN_DIR, ledger and PRIVTUNE_HOME: it created none of them
    assert not (root / "run1").exists() and not (root / "ledger1.db").exists() and not (root / "home1").exists()
    cert = json.loads((run / "certificate.json").read_text())
    assert cert["epsilon"] == pytest.approx(one["epsilon"], rel=1e-12)
    assert ranks[0]["first"]["epsilon"] == ranks[1]["first"]["epsilon"] == cert["epsilon"]
    for name, p in one["params"].items():  # the same model as the one-process run (same seed)
        torch.testing.assert_close(ranks[0]["first"]["params"][name], p, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ranks[1]["first"]["params"][name], p, rtol=1e-5, atol=1e-6)
    from privtune.ledger import Ledger

    one_head = _train_run(0, files, str(tmp_path), mode="last-layer", output_dir=tmp_path / "head",
                          ledger=f"sqlite:///{tmp_path / 'head.db'}")
    assert ranks[0]["head"]["epsilon"] == pytest.approx(one_head["epsilon"], rel=1e-12)
    for name, p in one_head["params"].items():
        for rank in range(WORLD):
            torch.testing.assert_close(ranks[rank]["head"]["params"][name], p, rtol=1e-5, atol=1e-6)
    assert (root / "head0" / "certificate.json").is_file() and not (root / "head1").exists()
    spent = Ledger(f"sqlite:///{root / 'ledger0.db'}").status(
        json.loads((run / "metrics.json").read_text())["dataset_id"]).spent_epsilon
    assert spent == pytest.approx(cert["epsilon"], rel=1e-9)  # charged once, not once per process


@pytest.mark.slow  # starts two Python processes (torch and transformers imports dominate)
def test_a_refusal_on_rank0_is_the_same_error_on_every_rank(train_ranks):
    # rank 0's ledger refuses the second run (budget spent): every rank raises rank 0's error instead of
    # waiting for rank 0 in the training loop, and nothing is left behind
    root, ranks = train_ranks
    assert ranks[0]["second"]["error"] == ranks[1]["second"]["error"] == "BudgetExceededError"
    assert ranks[0]["second"]["message"] == ranks[1]["second"]["message"]
    assert not (root / "again0").exists() and not (root / "again1").exists()


@pytest.mark.slow  # starts two Python processes twice
def test_a_data_parallel_run_resumes_from_rank0s_checkpoint(files, train_ranks, tmp_path):
    root, ranks = train_ranks
    # rank 0 fails at its first mid-training checkpoint; rank 1 fails too (its peer left) or the launcher stops it
    errors = _spawn_failing("train_shared_dir", tmp_path, files, str(tmp_path), fault_on_rank0="mid-training")
    assert "injected fault" in errors.get(0, "rank 0 left no error")
    assert (tmp_path / "run" / "checkpoints" / "checkpoint.pt").is_file()
    resumed = _spawn("train_shared_dir", tmp_path, files, str(tmp_path), resume=True)
    # the resumed run (batches and noise continued from rank 0's checkpoint on every rank) is the uninterrupted one
    for name, p in ranks[0]["first"]["params"].items():
        for rank in range(WORLD):
            torch.testing.assert_close(resumed[rank]["params"][name], p, rtol=1e-5, atol=1e-6)
    assert resumed[0]["epsilon"] == ranks[0]["first"]["epsilon"]
    assert (tmp_path / "run" / "certificate.json").is_file()


def _torchrun_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr",
            "127.0.0.1", "--master-port", str(port), "-m", "privtune", *args]


@pytest.mark.slow  # starts two Python processes (torch and transformers imports dominate)
def test_torchrun_runs_privtune_train(files, tmp_path):
    if shutil.which("torchrun") is None and not hasattr(dist, "run"):
        pytest.skip("torch.distributed.run (torchrun) is not available in this torch build")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = tmp_path / "run"
    common = ["--data", files["train"], "--eval-data", files["eval"], "--model", files["model"], "--mode", "bitfit",
              "--noise-multiplier", "2", "--delta", "1e-3", "--steps", "3", "--batch-size", "10", "--labels", "0,1",
              "--seed", "0", "--quiet", "--device", "cpu"]
    proc = subprocess.run(_torchrun_command(_free_port(), "train", *common, "--output", str(run), "--ledger",
                                            f"sqlite:///{tmp_path / 'l.db'}"),
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "rendezvous" in proc.stderr.lower() and "privtune" not in proc.stderr:
        pytest.skip(f"torchrun could not start its workers here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("trained bitfit for 3 steps") == 1  # rank 0 reports, once
    cert = json.loads((run / "certificate.json").read_text())
    from privtune.training import train

    one = train(files["train"], eval_data=files["eval"], model=files["model"], mode="bitfit", noise_multiplier=2.0,
                delta=1e-3, steps=3, batch_size=10, labels=[0, 1], seed=0, progress=False, device="cpu",
                ledger=f"sqlite:///{tmp_path / 'one.db'}", output_dir=None)
    assert cert["epsilon"] == pytest.approx(one.certificate.epsilon, rel=1e-12)


@pytest.mark.slow  # starts two Python processes (torch and transformers imports dominate)
def test_leaving_the_group_frees_it_so_no_backend_is_torn_down_at_interpreter_exit(files, tmp_path):
    # transformers' model loading imports torch.distributed.nn.functional, whose collectives take
    # group=group.WORLD as a default bound at import: imported after the group was made, it pinned the group,
    # gloo's backend then died during interpreter exit and a rank of a successful torchrun run could SIGABRT
    mp.spawn(_joins_like_torchrun, args=(WORLD, _free_port(), files, str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"group_freed": True}


def test_other_commands_are_refused_under_torchrun():
    # `privtune tune` (or budget, ...) would run once per process, e.g. charge the ledger once per process
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "privtune", "tune", "--help"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "only `privtune train`" in proc.stderr and "Traceback" not in proc.stderr


def test_tune_in_a_data_parallel_group_is_refused_before_anything_is_charged(tmp_path, monkeypatch):
    # the Python API has no __main__ refusal: inside a torchrun group each process would reserve and charge alone
    from privtune.errors import InvalidParameterError
    from privtune.hpo.tune import tune

    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(k, v)
    ledger = tmp_path / "ledger.db"
    with pytest.raises(InvalidParameterError, match="one of 2 processes of a data-parallel group"):
        tune(epsilon=1.0, ledger=f"sqlite:///{ledger}", output_dir=tmp_path / "run", quiet=True)
    assert not ledger.exists() and not (tmp_path / "run").exists()
