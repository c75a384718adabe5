"""Empirical privacy auditing in one training run (Steinke, Nasr & Jagielski 2023).

* :func:`epsilon_lower_bound`, :func:`p_value`: the exact bound from m canaries, r guesses, v correct.
* :func:`audit_dp_step`: white-box audit of the DP step (gradient canaries in the real engine), of a
  :class:`~privtune.specs.NoiseSpec` claim with a :class:`ProbeSpec`.
* :func:`audit`: black-box audit of a real ``train`` run on the user's configuration (input canaries,
  scored by their loss); it trains on the user's data and is charged to the ledger like ``train``.  On
  prompt → response data its canaries are secret digit codes, and it also reports their exposure
  (:mod:`privtune.audit.exposure`, an :class:`ExposureSpec`).

A lower bound is evidence, not proof: above the claimed ε it shows a bug; below it, it shows nothing
about the claim being tight or correct.  See docs/auditing.md.
"""

from __future__ import annotations

import sys
import types

from privtune.audit.bounds import epsilon_lower_bound, max_epsilon_lower_bound, p_value
from privtune.audit.result import AuditResult, best_guesses
from privtune.audit.specs import AuditSpec, ExposureSpec, ProbeSpec
from privtune.audit.whitebox import audit_dp_step


def __getattr__(name: str):
    if name == "audit":  # imports the training stack only when used
        from privtune.audit.blackbox import audit

        return audit
    raise AttributeError(f"module 'privtune.audit' has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """``privtune.audit`` is both this package and the function :func:`privtune.audit.audit`: once the package
    is imported it shadows the lazily exported function on ``privtune``, so calling it runs the audit."""

    def __call__(self, *args, **kwargs):
        from privtune.audit.blackbox import audit

        return audit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["epsilon_lower_bound", "max_epsilon_lower_bound", "p_value", "AuditResult", "best_guesses",
           "audit_dp_step", "audit", "AuditSpec", "ExposureSpec", "ProbeSpec"]
