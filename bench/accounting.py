"""Benchmark of privtune's accounting: σ calibration and heterogeneous composition.

One table per part, all numbers measured in the same run (the machine may be shared: timings
are wall-clock and include any contention; compare ratios within one run).

1. Calibration over ε ∈ {0.5, 1, 3, 8}, q ∈ {0.001, 0.01, 0.1, 1}, T ∈ {1, 100, 5000}, δ = 1e-5:
   privtune's ``calibrate_noise_multiplier`` (PLD) against dp_accounting's own
   ``calibrate_dp_mechanism`` with ``PLDAccountant`` (default discretisation 1e-4, tol 1e-5): the
   *tight PLD reference* σ_ref) and, when installed, Opacus ``get_noise_multiplier`` (PRV and
   RDP).  "excess" = σ/σ_ref − 1 (positive = more noise than needed); "ε_ref" = ε of the returned σ
   under dp_accounting's PLDAccountant at 1e-4 (must be ≤ target for a valid σ); speed-up =
   t_dp_accounting / t_privtune.
2. Heterogeneous composition of n ∈ {10, 50, 200} distinct tuning trials (σ, q, T): privtune
   ``compute_epsilon`` (PLD, automatic discretisation) vs a naive ``PLDAccountant`` (1e-4)
   composition and dp_accounting RDP.

Usage: ``python bench/accounting.py`` (full, several minutes) or ``--quick`` (3 calibration cases and n ∈ {10, 50}; ~1 min, mostly the dp_accounting baseline).
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import numpy as np

logging.getLogger("absl").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def dpa_pld_calibrate(eps, delta, q, T):
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant as pa

    def ev(s):
        g = dpa.GaussianDpEvent(s)
        return dpa.SelfComposedDpEvent(g if q >= 1 else dpa.PoissonSampledDpEvent(q, g), T)

    return dpa.calibrate_dp_mechanism(pa.PLDAccountant, ev, eps, delta, tol=1e-5)


def dpa_pld_epsilon(sigma, q, T, delta):
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant as pa

    g = dpa.GaussianDpEvent(sigma)
    a = pa.PLDAccountant()
    a.compose(dpa.SelfComposedDpEvent(g if q >= 1 else dpa.PoissonSampledDpEvent(q, g), T))
    return a.get_epsilon(delta)


def opacus_calibrate(eps, delta, q, T, accountant):
    from opacus.accountants.utils import get_noise_multiplier

    return get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q, steps=T,
                                accountant=accountant)


def calibration_table(quick: bool):
    from rich.console import Console
    from rich.table import Table

    from privtune.accounting import calibrate_noise_multiplier

    try:
        import opacus  # noqa: F401

        have_opacus = True
    except ImportError:
        have_opacus = False
    delta = 1e-5
    if quick:
        grid = [(1, 0.01, 5000), (8, 0.1, 100), (0.5, 1, 100)]
    else:
        grid = [(e, q, T) for e in (0.5, 1, 3, 8) for q in (0.001, 0.01, 0.1, 1) for T in (1, 100, 5000)]
    t = Table(title=f"σ calibration, δ = {delta:g} (σ_ref: dp_accounting PLD calibrate, interval 1e-4, tol 1e-5)")
    for c in ["ε", "q", "T", "σ_ref", "t_ref s", "privtune σ", "excess", "ε_ref(σ)", "t s", "speed-up"] + (
            ["Opacus PRV σ", "excess", "t s", "Opacus RDP σ", "excess", "t s"] if have_opacus else []):
        t.add_column(c, justify="right")
    rows = []
    for e, q, T in grid:
        ref, t_ref = _timed(lambda: dpa_pld_calibrate(e, delta, q, T))
        s, t_s = _timed(lambda: calibrate_noise_multiplier(e, delta, q, T))
        eps_chk = dpa_pld_epsilon(s, q, T, delta)
        row = [f"{e:g}", f"{q:g}", str(T), f"{ref:.5f}", f"{t_ref:.2f}", f"{s:.5f}", f"{s / ref - 1:+.3%}",
               f"{eps_chk:.5f}", f"{t_s:.3f}", f"{t_ref / t_s:.1f}×"]
        rows.append((e, q, T, ref, s, t_ref, t_s))
        if have_opacus:
            for acc_name in ("prv", "rdp"):
                try:
                    so, t_o = _timed(lambda: opacus_calibrate(e, delta, q, T, acc_name))
                    row += [f"{so:.5f}", f"{so / ref - 1:+.2%}", f"{t_o:.2f}"]
                except Exception as exc:  # noqa: BLE001 - report, don't crash the table
                    row += [f"failed ({type(exc).__name__})", "", ""]
        t.add_row(*row)
    Console(width=250).print(t)
    excess = [r[4] / r[3] - 1 for r in rows]
    times = [r[6] for r in rows]
    print(f"privtune: max excess σ {max(excess):+.3%}, median time {np.median(times):.3f} s, "
          f"max time {max(times):.3f} s; dp_accounting median time {np.median([r[5] for r in rows]):.2f} s")
    return rows


def _trials(n, seed=0):
    from privtune.accounting import DPSGDEvent

    r = np.random.default_rng(seed)
    return [DPSGDEvent(float(r.uniform(0.8, 2.0)), float(10 ** r.uniform(-3, -1.5)), int(r.integers(100, 1000)),
                       label=f"trial {i}") for i in range(n)]


def composition_table(quick: bool):
    from dp_accounting.pld import pld_privacy_accountant as pa
    from dp_accounting.rdp import rdp_privacy_accountant as ra
    from rich.console import Console
    from rich.table import Table

    import privtune.accounting.accountant as acc
    from privtune.accounting import account, to_dp_event

    delta = 1e-5
    t = Table(title="Heterogeneous composition of n distinct trials (σ ∈ [0.8, 2], q ∈ [1e-3, 0.03], T ∈ [100, 1000])")
    for c in ["n", "privtune PLD ε", "interval", "t s", "naive PLD(1e-4) ε", "t s", "speed-up", "RDP ε", "t s"]:
        t.add_column(c, justify="right")
    for n in ((10, 50) if quick else (10, 50, 200)):
        ev = _trials(n)
        acc._composed_pld.cache_clear()
        acc._segment_pld.cache_clear()
        acc._base_pld.cache_clear()
        res, t_p = _timed(lambda: account(ev, delta))
        naive_ok = (not quick) or n <= 10
        if naive_ok:
            def naive():
                a = pa.PLDAccountant()
                a.compose(to_dp_event(ev))
                return a.get_epsilon(delta)
            e_n, t_n = _timed(naive)
        def rdp():
            a = ra.RdpAccountant()
            a.compose(to_dp_event(ev))
            return a.get_epsilon(delta)
        e_r, t_r = _timed(rdp)
        t.add_row(str(n), f"{res.epsilon:.4f}", f"{res.value_discretization_interval:g}", f"{t_p:.2f}",
                  f"{e_n:.4f}" if naive_ok else "skipped (--quick)", f"{t_n:.1f}" if naive_ok else "",
                  f"{t_n / t_p:.1f}×" if naive_ok else "", f"{e_r:.4f}", f"{t_r:.2f}")
    Console(width=200).print(t)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small subset (~1 min)")
    args = p.parse_args(argv)
    import os

    print(f"machine: {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} at start "
          "(shared machine: wall-clock times include contention)")
    calibration_table(args.quick)
    composition_table(args.quick)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
