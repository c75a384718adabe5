"""Feature-caching rate of the last-layer mode (sentences/s) on SST-2 training phrases, per backbone.

Times :func:`privtune.finetune.cache_features` (a frozen backbone's pooled features of every phrase, no
gradients) on ``--n`` phrases drawn with a fixed seed from SST-2's train.tsv, and reports wall time, CPU time
(user + system of this process), the 1-minute load average before and after, the torch threads the batches ran
with and the projected time for ``--project`` phrases (60,957: the private phrases of bench/sst2_full.py's full split) at the
measured rate.  The load average matters: on a shared machine the wall time is the CPU time divided by the
cores this process actually got.

    python bench/feature_cache.py --model all-MiniLM-L6-v2 --n 2000
    python bench/feature_cache.py --model all-mpnet-base-v2 --n 2000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time
from pathlib import Path

import torch

SST2_TRAIN = Path(os.environ.get("SST2_DIR", "/work/shared/data/sst2")) / "train.tsv"


def _phrases(n: int, seed: int) -> list[str]:
    rows = SST2_TRAIN.read_text(encoding="utf-8").splitlines()[1:]
    texts = [r.split("\t", 1)[1] for r in rows if "\t" in r]
    return random.Random(seed).sample(texts, min(n, len(texts)))


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="all-MiniLM-L6-v2", help="backbone name or directory")
    ap.add_argument("--n", type=int, default=2000, help="phrases to embed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=None, help="cache_features' batch_size (default: its own)")
    ap.add_argument("--project", type=int, default=60957, help="phrases to project the time for")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    args = ap.parse_args(argv)

    from privtune.data import TextDataset
    from privtune.finetune import cache_features
    from privtune.models import load_classifier

    texts = _phrases(args.n, args.seed)
    data = TextDataset(texts=texts, labels=[0] * len(texts), num_labels=2)
    model = load_classifier(args.model)
    kw = {} if args.batch_size is None else {"batch_size": args.batch_size}
    load_before = os.getloadavg()[0]
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    threads_used: list[int] = []  # torch's intra-op threads while the batches run (cache_features may lower them)
    fs = cache_features(model, data, progress=lambda k: threads_used.append(torch.get_num_threads()), **kw)
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    out = {
        "model": args.model, "phrases": len(texts), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
        "sentences_per_s": round(len(texts) / wall, 1), "sentences_per_cpu_s": round(len(texts) / cpu, 1),
        "threads_used": sorted(set(threads_used)), "cores": len(os.sched_getaffinity(0)),
        "load_avg_1min_before": round(load_before, 2), "load_avg_1min_after": round(os.getloadavg()[0], 2),
        f"projected_wall_min_{args.project}": round(args.project / (len(texts) / wall) / 60, 1),
        f"projected_min_{args.project}_1_idle_core": round(args.project / (len(texts) / cpu) / 60, 1),
        # an optimistic bound: two threads scaling perfectly on two idle cores (not measured here)
        f"projected_min_{args.project}_2_idle_cores_perfect_scaling": round(args.project / (len(texts) / cpu) / 2 / 60, 1),
        "feature_checksum": float(fs.features.double().sum()),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
