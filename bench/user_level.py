"""User-level DP: what a step costs at the unit level against the example level (``--overhead``).

    python bench/user_level.py --overhead --out bench/results/user_level/overhead.json

``--overhead`` times one DP step of :func:`privtune.training.fit` at the example level and at the unit level
with **the same rows in every step**: a full batch of R rows, at the unit level grouped into R/r units of r
rows with the cap k = r (so every unit contributes all its rows and the engine sees the same R rows; what is
added is the unit sampler, the weights 1/m_u and their multiplication into the clip factors).  Two workloads:

* ``bitfit``: DP-BiTFiT of the bundled all-MiniLM-L6-v2 on R = 64 phrases of the embedded SST-2 subset;
* ``head``: a linear head on R = 4,096 cached 384-d features (random: speed does not depend on the values),
  the closed-form head gradient.

At ``--rates`` below 1 both levels sample Poisson at q (rows at the example level, units at the unit level: the
same expected rows) and the figure is the time per ``R`` rows used.  Each (workload, rate, level) runs
``--steps`` steps after one warm-up step, alternating levels, ``--repeats`` times; the figure is the median CPU
seconds per step (``--clock cpu``: ``time.process_time``, one thread) or wall
seconds (``--clock wall``).  The ratio is user-level over example-level; the target is ≤ 1.2.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _clock(kind: str):
    return time.process_time if kind == "cpu" else time.perf_counter


def _workload(name: str):
    """``(make_model, train_set, rows)`` of a workload: a fresh model per run, the same data."""
    from privtune.data import embedded_sst2
    from privtune.finetune import apply_mode
    from privtune.finetune.last_layer import FeatureSet
    from privtune.models import load_classifier

    if name == "bitfit":
        train = embedded_sst2()[0].subset(range(64))

        def make():
            clf = load_classifier(None, num_labels=2, seed=0)
            apply_mode(clf, "bitfit")
            return clf

        return make, train, 64
    g = torch.Generator().manual_seed(0)
    feats = FeatureSet(torch.randn(4096, 384, generator=g), torch.randint(0, 2, (4096,), generator=g), 2)

    def make_head():
        return torch.nn.Linear(384, 2)

    return make_head, feats, 4096


def _time_steps(make, train, rows: int, steps: int, clock, units: list | None, r: int, q: float = 1.0) -> float:
    """Seconds per step of ``rows`` rows (steps 2 … steps+1; step 1 is the warm-up) of one fit at rate q: the
    median over steps at q = 1 (every step has the same rows); below 1 (Poisson: the rows vary from step to step)
    the total time over the total rows used, times ``rows``."""
    from privtune.specs import LoopOptions, NoiseSpec, OptimizerSpec
    from privtune.training import fit

    marks: list[float] = []
    used: list[int] = []

    def mark(info) -> None:
        marks.append(clock())
        used.append(info.batch_size)

    extra = {} if units is None else {"privacy_unit": units, "max_rows_per_unit": r}
    fit(make(), train, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=q, steps=steps + 1, **extra),
        optimizer=OptimizerSpec(learning_rate=1e-3), options=LoopOptions(seed=0, max_physical_batch_size=rows),
        callback=mark, device="cpu")
    per_step = [b - a for a, b in zip(marks, marks[1:])]
    if q >= 1.0:
        return statistics.median(per_step)
    return sum(per_step) / sum(used[1:]) * rows


def overhead(args) -> dict:
    torch.set_num_threads(1)
    clock = _clock(args.clock)
    out = {"workloads": {}}
    for name in args.workloads:
        make, train, rows = _workload(name)
        units = [i // args.rows_per_unit for i in range(rows)]
        for q in args.rates:
            runs = {"example": [], "user": []}
            for _ in range(args.repeats):
                runs["example"].append(_time_steps(make, train, rows, args.steps, clock, None, args.rows_per_unit, q))
                runs["user"].append(_time_steps(make, train, rows, args.steps, clock, units, args.rows_per_unit, q))
            ex, us = statistics.median(runs["example"]), statistics.median(runs["user"])
            out["workloads"][f"{name} q={q:g}"] = {
                "rows": rows, "units": rows // args.rows_per_unit, "rows_per_unit": args.rows_per_unit,
                "sample_rate": q, "seconds_per_step_of_all_rows": {"example_level": ex, "user_level": us},
                "ratio_user_over_example": us / ex, "repeats": runs}
            print(f"{name} q={q:g}: {rows} rows ({rows // args.rows_per_unit} units of {args.rows_per_unit}): example "
                  f"{ex * 1e3:.2f} ms, user {us * 1e3:.2f} ms per {rows} rows ({args.clock}), ratio {us / ex:.3f}")
    return out


def _machine() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = None
    try:
        import os

        load = os.getloadavg()
    except OSError:
        load = None
    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or
            platform.machine(), "threads": 1, "git_commit": commit, "load_average_at_end": load}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--overhead", action="store_true", help="time a user-level step against an example-level one")
    ap.add_argument("--workloads", nargs="+", default=["head", "bitfit"], choices=("head", "bitfit"))
    ap.add_argument("--rows-per-unit", type=int, default=4, help="r: rows of every unit (and the cap k = r)")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 0.25],
                    help="sampling rates q: 1 (every row each step) and Poisson rates (units at q, rows at q)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per level, alternating")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--out", default=None, help="also write the results as JSON to this path")
    args = ap.parse_args(argv)
    if not args.overhead:
        ap.error("choose what to run: --overhead")
    t0 = time.perf_counter()
    res = overhead(args)
    doc = {"command": " ".join(["python", "bench/user_level.py", *(argv if argv is not None else sys.argv[1:])]),
           "clock": args.clock, "statistic": "median seconds per step over steps, then over repeats",
           "machine": _machine(), "seconds_total_wall": round(time.perf_counter() - t0, 1), **res}
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
