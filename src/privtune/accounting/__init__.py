"""Privacy accounting: events, accountants (PLD default, RDP), calibration, GDP, certificates.

Everything privacy-mathematical is delegated to Google's ``dp_accounting``; see
``docs/accounting.md``.  Typical use::

    from privtune.accounting import DPSGDEvent, compute_epsilon, calibrate_noise_multiplier
    compute_epsilon(DPSGDEvent(noise_multiplier=1.0, sample_rate=0.01, steps=5000), delta=1e-5)  # ≈ 4.2039
    calibrate_noise_multiplier(1.0, 1e-5, sample_rate=0.01, steps=5000)                           # σ ≈ 2.7539
"""

from privtune.accounting.accountant import (
    ACCOUNTANTS,
    AccountingResult,
    account,
    compute_delta,
    compute_epsilon,
    to_dp_event,
)
from privtune.accounting.calibration import (
    DEFAULT_MAX_NOISE_MULTIPLIER,
    calibrate,
    calibrate_loss_noise_multiplier,
    calibrate_noise_multiplier,
    joint_release_events,
)
from privtune.accounting.certificate import Certificate, verify_certificate
from privtune.accounting.events import (
    SAMPLING_SCHEMES,
    DPSGDEvent,
    Event,
    GaussianEvent,
    NonPrivateEvent,
    RepeatAndSelectEvent,
    describe_event,
    event_from_dict,
    event_to_dict,
    group_events,
)
from privtune.accounting import gdp
from privtune.accounting.gdp import joint_noise_multiplier

__all__ = [
    "ACCOUNTANTS",
    "AccountingResult",
    "Certificate",
    "verify_certificate",
    "account",
    "compute_epsilon",
    "compute_delta",
    "to_dp_event",
    "calibrate",
    "calibrate_noise_multiplier",
    "calibrate_loss_noise_multiplier",
    "joint_release_events",
    "joint_noise_multiplier",
    "gdp",
    "DEFAULT_MAX_NOISE_MULTIPLIER",
    "SAMPLING_SCHEMES",
    "DPSGDEvent",
    "Event",
    "GaussianEvent",
    "RepeatAndSelectEvent",
    "NonPrivateEvent",
    "group_events",
    "describe_event",
    "event_from_dict",
    "event_to_dict",
]
