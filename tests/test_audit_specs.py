"""The audit's typed specs: AuditSpec (what privtune.audit audits) and ProbeSpec (the white-box probe) are
validated when built and fill in their defaults; AuditSpec.create builds the nested specs from flat keywords, the
CLI builds the spec from its options, and audit(data, spec) runs the same audit as run_audit."""

from __future__ import annotations

import pytest

from privtune.audit import AuditSpec, ExposureSpec, ProbeSpec
from privtune.audit.blackbox import AuditInputs, audit, run_audit
from privtune.errors import InvalidParameterError
from privtune.models.testing import make_toy_text_files
from privtune.specs import ClippingSpec, OptimizerSpec, PrivacySpec, ScheduleSpec

EPS = PrivacySpec(epsilon=1.0, delta=1e-3)


def test_audit_spec_fills_in_its_defaults():
    spec = AuditSpec(privacy=EPS, clipping=ClippingSpec(clip=None, clipping=None)).for_data(generation=False)
    assert (spec.mode, spec.clipping.clip, spec.clipping.clipping, spec.optim.name) == ("bitfit", 1.0, "flat", "adam")
    assert (spec.num_canaries, spec.exposure.canary_digits, spec.exposure.reference) == (1000, 6, True)
    assert (spec.max_rows_per_unit, spec.canary_rows) == (None, None)
    unit = AuditSpec(privacy=EPS, privacy_unit="user_id")
    assert (unit.max_rows_per_unit, unit.canary_rows) == (8, 8)  # r defaults to k: the most a unit puts into a step
    assert AuditSpec(privacy=EPS, privacy_unit="user_id", max_rows_per_unit=2, canary_rows=3).canary_rows == 3


@pytest.mark.parametrize("kw, match", [
    (dict(whitebox=False, blackbox=False), "Nothing to audit"),
    (dict(whitebox="yes"), "whitebox"),
    (dict(privacy=PrivacySpec(noise_multiplier=1e-9)), "noise_multiplier"),
    (dict(mode="two-phase"), "mode"),
    (dict(schedule=ScheduleSpec(sampling="shuffle")), "sampling"),
    (dict(num_canaries=5), "num_canaries.*CLI: --canaries"),
    (dict(confidence=1.5), "confidence"),
    (dict(public_data=1), "public_data"),
    (dict(seed=-1), "seed"),
    (dict(canary_rows=3), "only with `privacy_unit`"),
    (dict(privacy_unit=3), "privacy_unit"),
    (dict(privacy_unit="u", max_rows_per_unit=0), "max_rows_per_unit"),
    (dict(privacy_unit="u", canary_rows=0), "canary_rows"),
])
def test_audit_spec_refuses_bad_values_when_built(kw, match):
    with pytest.raises(InvalidParameterError, match=match):
        AuditSpec(**{"privacy": EPS, **kw})


def test_probe_spec_width_and_checks():
    assert ProbeSpec(num_canaries=101, num_classes=2).width == 51  # one coordinate per Dirac canary
    assert ProbeSpec(canary="random").width == 64 and ProbeSpec(num_features=7, canary="random").width == 7
    for kw, match in [(dict(num_canaries=100, num_features=10), "num_features"), (dict(canary="x"), "canary"),
                      (dict(num_classes=1), "num_classes"), (dict(rows_per_unit=0), "rows_per_unit"),
                      (dict(learning_rate=0), "learning_rate"), (dict(background_examples=-1), "background")]:
        with pytest.raises(InvalidParameterError, match=match):
            ProbeSpec(**kw)


def test_create_builds_the_nested_specs_from_flat_keywords():
    made = AuditSpec.create(epsilon=1.0, delta=1e-3, mode="last-layer", steps=2, batch_size=10, sampling="full_batch",
                            max_physical_batch_size=8, optimizer="sgd", learning_rate=0.1, clip=0.5,
                            clipping="automatic", num_canaries=20, blackbox=False, seed=0, privacy_unit="u",
                            max_rows_per_unit=2)
    assert made == AuditSpec(
        privacy=EPS, mode="last-layer",
        schedule=ScheduleSpec(steps=2, batch_size=10, sampling="full_batch", max_physical_batch_size=8),
        optim=OptimizerSpec(name="sgd", learning_rate=0.1), clipping=ClippingSpec(clip=0.5, clipping="automatic"),
        num_canaries=20, blackbox=False, seed=0, privacy_unit="u", max_rows_per_unit=2)
    assert made.canary_rows == 2
    assert AuditSpec.create(noise_multiplier=1.0) == AuditSpec(privacy=PrivacySpec(noise_multiplier=1.0))


@pytest.mark.parametrize("kw, match", [
    (dict(epsilon=1.0, bogus=1), "does not take `bogus`"),
    (dict(epsilon=1.0, privacy=EPS), "does not take `privacy`"),  # the nested specs' keywords are spelled out
    (dict(), "exactly one of `epsilon`"),
    (dict(epsilon=1.0, optimizer="nope"), "optimizer"),
    (dict(epsilon=1.0, clip=-1.0), "clip"),
    (dict(epsilon=1.0, epochs=1.0, steps=2), "either `epochs` or `steps`"),
])
def test_create_refuses_bad_keywords_in_one_error(kw, match):
    with pytest.raises(InvalidParameterError, match=match):
        AuditSpec.create(**kw)


def test_a_spec_of_the_wrong_type_is_one_clear_error(tmp_path):
    with pytest.raises(InvalidParameterError, match="`privacy` must be a PrivacySpec"):
        AuditSpec(privacy={"epsilon": 1.0})
    with pytest.raises(InvalidParameterError, match="`schedule` must be a ScheduleSpec"):
        AuditSpec(privacy=EPS, schedule={"steps": 2})
    for spec in (None, {"epsilon": 1.0}):
        with pytest.raises(InvalidParameterError, match="`spec` must be an AuditSpec"):
            audit(tmp_path / "train.tsv", spec)
    with pytest.raises(InvalidParameterError, match="`data` is required"):
        AuditInputs(data=None)


def test_audit_runs_the_spec_audit(tmp_path):
    files = make_toy_text_files(tmp_path, {"train": ("train.tsv", 40, 0)})
    spec = AuditSpec(privacy=EPS, schedule=ScheduleSpec(steps=2, batch_size=10), clipping=ClippingSpec(clip=0.5),
                     num_canaries=20, blackbox=False, seed=0)
    report = audit(files["train"], spec, labels=[0, 1])
    typed = run_audit(spec, AuditInputs(data=files["train"], labels=[0, 1]))
    assert typed.blackbox is None and typed.whitebox.scores == report.whitebox.scores
    assert typed.whitebox.config == report.whitebox.config and typed.whitebox.config["clip"] == 0.5


def test_the_cli_builds_the_spec_from_its_options(tmp_path, monkeypatch):
    from privtune.audit import blackbox
    from privtune.audit.blackbox import AuditReport
    from privtune.cli import main

    seen = []
    monkeypatch.setattr(blackbox, "run_audit", lambda spec, inputs: seen.append((spec, inputs)) or AuditReport())
    rc = main(["audit", "--data", "d.tsv", "--labels", "0,1", "--mode", "last-layer", "--epsilon", "2", "--delta",
               "1e-3", "--steps", "3", "--batch-size", "20", "--learning-rate", "0.1", "--clip", "0.5", "--optimizer",
               "sgd", "--canaries", "20", "--no-whitebox", "--public-data", "--confidence", "0.9", "--seed", "4",
               "--privacy-unit", "u", "--max-rows-per-unit", "3", "--canary-rows", "2", "--ledger", "sqlite:///x.db",
               "--output", str(tmp_path / "o"), "--max-physical-batch-size", "8", "--quiet", "--canary-digits", "4",
               "--candidates", "500", "--no-reference"])
    assert rc == 0
    (spec, inputs), = seen
    assert spec.exposure == ExposureSpec(canary_digits=4, candidates=500, reference=False)
    assert inputs.data == "d.tsv" and spec == AuditSpec.create(canary_digits=4, candidates=500, reference=False,
        mode="last-layer", epsilon=2.0, delta=1e-3, steps=3, batch_size=20, learning_rate=0.1, clip=0.5,
        optimizer="sgd", num_canaries=20, whitebox=False, public_data=True, confidence=0.9, seed=4,
        privacy_unit="u", max_rows_per_unit=3, canary_rows=2, max_physical_batch_size=8)
    assert inputs == blackbox.AuditInputs(data="d.tsv", model=None, labels="0,1", text_column=None,
                                          label_column=None, max_length=None, ledger="sqlite:///x.db", device=None,
                                          resume=False, output_dir=str(tmp_path / "o"), progress=False,
                                          on_output_ready=None)  # --output given: nothing to announce


def test_a_bad_cli_option_is_one_error_line(capsys):
    from privtune.cli import main

    assert main(["audit", "--data", "d.tsv", "--epsilon", "1", "--canaries", "5", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "num_canaries" in err and len(err.strip().splitlines()) == 1
