"""Data-parallel DP training: examples per second of 1 vs 2 processes, measured in one run.

In ONE invocation, on the CPU with gloo, each process on one thread (OMP_NUM_THREADS=1):

(1) one process:  ``privtune.fit`` of DP-BiTFiT (σ = 1, C = 1, Adam, flat clipping) on the bundled
    all-MiniLM-L6-v2 (mean pooling, max_length 64) over an SST-2 training subset of ``--subset`` phrases,
    expected Poisson batch ``--batch-size``, ``--steps`` DP steps, physical micro-batch 32, seed 0;
(2) two processes: the same call in each process of a 2-process gloo group (``torch.multiprocessing.spawn``),
    so privtune trains data-parallel (engine/distributed.py): every rank draws the same global Poisson batch
    and trains on its half, the clipped sums are all-reduced, rank 0 adds the noise once.

Timing: the callback of ``fit`` receives each step's wall time and the size of the whole logical batch (the
size is NOT PRIVATE; this is a benchmark on public data).  The first step is a warm-up and is not counted.
Rank 0's step time includes waiting for rank 1 at the all-reduce, so it is the time of the whole step.
Also reported: examples per CPU second (``time.process_time`` of every process, summed); its 2/1 ratio
bounds the extra work of splitting (1.0: none) and is less sensitive to other jobs than wall time, though
contention for shared cores and caches still lowers it.
Both runs use the same seed, hence the same batches.  Setup (imports, loading, tokeniser) is not timed.

    OMP_NUM_THREADS=1 python bench/scaling.py                     # about 3 min on the shared 2-core machine
    OMP_NUM_THREADS=1 python bench/scaling.py --subset 512 --batch-size 64 --steps 6

Results: printed table with the 2/1 ratio, plus bench/results/scaling.json (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import offline  # noqa: E402,F401  (sets the offline environment: bench/offline.py)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from hpo import SST2, read_sst2_tsv  # noqa: E402  (bench/ is on sys.path: this script's folder)
from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec


def _subset(n: int, seed: int = 0):
    texts, labels = read_sst2_tsv(SST2 / "train.tsv")
    pick = random.Random(seed).sample(range(len(texts)), n)
    return [texts[i] for i in pick], [labels[i] for i in pick]


def _measure(rank: int, cfg: dict) -> dict:
    """Run DP-BiTFiT with privtune.fit in this process (data-parallel when a process group is set up)."""
    from privtune.data import TextDataset
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier
    from privtune.training import fit

    torch.set_num_threads(1)
    texts, labels = _subset(cfg["subset"])
    data = TextDataset(texts=texts, labels=labels, num_labels=2)
    clf = load_classifier(None, num_labels=2, max_length=64, seed=0)
    apply_mode(clf, "bitfit")
    steps: list = []
    cpu = [time.process_time()]

    def record(info) -> None:
        now = time.process_time()
        steps.append((info.seconds, info.batch_size, now - cpu[0]))
        cpu[0] = now

    fit(clf, data,
        noise=NoiseSpec(noise_multiplier=1.0, sample_rate=cfg["batch_size"] / cfg["subset"], steps=cfg["steps"] + 1),
        optimizer=OptimizerSpec(learning_rate=5e-3), clipping=ClippingSpec(clip=1.0),
        options=LoopOptions(seed=0, max_physical_batch_size=32), device="cpu", callback=record)
    timed = steps[1:]  # the first step is a warm-up
    seconds = sum(s for s, _, _ in timed)
    examples = sum(b for _, b, _ in timed)
    return {"rank": rank, "seconds": seconds, "examples": examples, "steps": len(timed),
            "examples_per_second": examples / seconds, "cpu_seconds": sum(c for _, _, c in timed)}


def _worker(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        Path(out).with_name(f"rank{rank}.json").write_text(json.dumps(_measure(rank, cfg)))
    finally:
        dist.destroy_process_group()


def _run(world: int, cfg: dict) -> dict:
    """``_measure`` in ``world`` fresh processes (spawned also for world = 1: the same start for both)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        if world == 1:
            mp.spawn(_single, args=(cfg, str(out)), nprocs=1, join=True)
        else:
            mp.spawn(_worker, args=(world, port, cfg, str(out)), nprocs=world, join=True)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    result = dict(ranks[0])  # rank 0's wall time is the whole step's; its batch size the global one
    result["cpu_seconds"] = sum(r["cpu_seconds"] for r in ranks)  # CPU time of all processes
    result["examples_per_cpu_second"] = result["examples"] / result["cpu_seconds"]
    return result


def _single(_rank: int, cfg: dict, out: str) -> None:
    Path(out).with_name("rank0.json").write_text(json.dumps(_measure(0, cfg)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--subset", type=int, default=1024, help="SST-2 training phrases (public benchmark data)")
    ap.add_argument("--batch-size", type=int, default=256, help="expected Poisson batch size (global)")
    ap.add_argument("--steps", type=int, default=3, help="timed DP steps (after one warm-up step)")
    args = ap.parse_args()
    cfg = {"subset": args.subset, "batch_size": args.batch_size, "steps": args.steps}
    t0 = time.time()
    one = _run(1, cfg)
    two = _run(2, cfg)
    ratio = two["examples_per_second"] / one["examples_per_second"]
    cpu_ratio = two["examples_per_cpu_second"] / one["examples_per_cpu_second"]
    print(f"DP-BiTFiT, MiniLM, SST-2 subset {args.subset}, expected batch {args.batch_size}, {args.steps} timed "
          "steps, CPU gloo, 1 thread per process")
    print(f"{'processes':>10} {'examples/s':>12} {'examples':>9} {'seconds':>8} {'CPU s (all)':>12} {'ex/CPU s':>9}")
    for world, r in ((1, one), (2, two)):
        print(f"{world:>10} {r['examples_per_second']:>12.1f} {r['examples']:>9} {r['seconds']:>8.2f} "
              f"{r['cpu_seconds']:>12.2f} {r['examples_per_cpu_second']:>9.1f}")
    print(f"ratio 2 processes / 1 process: {ratio:.2f}x examples/s (wall clock); "
          f"{cpu_ratio:.2f}x examples per CPU second")
    print(f"(os.cpu_count() = {os.cpu_count()}, 1-min load average at the end: {os.getloadavg()[0]:.1f}; "
          f"total {time.time() - t0:.0f} s)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scaling.json").write_text(json.dumps({
        "config": cfg, "device": "cpu", "backend": "gloo", "threads_per_process": 1,
        "one_process": one, "two_processes": two, "ratio": ratio, "cpu_ratio": cpu_ratio, "cpu_count": os.cpu_count(),
        "load_average_1min_at_end": os.getloadavg()[0], "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }, indent=2))


if __name__ == "__main__":
    main()
