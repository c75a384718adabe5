"""One DP loop: `train`, every `tune` mode and strategy, and hyperfree's learning-rate
probe all run through `privtune.training._Loop`; every Gaussian release draws its noise in
`engine/mechanisms.py`;
one clip-factor rule; `device=` reaches tune's trials."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest
import torch

import privtune
import privtune.training as training
from privtune.cli import main
from privtune.errors import InvalidParameterError
from privtune.models.testing import make_toy_text_files
from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec

SRC = pathlib.Path(privtune.__file__).parent


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("loop"), {"train": ("train.tsv", 120, 0),
                                                                 "public": ("public.tsv", 40, 1),
                                                                 "dev": ("dev.tsv", 40, 2)})


@pytest.fixture
def loop_runs(monkeypatch):
    """Counts runs of the one loop and the hooks each run carried."""
    runs, devices = [], []
    real = training._Loop.run

    def run(self, *a, **k):
        runs.append([type(h).__name__ for h in getattr(self, "hooks", [])])
        devices.append(self.device)
        return real(self, *a, **k)

    monkeypatch.setattr(training._Loop, "run", run)
    run.devices = devices
    return runs


def _cli_tune(files, tmp_path, mode, strategy, *extra):
    out = tmp_path / f"{mode}-{strategy}"
    rc = main(["tune", "--data", files["train"], "--eval-data", files["dev"], "--public-eval-data", files["public"],
               "--model", files["model"], "--mode", mode, "--strategy", strategy, "--epsilon", "2", "--delta", "1e-3",
               "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(out), "--seed", "0", "--quiet",
               *extra])
    assert rc == 0
    return out


@pytest.mark.parametrize("mode,strategy,extra", [
    ("bitfit", "hyperfree", ("--epochs", "1", "--batch-size", "40")),
    ("bitfit", "linear-scaling", ("--epochs", "1", "--batch-size", "40", "--trials", "2")),
    ("last-layer", "hyperfree", ()),
    ("last-layer", "single-step", ()),
])
def test_tune_runs_every_mode_and_strategy_through_the_one_loop(files, tmp_path, loop_runs, mode, strategy, extra):
    _cli_tune(files, tmp_path, mode, strategy, *extra)
    assert loop_runs, f"tune --mode {mode} --strategy {strategy} trained outside privtune.training._Loop"
    if strategy == "hyperfree":  # the run's learning-rate probe is a hook on the loop (not a loop of its own)
        assert loop_runs[-1] == ["LearningRateProbe"]
        # on a model, the η-placement trials before it are plain runs of the same loop
        assert loop_runs[:-1] == ([[]] * 3 if mode == "bitfit" else [])


def test_train_runs_through_the_one_loop(files, tmp_path, loop_runs):
    rc = main(["train", "--data", files["train"], "--labels", "0,1", "--model", files["model"], "--mode", "bitfit",
               "--epsilon", "2", "--delta", "1e-3", "--steps", "2", "--batch-size", "20", "--seed", "0",
               "--ledger", f"sqlite:///{tmp_path / 't.db'}", "--output", str(tmp_path / "train"), "--quiet"])
    assert rc == 0 and len(loop_runs) == 1


def _calls(path: pathlib.Path, names: set[str]) -> list[str]:
    """Qualified names of the functions in ``path`` that call any of ``names`` (as attribute or name)."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            scope = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope = f"{where}.{child.name}" if where else child.name
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in names:
                    found.append(scope)
            visit(child, scope)

    visit(tree, "")
    return found


def test_only_the_mechanisms_module_draws_gaussian_noise():
    """Outside ``audit/`` (which draws synthetic canaries and background rows, never a release of data), the only
    Gaussian draws in privtune are the named mechanisms of ``engine/mechanisms.py``."""
    rel = lambda p: p.relative_to(SRC).as_posix()  # noqa: E731
    draws = {f"{rel(p)}:{fn}" for p in sorted(SRC.rglob("*.py")) for fn in _calls(p, {"randn", "normal_", "normal"})
             if rel(p).split("/")[0] != "audit"}
    assert {d.split(":")[0] for d in draws} == {"engine/mechanisms.py"}, draws


@pytest.fixture
def gaussian_callers(monkeypatch):
    """The privtune files that call torch's Gaussian samplers directly, while the test runs."""
    callers: set[str] = set()

    def recording(real):
        def draw(*args, **kwargs):
            caller = pathlib.Path(sys._getframe(1).f_code.co_filename).resolve()
            if SRC in caller.parents:
                callers.add(caller.relative_to(SRC).as_posix())
            return real(*args, **kwargs)
        return draw

    monkeypatch.setattr(torch, "randn", recording(torch.randn))
    monkeypatch.setattr(torch, "normal", recording(torch.normal))
    monkeypatch.setattr(torch.Tensor, "normal_", recording(torch.Tensor.normal_))
    return callers


def test_every_release_of_a_tune_run_draws_its_noise_in_the_mechanisms_module(files, tmp_path, gaussian_callers):
    """A run with every kind of release: the private feature centre (no public split), charged selection scores,
    clipped gradient sums of a head and of a model, and hyperfree's privatised losses."""
    privtune.tune(files["train"], model=files["model"], mode="last-layer", strategy="random-search",
                  strategy_options={"trials": 2}, selection="train-accuracy", epsilon=2.0, delta=1e-3,
                  ledger=f"sqlite:///{tmp_path / 'head.db'}", output_dir=tmp_path / "head", seed=0, quiet=True,
                  labels=[0, 1])
    _cli_tune(files, tmp_path, "bitfit", "hyperfree", "--epochs", "1", "--batch-size", "40")
    assert gaussian_callers == {"engine/mechanisms.py"}
    cert = (tmp_path / "head" / "certificate.json").read_text()
    assert "private feature mean (centering)" in cert and "score" in cert


@pytest.mark.parametrize("mode, clipping", [("bitfit", "flat"), ("full", "automatic"), ("lora", "flat"),
                                            ("last-layer", "flat"), ("last-layer", "automatic")])
def test_one_clip_factor_rule(files, monkeypatch, mode, clipping):
    """Every mode's DP step scales its per-example terms by ``clip_factors`` and nothing else: with that one
    function made to return zeros and no noise, no trainable weight moves (a second clip rule would move them)."""
    import sys

    from privtune.engine.private_gradient import clip_factors
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier
    from privtune.models.testing import make_toy_text_dataset

    def zero_factors(norms, *args, **kwargs):
        return torch.zeros_like(clip_factors(norms, *args, **kwargs))

    for name, module in list(sys.modules.items()):  # wherever the rule was imported under its name
        if name.startswith("privtune") and getattr(module, "clip_factors", None) is clip_factors:
            monkeypatch.setattr(module, "clip_factors", zero_factors)
    model = load_classifier(files["model"], seed=0)
    apply_mode(model, mode)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    training.fit(model, make_toy_text_dataset(16), noise=NoiseSpec(noise_multiplier=0.0, sample_rate=0.5, steps=2),
                 optimizer=OptimizerSpec(learning_rate=1.0, name="sgd"), clipping=ClippingSpec(clipping=clipping),
                 options=LoopOptions(mode=mode, seed=0), device="cpu")
    trained = {n: p.detach() for n, p in model.named_parameters() if n in before}
    assert trained, "no trainable parameter found"
    moved = [n for n, p in trained.items() if not torch.equal(p, before[n])]
    assert not moved, f"{mode}: weights moved although clip_factors returned 0 for every example: {moved[:5]}"


def test_optimizers_come_only_from_the_optim_factory(files, tmp_path, monkeypatch):
    """Every optimizer a run builds is built inside ``privtune.optim.make_optimizer``, however it is spelled."""
    import sys

    import privtune.optim as optim

    real_factory = optim.make_optimizer
    factory_code = real_factory.__code__
    outside = []
    real_init = torch.optim.Optimizer.__init__

    def recording_init(self, *args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not factory_code:
            frame = frame.f_back
        if frame is None:
            outside.append(type(self).__name__)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", recording_init)
    built = []

    def counting_factory(*args, **kwargs):
        built.append(1)
        return real_factory(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("privtune") and getattr(module, "make_optimizer", None) is real_factory:
            monkeypatch.setattr(module, "make_optimizer", counting_factory)
    for mode, optimizer in (("bitfit", "adam"), ("bitfit", "lamb"), ("last-layer", "sgd")):
        rc = main(["train", "--data", files["train"], "--labels", "0,1", "--model", files["model"], "--mode", mode,
                   "--epsilon", "2", "--delta", "1e-3", "--steps", "1", "--batch-size", "20", "--seed", "0",
                   "--optimizer", optimizer, "--ledger", f"sqlite:///{tmp_path / f'{mode}-{optimizer}.db'}",
                   "--output", str(tmp_path / f"{mode}-{optimizer}"), "--quiet"])
        assert rc == 0
    assert built, "no run built its optimizer through privtune.optim.make_optimizer"
    assert not outside, f"optimizers built outside privtune.optim.make_optimizer: {outside}"


def test_device_reaches_tune_trials(files, tmp_path, monkeypatch):
    import privtune.hpo.backends as backends

    seen = []
    real = backends.fit

    def spy(*a, **k):
        seen.append(k.get("device"))
        return real(*a, **k)

    monkeypatch.setattr(backends, "fit", spy)
    _cli_tune(files, tmp_path, "bitfit", "linear-scaling", "--epochs", "1", "--batch-size", "40", "--trials", "2",
              "--device", "cpu")
    assert seen and all(torch.device(d) == torch.device("cpu") for d in seen)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_tune_refuses_an_absent_device_before_reading_data(files, tmp_path):
    with pytest.raises(InvalidParameterError, match="CUDA is not available"):
        privtune.tune(files["train"], model=files["model"], mode="bitfit", device="cuda", quiet=True,
                      ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "never")
    assert not (tmp_path / "never").exists()  # refused before the run directory or any reservation


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tune_trains_on_cuda(files, tmp_path, monkeypatch):
    devices = []
    real = training._Loop.run

    def run(self, *a, **k):
        devices.append(self.device.type)
        return real(self, *a, **k)

    monkeypatch.setattr(training._Loop, "run", run)
    out2 = tmp_path / "cuda"
    rc = main(["tune", "--data", files["train"], "--eval-data", files["dev"], "--public-eval-data", files["public"],
               "--model", files["model"], "--mode", "bitfit", "--strategy", "hyperfree", "--epsilon", "2",
               "--delta", "1e-3", "--epochs", "1", "--batch-size", "40", "--ledger",
               f"sqlite:///{tmp_path / 'g.db'}", "--output", str(out2), "--seed", "0", "--quiet", "--device", "cuda"])
    assert rc == 0 and (out2 / "certificate.json").is_file() and devices and set(devices) == {"cuda"}  # trials + final


def test_hyperfree_trains_a_model_in_the_loops_eval_mode(tmp_path):
    # one train/eval-mode policy (privtune.training's docstring): dropout off in every step and probe
    from privtune.finetune import apply_mode
    from privtune.hpo import hyperfree as hf
    from privtune.models import load_classifier
    from privtune.models.testing import make_tiny_text_model, make_toy_text_dataset

    m = load_classifier(make_tiny_text_model(tmp_path / "m", sentence_transformers=True), seed=0)
    apply_mode(m, "bitfit", zero_init_head=True)
    modes = []
    m.register_forward_pre_hook(lambda mod, args: modes.append(mod.training))
    m.train()  # whatever the caller left it in
    hf.train_model_hyperfree(m, make_toy_text_dataset(24, seed=0), steps=2, sample_rate=0.5, sigma_g=1.0,
                             sigma_l=5.0, config=hf.HyperfreeConfig(), lr0=1e-3, seed=0)
    assert modes and not any(modes)
