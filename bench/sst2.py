"""Accuracy sanity check: DP-BiTFiT and DP full fine-tuning of all-MiniLM-L6-v2 on SST-2.

For each fine-tuning mode (BiTFiT: biases + mean-pooling head; full: every parameter) this trains

* a **non-private** reference (1 epoch, shuffled batches of 32, mean loss, no clipping or noise:
  NOT PRIVATE, the baseline of the ratios), and
* DP runs at ε ∈ {1, 8}, δ = 1e-5 (Poisson sampling, flat clipping C = 1, DP-Adam, σ calibrated
  with the PLD accountant for the run's q and T),

all in the same process, and reports GLUE dev accuracy (872 sentences) next to each other.

Fixed hyperparameters (not tuned on dev; chosen from published settings, among them Bu et al.'s DP-BiTFiT):

=============  =====================================================================================
DP-BiTFiT      expected batch B = 500 (q = B/N), 2 epochs (T = 16 at N = 4,000), Adam lr 1e-2, C = 1
DP full        same B and T, Adam lr 5e-4, C = 1
non-private    1 epoch, batch 32, Adam lr 2e-3 (BiTFiT) / 5e-5 (full)
=============  =====================================================================================

The training set is a **seeded random subsample** of the 67,349 SST-2 training phrases
(``--train-size``, default 4,000), because DP full fine-tuning of MiniLM runs at tens of
examples per second on 2 CPU cores; the table says how many were used.  The default run took
21 min on the project's 2-core machine.  Max length 64 tokens.

Usage::

    python bench/sst2.py              # full benchmark (21 min on 2 cores)
    python bench/sst2.py --quick      # smoke run: 400 examples, 4 steps, 128 dev sentences
    python bench/sst2.py --train-size 20000 --epsilons 1 8 --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import offline  # noqa: E402,F401  (sets the offline environment: bench/offline.py)

import torch  # noqa: E402
from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "sst2"

CONFIGS = {
    "bitfit": {"dp_lr": 1e-2, "nonprivate_lr": 2e-3, "label": "BiTFiT"},
    "full": {"dp_lr": 5e-4, "nonprivate_lr": 5e-5, "label": "full"},
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (minutes)")
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA, help="folder with train.tsv and dev.tsv")
    ap.add_argument("--train-size", type=int, default=4000, help="training subsample size N")
    ap.add_argument("--dev-size", type=int, default=None, help="random dev subsample (default: all 872)")
    ap.add_argument("--batch-size", type=int, default=500, help="expected DP batch size B")
    ap.add_argument("--epochs", type=float, default=2.0, help="DP epochs (T = ceil(epochs / q))")
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 8.0])
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--modes", nargs="+", default=["bitfit", "full"], choices=sorted(CONFIGS))
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the non-private references (then no ratios; for quick checks of one DP cell)")
    args = ap.parse_args(argv)
    if args.quick:
        args.train_size, args.dev_size, args.batch_size, args.epochs = 400, 128, 100, 1.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from privtune.accounting import calibrate_noise_multiplier, compute_epsilon
    from privtune.data import load_text_dataset
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier
    from privtune.training import evaluate, fit, fit_nonprivate

    train_all = load_text_dataset(args.data_dir / "train.tsv", labels=[0, 1])
    dev = load_text_dataset(args.data_dir / "dev.tsv", labels=[0, 1])
    g = torch.Generator().manual_seed(args.seed)
    train = train_all.subset(torch.randperm(len(train_all), generator=g)[: args.train_size].tolist())
    if args.dev_size and args.dev_size < len(dev):  # seeded random subset (the file is not shuffled)
        dev = dev.subset(sorted(torch.randperm(len(dev), generator=g)[: args.dev_size].tolist()))
    n = len(train)
    q = min(1.0, args.batch_size / n)
    steps = max(1, int(-(-args.epochs // q)))
    print(f"SST-2: training on a random subsample of {n} of {len(train_all)} phrases (seed {args.seed}); "
          f"dev {len(dev)} sentences; MiniLM-L6 mean pooling, max length {args.max_length}; "
          f"{args.threads} thread(s)", flush=True)
    print(f"DP runs: q = {q:.4g} (expected batch {q * n:.0f}), T = {steps} steps, C = 1, flat clipping, "
          f"Adam, δ = {args.delta:g}", flush=True)

    rows = []
    for mode in args.modes:
        cfg = CONFIGS[mode]
        base = None
        if not args.no_reference:
            model = load_classifier(max_length=args.max_length, seed=args.seed)
            apply_mode(model, mode)
            t0 = time.perf_counter()
            r = fit_nonprivate(model, train, epochs=1.0, batch_size=32, learning_rate=cfg["nonprivate_lr"],
                               seed=args.seed)
            acc = evaluate(model, dev)["accuracy"]
            base = acc
            rows.append({"mode": mode, "method": f"non-private {cfg['label']} (NOT PRIVATE)", "epsilon": None,
                         "accuracy": acc, "ratio": 1.0, "noise_multiplier": 0.0, "steps": r.steps,
                         "learning_rate": cfg["nonprivate_lr"], "seconds": time.perf_counter() - t0,
                         "examples_per_second": r.examples_per_second})
            _print_row(rows[-1])
        for eps in args.epsilons:
            sigma = calibrate_noise_multiplier(eps, args.delta, sample_rate=q, steps=steps)
            model = load_classifier(max_length=args.max_length, seed=args.seed)
            apply_mode(model, mode)
            t0 = time.perf_counter()
            r = fit(model, train, noise=NoiseSpec(noise_multiplier=sigma, sample_rate=q, steps=steps),
                    optimizer=OptimizerSpec(learning_rate=cfg["dp_lr"], name="adam"),
                    clipping=ClippingSpec(clip=1.0),
                    options=LoopOptions(seed=args.seed, max_physical_batch_size=32))
            eps_cert = compute_epsilon(r.events, args.delta)
            acc = evaluate(model, dev)["accuracy"]
            rows.append({"mode": mode, "method": f"DP-{cfg['label']}", "epsilon": eps_cert, "accuracy": acc,
                         "ratio": acc / base if base else None, "noise_multiplier": sigma, "steps": steps,
                         "learning_rate": cfg["dp_lr"], "seconds": time.perf_counter() - t0,
                         "examples_per_second": r.examples_per_second})
            _print_row(rows[-1])

    print()
    print(f"| method | ε (δ={args.delta:g}) | σ | T | lr | dev accuracy | ratio vs non-private | train ex/s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        eps = "∞ (not private)" if row["epsilon"] is None else f"{row['epsilon']:.3g}"
        print(f"| {row['method']} | {eps} | {row['noise_multiplier']:.3g} | {row['steps']} | "
              f"{row['learning_rate']:g} | {100 * row['accuracy']:.1f} % | "
              f"{'n/a' if row['ratio'] is None else format(row['ratio'], '.3f')} | "
              f"{row['examples_per_second']:.0f} |")
    print(f"\nTraining subsample: N = {n} of {len(train_all)} SST-2 training phrases (seed {args.seed}); "
          f"dev: {len(dev)} GLUE dev sentences. Ratio = DP dev accuracy / non-private dev accuracy of the same "
          "mode in this run. Non-private rows are NOT PRIVATE references.")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "train_size": n,
                                        "dev_size": len(dev), "sample_rate": q, "steps": steps, "rows": rows},
                                       indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def _print_row(row: dict) -> None:
    eps = "non-private" if row["epsilon"] is None else f"ε={row['epsilon']:.3g}"
    print(f"  {row['method']:<34} {eps:<12} dev acc {100 * row['accuracy']:.1f} %  "
          f"({row['seconds']:.0f} s, {row['examples_per_second']:.0f} ex/s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
