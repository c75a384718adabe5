"""How good is ``privtune tune``'s time-left estimate?  Runs a tune and checks every ``run … left`` in its log.

``privtune tune`` prints, on its progress lines and in ``RUN_DIR/log.txt``, the time left for the current phase
and for the whole tune (``…, 12s left, run 3m40s left``), estimated from the plan (the work still ahead, by
kind: feature caching, pilots, trials, final run, evaluation) and the per-example rates measured so far in the
run.  This script runs a tune, then reads its log.txt: for every line with a whole-tune estimate it compares the
estimate with the time that was actually left (the log's last line, "done …", is the end) and reports the ratio
estimate / actual.  The target is a ratio within [1/2, 2] on every line; a line whose estimate and actual are
both within :data:`SLACK_S` seconds of each other also passes (log times have a resolution of one second).

    python bench/eta.py                      # the embedded demo (``privtune tune`` with no arguments)
    python bench/eta.py --full               # also the full-size SST-2 run, as bench/sst2_full.py runs its
                                             # default cell at ε = 1 (about 35 min alone on 2 CPU cores)
    python bench/eta.py --quick              # only that run on 20,000 private phrases (its --quick)
    python bench/eta.py --log RUN_DIR/log.txt --name mine   # check an existing log, run nothing
    python bench/eta.py --name demo-bitfit --tune-args "--mode bitfit --epochs 1"   # the demo's data, other options

The SST-2 runs read the data where bench/sst2_full.py does (``$PRIVTUNE_SST2``, default ``../shared/data/sst2``
from the repository's parent).

Results: ``bench/results/eta/<name>.json`` (every checked line, the summary, the machine and its load) and a
table on stdout.  A measurement, not a test: the ratios depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "eta"
#: a line passes when the estimate is within this many seconds of the actual time left, whatever the ratio
SLACK_S = 5.0
_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)  (.*)$")
_RUN_LEFT = re.compile(r"\brun (\d+h\d\dm|\d+m\d\ds|\d+s) left")


def parse_duration(text: str) -> float:
    """Seconds of privtune's duration format: ``1h05m``, ``12m30s`` or ``45s``."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    if not m or not text:
        raise ValueError(f"not a duration: {text!r}")
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    return 3600.0 * h + 60.0 * mi + s


def check_log(text: str) -> dict:
    """Every whole-tune estimate in a log.txt against the time actually left (to the log's last line)."""
    stamped = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            stamped.append((dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"), m.group(2)))
    if not stamped:
        raise ValueError("no timestamped line in the log (a repeat-and-select run has none: nothing to check)")
    start, end = stamped[0][0], stamped[-1][0]
    rows = []
    for when, message in stamped:
        m = _RUN_LEFT.search(message)
        if not m:
            continue
        estimate = parse_duration(m.group(1))
        actual = (end - when).total_seconds()
        ratio = estimate / actual if actual > 0 else None
        ok = abs(estimate - actual) <= SLACK_S or (ratio is not None and 0.5 <= ratio <= 2.0)
        rows.append({"time": when.strftime("%H:%M:%S"), "line": message[:110], "estimate_s": estimate,
                     "actual_s": actual, "ratio": None if ratio is None else round(ratio, 3), "ok": ok})
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    return {"lines_checked": len(rows), "lines_within_target": sum(r["ok"] for r in rows),
            "worst_high_ratio": max(ratios, default=None), "worst_low_ratio": min(ratios, default=None),
            "run_seconds": (end - start).total_seconds(), "lines": rows}


def _machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    out = {"cpus": os.cpu_count(), "load_average_1_5_15": [round(x, 2) for x in load] if load else None,
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "python": platform.python_version(),
           "platform": platform.platform()}
    if load and os.cpu_count() and load[0] > os.cpu_count():
        out["note"] = (f"other processes shared the machine: 1-minute load average {load[0]:.1f} on "
                       f"{os.cpu_count()} CPU cores")
    return out


def run_demo(workdir: Path, tune_args: list[str] = ()) -> Path:
    """``privtune tune`` with no data (the embedded demo) and ``tune_args`` in ``workdir``: the path of its
    log.txt."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    code = f"import sys; from privtune.cli import main; sys.exit(main({['tune', *tune_args]!r}))"
    subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, check=True)
    (log,) = sorted(workdir.glob("runs/*/log.txt"))
    return log


def run_full(workdir: Path, subset: int | None = None) -> Path:
    """The full-size run: bench/sst2_full.py's default cell at ε = 1 (its split, its call), unseeded, in
    ``workdir`` (``subset``: on that many private phrases, as its ``--quick``): the path of its log.txt."""
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]  # this checkout's privtune, in this process
    import sst2_full
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))  # as bench/sst2_full.py
    split = sst2_full.make_split(2000, subset, sst2_full.RESULTS / ("full" if subset is None else "quick"))
    sst2_full._tune_cell(split, 1.0, None, workdir)
    return workdir / "run" / "log.txt"


def report(name: str, checked: dict, machine_before: dict, source: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    result = {"name": name, "source": source, "target": "estimate / actual time left within [1/2, 2] on every line "
              f"(or within {SLACK_S:g} s)", "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
              "machine": {"before": machine_before, "after": _machine()}, **checked}
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"\n{name}: {checked['lines_within_target']}/{checked['lines_checked']} lines within target; run "
          f"{checked['run_seconds']:.0f} s; worst ratios {checked['worst_low_ratio']} … {checked['worst_high_ratio']}")
    print(f"{'time':>8}  {'estimate':>9}  {'actual':>7}  {'ratio':>6}  ok  line")
    for r in checked["lines"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['time']:>8}  {r['estimate_s']:>8.0f}s  {r['actual_s']:>6.0f}s  {ratio:>6}  {'✓' if r['ok'] else '✗'}"
              f"   {r['line'][:70]}")
    print(f"→ {out.relative_to(ROOT)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="also the full-size SST-2 run (bench/sst2_full.py's default)")
    ap.add_argument("--quick", action="store_true", help="also bench/sst2_full.py's --quick run (ε = 1, 20,000 "
                    "private phrases: fine-tuning scale, BiTFiT and full pilots)")
    ap.add_argument("--log", type=Path, help="check this log.txt instead of running anything")
    ap.add_argument("--name", default=None, help="result name (default: demo / full-size / the log's folder)")
    ap.add_argument("--tune-args", default="", help="more `privtune tune` options for the demo, e.g. \"--mode bitfit\"")
    args = ap.parse_args(argv)
    if args.log is not None:
        report(args.name or args.log.parent.name, check_log(args.log.read_text(encoding="utf-8")), _machine(),
               str(args.log))
        return 0
    tune_args = shlex.split(args.tune_args)
    runs = [("demo", lambda d: run_demo(d, tune_args))] + ([("full-size", run_full)] if args.full else [])
    if args.quick:
        runs = [("quick", lambda d: run_full(d, 20_000))] + (runs if args.full or args.tune_args else [])
    for name, run in runs:
        machine = _machine()
        with tempfile.TemporaryDirectory(prefix=f"privtune-eta-{name}-") as tmp:
            t0 = time.time()
            log = run(Path(tmp))
            text = log.read_text(encoding="utf-8")
            print(f"{name}: ran in {time.time() - t0:.0f} s")
            report(args.name or name, check_log(text), machine,
                   f"privtune tune {' '.join(tune_args)} (the embedded demo)".replace("  ", " ") if name == "demo"
                   else "bench/sst2_full.py default cell, ε = 1, unseeded"
                   + (", 20,000 private phrases (its --quick)" if name == "quick" else ""))
            (RESULTS / f"{args.name or name}.log.txt").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
