"""How far the fast PLD self-composition is from dp_accounting's public one at huge T.

    python bench/fast_pld_large_t.py            # the cases below, ~10 s on one core

For each (σ, q, interval, T): ε at δ = 1e-5 from privtune's fast path (_fast_pld.self_compose: real
FFT of scipy's next_fast_len, one power) and from dp_accounting's public PLDPmf.self_compose (numpy
FFT of another length).  Both are float64 FFT-power evaluations of the same exact convolution; their
difference measures the rounding error of raising an FFT to the power T (it grows ~T·u).  The
accountant adds LARGE_T_MARGIN (relative) to ε for any self-composition above LARGE_T_EXACT_UP_TO steps;
this script prints the relative differences that margin must dominate.
"""
import sys
import time

from privtune.accounting import _fast_pld as fp
from privtune.accounting.accountant import LARGE_T_EXACT_UP_TO, LARGE_T_MARGIN

CASES = [(1.0, 1e-2, 1e-2, 10**4), (1.0, 1e-2, 1e-3, 10**4), (1.0, 1e-3, 1e-3, 10**5), (1.0, 1e-4, 1e-2, 10**6),
         (1.0, 1e-4, 1e-3, 10**6), (1.0, 1e-4, 1e-2, 10**7), (1.0, 1e-4, 3e-3, 10**7), (1.0, 1e-4, 1e-3, 10**7),
         (1.0, 1e-4, 3e-5, 10**7), (0.6, 1e-5, 1e-2, 10**8), (0.6, 1e-5, 3e-3, 10**8), (0.6, 1e-5, 1e-4, 10**8),
         (2.0, 1e-3, 1e-2, 10**7)]

worst = 0.0
for sigma, q, h, T in CASES:
    t0 = time.perf_counter()
    base = fp.public_gaussian_pld(sigma, q, h)
    fast = fp._fast_self_compose(base, T).get_epsilon_for_delta(1e-5)
    public = fp.public_self_compose(base, T).get_epsilon_for_delta(1e-5)
    rel = (fast - public) / public
    worst = max(worst, abs(rel)) if T > LARGE_T_EXACT_UP_TO else worst
    print(f"σ={sigma:g} q={q:g} h={h:g} T={T:.0e}: fast {fast:.8f} public {public:.8f} rel {rel:+.2e} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
print(f"largest |relative difference| above T = {LARGE_T_EXACT_UP_TO:.0e}: {worst:.2e}; margin {LARGE_T_MARGIN:g}")
sys.exit(0 if worst * 10 <= LARGE_T_MARGIN else 1)
