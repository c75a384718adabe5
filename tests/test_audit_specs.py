"""The audit's typed specs: AuditSpec (what privtune.audit audits) and ProbeSpec (the white-box probe) are
validated when built, fill in their defaults, and the flat audit() runs the same audit as run_audit on them."""

from __future__ import annotations

import pytest

from privtune.audit import AuditSpec, ProbeSpec
from privtune.audit.blackbox import AuditInputs, audit, run_audit
from privtune.errors import InvalidParameterError
from privtune.models.testing import make_toy_text_files
from privtune.specs import ClippingSpec, PrivacySpec, ScheduleSpec

EPS = PrivacySpec(epsilon=1.0, delta=1e-3)


def test_audit_spec_fills_in_its_defaults():
    spec = AuditSpec(privacy=EPS, clipping=ClippingSpec(clip=None, clipping=None))
    assert (spec.mode, spec.clipping.clip, spec.clipping.clipping, spec.optim.name) == ("bitfit", 1.0, "flat", "adam")
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
    (dict(num_canaries=5), "num_canaries"),
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


def test_the_flat_audit_runs_the_spec_audit(tmp_path):
    files = make_toy_text_files(tmp_path, {"train": ("train.tsv", 40, 0)})
    flat = audit(files["train"], labels=[0, 1], epsilon=1.0, delta=1e-3, steps=2, batch_size=10, num_canaries=20,
                 blackbox=False, seed=0, clip=0.5)
    spec = AuditSpec(privacy=EPS, schedule=ScheduleSpec(steps=2, batch_size=10), clipping=ClippingSpec(clip=0.5),
                     num_canaries=20, blackbox=False, seed=0)
    typed = run_audit(spec, AuditInputs(data=files["train"], labels=[0, 1]))
    assert typed.blackbox is None and typed.whitebox.scores == flat.whitebox.scores
    assert typed.whitebox.config == flat.whitebox.config and typed.whitebox.config["clip"] == 0.5
    with pytest.raises(InvalidParameterError, match="`data` is required"):
        AuditInputs(data=None)
