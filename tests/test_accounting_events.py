import math

import pytest

from privtune.accounting.events import (
    DPSGDEvent,
    GaussianEvent,
    RepeatAndSelectEvent,
    describe_event,
    event_from_dict,
    event_to_dict,
)
from privtune.errors import CertificateError, InvalidParameterError


def test_round_trip_all_kinds():
    inner = DPSGDEvent(noise_multiplier=1.1, sample_rate=0.01, steps=500, label="trial")
    events = [
        GaussianEvent(2.0, count=3),
        inner,
        DPSGDEvent(0.9, 0.1, 30, sampling="shuffle", assume_poisson=True),
        RepeatAndSelectEvent(events=(inner,), mean=10, shape=1),
    ]
    for e in events:
        assert event_from_dict(event_to_dict(e)) == e


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(noise_multiplier=0, sample_rate=0.1, steps=1),
        dict(noise_multiplier=-1, sample_rate=0.1, steps=1),
        dict(noise_multiplier=math.nan, sample_rate=0.1, steps=1),
        dict(noise_multiplier=1, sample_rate=0, steps=1),
        dict(noise_multiplier=1, sample_rate=1.5, steps=1),
        dict(noise_multiplier=1, sample_rate=0.1, steps=0),
        dict(noise_multiplier=1, sample_rate=0.1, steps=2.5),
        dict(noise_multiplier=1, sample_rate=0.1, steps=1, sampling="uniform"),
        dict(noise_multiplier=1, sample_rate=0.5, steps=1, sampling="full_batch"),
        dict(noise_multiplier=1, sample_rate=0.5, steps=1, assume_poisson=True),
    ],
)
def test_bad_dpsgd_event(kwargs):
    with pytest.raises(InvalidParameterError):
        DPSGDEvent(**kwargs)


def test_error_names_argument_and_value():
    with pytest.raises(InvalidParameterError, match=r"`sample_rate` must be .*Got 1.5"):
        DPSGDEvent(1.0, 1.5, 10)


def test_unknown_kind_or_field_is_refused_not_dropped():
    with pytest.raises(CertificateError, match="Unknown event kind"):
        event_from_dict({"kind": "laplace", "scale": 1})
    d = event_to_dict(GaussianEvent(1.0))
    d["extra_cost"] = 3
    with pytest.raises(CertificateError, match="unknown fields"):
        event_from_dict(d)


def test_shuffle_epochs_and_description():
    e = DPSGDEvent(1.0, 0.1, 25, sampling="shuffle")
    assert e.epochs == 3
    assert "shuffle" in describe_event(e)
