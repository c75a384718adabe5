"""The validated spec objects (issue 14 item 2) and the short train()/tune() they allow.

``privtune.specs`` holds frozen, validated PrivacySpec / ScheduleSpec / OptimizerSpec / ClippingSpec /
LoraSpec; train() and tune() build them at the boundary.  Their bodies are short stages of one pipeline
(validate -> load -> plan -> reserve -> run -> certify -> write) that share RUN_DIR's one writer.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import privtune
from privtune import specs
from privtune.errors import InvalidParameterError, PrivtuneError
from privtune.specs import (ClippingSpec, LoopOptions, LoraSpec, NoiseSpec, OptimizerSpec, PrivacySpec,
                            ScheduleSpec)

SRC = Path(privtune.__file__).resolve().parent


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _body_lines(fn: ast.FunctionDef) -> int:
    """Lines of a function's body, without its docstring."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1


@pytest.mark.parametrize("path, name", [("training.py", "train"), ("hpo/tune.py", "tune")])
def test_train_and_tune_bodies_are_under_100_lines(path, name):
    fn = _functions(SRC / path)[name]
    assert _body_lines(fn) < 100, f"{path}:{name} body is {_body_lines(fn)} lines"


def test_no_function_body_of_the_tune_module_is_longer_than_120_lines():
    # docstrings do not count: tune()'s documents its 33 keyword arguments
    long = {name: _body_lines(fn) for name, fn in _functions(SRC / "hpo" / "tune.py").items() if _body_lines(fn) > 120}
    assert not long, long
    assert _body_lines(_functions(SRC / "hpo" / "tune.py")["_execute"]) < 120


# ------------------------------------------------------------------------------------------ the specs


def test_specs_are_public_and_exported_lazily():
    for name in specs.__all__:
        assert getattr(privtune, name) is getattr(specs, name)
        assert name in dir(privtune)


@pytest.mark.parametrize("spec, field", [
    (PrivacySpec(epsilon=1.0, delta=1e-5), "epsilon"),
    (ScheduleSpec(steps=3), "steps"),
    (OptimizerSpec(), "learning_rate"),
    (ClippingSpec(), "clip"),
    (LoraSpec(), "rank"),
    (NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=3), "steps"),
    (LoopOptions(), "seed"),
])
def test_specs_are_frozen(spec, field):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(spec, field, 2)


@pytest.mark.parametrize("make, match", [
    (lambda: PrivacySpec(epsilon=0.0, delta=1e-5), r"`epsilon` must be a finite number in \(0, inf\). Got 0.0"),
    (lambda: PrivacySpec(epsilon=float("nan")), "`epsilon` must be a finite number"),
    (lambda: PrivacySpec(epsilon=1.0, delta=1.5), r"`delta` must be a finite number in \(0, 1\). Got 1.5"),
    (lambda: NoiseSpec(noise_multiplier=-1.0, sample_rate=0.5, steps=1), "`noise_multiplier` must be"),
    (lambda: NoiseSpec(noise_multiplier=1.0, sample_rate=1.5, steps=1), "`sample_rate` must be"),
    (lambda: NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=0), "`steps` must be"),
    (lambda: NoiseSpec(noise_multiplier=1.0, sample_rate=0.5, steps=1, sampling="possion"), "`sampling` must be"),
    (lambda: LoopOptions(max_physical_batch_size=0), "`max_physical_batch_size` must be"),
    (lambda: LoopOptions(nonfinite_features="keep"), "`nonfinite_features` must be one of"),
    (lambda: ClippingSpec(gamma=0.0), "`gamma` must be"),
    (lambda: OptimizerSpec(eps=-1.0), "`eps` must be"),
    (lambda: PrivacySpec(), "exactly one of `epsilon`"),
    (lambda: PrivacySpec(epsilon=1.0, noise_multiplier=1.0), "exactly one of `epsilon`"),
    (lambda: PrivacySpec(noise_multiplier=-1.0), "`noise_multiplier` must be"),
    (lambda: PrivacySpec(epsilon=1.0, accountant="rpd"), "`accountant` must be one of .* Did you mean 'rdp'"),
    (lambda: PrivacySpec.with_target(None), "`epsilon` must be a finite number"),
    (lambda: ScheduleSpec(epochs=1, steps=2), "`epochs` or `steps`, not both"),
    (lambda: ScheduleSpec(steps=0), r"`steps` must be an integer in \[1, inf\]"),
    (lambda: ScheduleSpec(steps=2.5), "`steps` must be an integer"),
    (lambda: ScheduleSpec(epochs=-1), "`epochs` must be a finite number"),
    (lambda: ScheduleSpec(batch_size=0), "`batch_size` must be an integer"),
    (lambda: ScheduleSpec(sampling="poison"), "`sampling` must be one of .* Did you mean 'poisson'"),
    (lambda: ScheduleSpec(assume_poisson=True), "`assume_poisson` only applies to sampling='shuffle'"),
    (lambda: ScheduleSpec(assume_poisson="yes"), "`assume_poisson` must be True or False"),
    (lambda: ScheduleSpec(max_physical_batch_size=0), "`max_physical_batch_size` must be an integer"),
    (lambda: OptimizerSpec(name="adamm"), "`optimizer` must be one of .* Did you mean 'adam'"),
    (lambda: OptimizerSpec(learning_rate=0), "`learning_rate` must be a finite number"),
    (lambda: OptimizerSpec(momentum=1.0), r"`momentum` must be a finite number in \[0, 1\)"),
    (lambda: OptimizerSpec(weight_decay=-0.1), "`weight_decay` must be a finite number"),
    (lambda: OptimizerSpec(backbone_lr_scale=0.0), r"`backbone_lr_scale` must be a finite number in \(0, 1\]"),
    (lambda: OptimizerSpec(backbone_lr_scale=2), r"`backbone_lr_scale` must be a finite number in \(0, 1\]"),
    (lambda: ClippingSpec(clip=-1.0), "`clip` must be a finite number"),
    (lambda: ClippingSpec(clipping="auto"), "`clipping` must be one of"),
    (lambda: ClippingSpec(per_layer="yes"), "`per_layer_clipping` must be True or False"),
    (lambda: LoraSpec(rank=0), r"`lora_rank` must be an integer in \[1, inf\]"),
    (lambda: LoraSpec(alpha=0), "`lora_alpha` must be a finite number"),
    (lambda: LoraSpec(target_modules=[]), "`lora_target_modules` must be a non-empty list"),
    (lambda: LoraSpec.for_mode("bitfit", rank=4), "`lora_rank` only applies to mode='lora'"),
])
def test_a_bad_value_is_one_clear_error(make, match):
    with pytest.raises(InvalidParameterError, match=match) as err:
        make()
    assert isinstance(err.value, PrivtuneError) and "\n" not in str(err.value)


def test_specs_normalise_what_they_accept():
    assert ScheduleSpec(steps=4.0, batch_size=8.0).steps == 4 and isinstance(ScheduleSpec(steps=4.0).steps, int)
    assert LoraSpec(target_modules=" query, value").target_modules == ("query", "value")
    assert LoraSpec.for_mode("bitfit") is None
    assert LoraSpec.for_mode("lora", rank=2) == LoraSpec(rank=2, alpha=specs.DEFAULT_LORA_ALPHA)
    assert OptimizerSpec(name=None).for_mode("bitfit").name == specs.DEFAULT_OPTIMIZER
    assert OptimizerSpec(learning_rate=None).for_mode("full").learning_rate > 0
    from privtune.finetune.modes import default_backbone_lr_scale

    for mode in ("full", "bitfit", "lora", "last-layer", "two-phase"):  # α: the mode's default unless given
        assert OptimizerSpec().for_mode(mode).backbone_lr_scale == default_backbone_lr_scale(mode)
        assert OptimizerSpec(backbone_lr_scale=0.5).for_mode(mode).backbone_lr_scale == 0.5
    assert default_backbone_lr_scale("last-layer") == 1.0  # the head alone: nothing for α to scale
    assert ClippingSpec(clip=None, clipping=None).with_defaults() == ClippingSpec()


def test_privacy_for_a_dataset_defaults_delta_and_refuses_one_above_1_over_n():
    assert PrivacySpec(epsilon=1.0).for_dataset(1000).delta == 1e-5
    assert PrivacySpec(epsilon=1.0).for_dataset(10**7).delta < 1e-7
    with pytest.raises(InvalidParameterError, match="must be < 1/n"):
        PrivacySpec(epsilon=1.0, delta=0.01).for_dataset(1000)


def test_train_refuses_through_the_specs_before_reading_data(tmp_path):
    missing = tmp_path / "never-read.tsv"  # a bad option is refused before the data is looked at
    with pytest.raises(InvalidParameterError, match=r"`momentum` must be a finite number in \[0, 1\)"):
        privtune.train(missing, epsilon=1.0, momentum=1.5, progress=False)
    with pytest.raises(InvalidParameterError, match="`max_physical_batch_size`"):
        privtune.tune(missing, epsilon=1.0, max_physical_batch_size=0, quiet=True, write_files=False)


# ------------------------------------------------------------------------------ one RUN_DIR writer


def test_train_and_tune_release_through_the_one_run_dir_writer(tmp_path, monkeypatch):
    from privtune.models.testing import make_toy_text_files

    files = make_toy_text_files(tmp_path / "data", {"train": ("train.tsv", 60, 0), "public": ("public.tsv", 20, 1)})
    from privtune.run import release

    commands = []
    real = release.write_release

    def spy(run_dir, **kw):
        commands.append(kw["command"])
        return real(run_dir, **kw)

    monkeypatch.setattr(release, "write_release", spy)
    privtune.train(files["train"], model=files["model"], mode="last-layer", epsilon=2.0, delta=1e-3, steps=2,
                   batch_size=20, ledger=f"sqlite:///{tmp_path / 'train.db'}", output_dir=tmp_path / "train", progress=False, labels=[0, 1])
    privtune.tune(files["train"], public_eval_data=files["public"], model=files["model"], mode="last-layer",
                  strategy="single-step", epsilon=2.0, delta=1e-3, ledger=f"sqlite:///{tmp_path / 'tune.db'}",
                  output_dir=tmp_path / "tune",
                  quiet=True, labels=[0, 1])
    assert commands == ["train", "tune"]
    for run in ("train", "tune"):
        assert (tmp_path / run / "certificate.json").is_file() and (tmp_path / run / "model").is_dir()


def test_tune_publishes_the_ledger_url_with_its_password_masked(tmp_path, monkeypatch):
    # privtune train masks a password in the ledger URL; tune published it in metrics.json and log.txt
    import importlib
    import json

    from privtune.ledger import Ledger
    from privtune.models.testing import make_toy_text_files

    ledger_mod = importlib.import_module("privtune.ledger.ledger")  # open_ledger builds the Ledger there
    files = make_toy_text_files(tmp_path / "data", {"train": ("train.tsv", 60, 0), "public": ("public.tsv", 20, 1)})
    local = f"sqlite:///{tmp_path / 'l.db'}"

    class LocalLedger(Ledger):  # stands in for a PostgreSQL server: the URL is the user's, the storage local
        def __init__(self, url, **kw):
            super().__init__(local, **kw)

    monkeypatch.setattr(ledger_mod, "Ledger", LocalLedger)
    r = privtune.tune(files["train"], public_eval_data=files["public"], model=files["model"], mode="last-layer",
                      strategy="single-step", epsilon=2.0, delta=1e-3, output_dir=tmp_path / "run", quiet=True,
                      labels=[0, 1], ledger="postgresql://alice:s3cret@db.example/privtune")
    assert r.metrics["ledger_url"] == "postgresql://alice:***@db.example/privtune"
    for name in ("metrics.json", "log.txt", "certificate.json"):
        assert "s3cret" not in (r.run_dir / name).read_text(encoding="utf-8"), name
    assert "s3cret" not in json.dumps(r.metrics)
