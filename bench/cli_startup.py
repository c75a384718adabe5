"""Start-up time of the command line: the median wall time of ``privtune tune --help`` (and of a few other
commands that should not import torch), each a fresh process, as a user runs them.

The target is under one second for ``privtune tune --help``; the help reads its choices and defaults from
``privtune.choices`` and imports torch only when a run starts.  Timings are wall-clock on a possibly shared
machine: quote the median, and the min-max spread says how noisy it was.

Usage: ``python bench/cli_startup.py [--runs N]`` (from the repository root; it runs ``src/`` first on the path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = (["tune", "--help"], ["recommend", "--help"], ["train", "--help"], ["audit", "--help"],
            ["account", "--help"], ["budget", "--help"], ["config", "init", "--command", "tune", "-"], ["--help"])


def wall_seconds(args: list[str], runs: int) -> list[float]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "privtune", *args]
    subprocess.run(cmd, env=env, capture_output=True, check=True)  # warm-up: file cache, .pyc
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, env=env, capture_output=True, check=True)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per command (after one warm-up)")
    args = parser.parse_args()
    print(f"{'command':45s} {'median s':>9s} {'min s':>7s} {'max s':>7s}  ({args.runs} runs each, wall)")
    for command in COMMANDS:
        times = wall_seconds(command, args.runs)
        print(f"{'privtune ' + ' '.join(command):45s} {statistics.median(times):9.3f} {min(times):7.3f} "
              f"{max(times):7.3f}")


if __name__ == "__main__":
    main()
