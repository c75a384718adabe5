"""One-run privacy audits of DP-BiTFiT and DP last-layer training of all-MiniLM-L6-v2 on SST-2 (or of
EfficientNet-Lite0 on the image demo's Fashion-MNIST images, ``--task images``).

For each mode and claimed ε ∈ {1, 4, 8} (δ = 1e-5, Poisson sampling, flat clipping C = 1, DP-Adam) this
runs :func:`privtune.audit.audit` once:

* **white-box**: m Dirac gradient canaries through the real DP step at the configuration's (σ, q, T, C);
* **black-box**: m random letter-word canaries (random labels; on images: random-pixel images at the
  backbone's input size), each added to the training data with probability 1/2, one real ``train`` run,
  canaries scored by minus their loss;

and prints claimed ε, both lower bounds (95 % confidence, Steinke, Nasr & Jagielski 2023), m, the
guesses and the time.  A lower bound is evidence, not proof: it must stay below the claimed ε; a
gap between them says the audit is weak, not that the claim is loose.

SST-2 is a public benchmark, so the runs declare it public (``public_data=True``: nothing is charged
to a ledger).  The training set is a seeded random subsample (``--train-size``) because the black-box
BiTFiT runs train the MiniLM backbone on 2 CPU cores.  ``--task images`` audits the 3,000 training images
of privtune's embedded Fashion-MNIST demo (public as well) with the bundled EfficientNet-Lite0 at 64 px, the
head on every stage's features (the demo's choice), privtune's default learning rate of each mode, B = 256 and
3 epochs, at ε ∈ {1, 3, 8}.

Usage::

    python bench/audit.py --quick      # 1,000 phrases, 200 canaries, 1 epoch (minutes)
    python bench/audit.py              # 4,000 phrases, 1,000 canaries, 2 epochs
    python bench/audit.py --modes last-layer --epsilons 8 --canaries 500
    python bench/audit.py --task images  # 3,000 Fashion-MNIST images, 1,000 canaries (minutes)

Results: bench/results/audit[-images][-quick].json and .log (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import offline  # noqa: E402,F401  (sets the offline environment: bench/offline.py)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("PRIVTUNE_SST2", ROOT.parent / "shared" / "data" / "sst2"))
LEARNING_RATES = {"bitfit": 1e-2, "last-layer": 5e-2}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("sst2", "images"), default="sst2",
                    help="sst2 (MiniLM on SST-2 phrases) or images (EfficientNet-Lite0 on the image demo)")
    ap.add_argument("--quick", action="store_true", help="small run (minutes on 2 cores)")
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA, help="folder with train.tsv")
    ap.add_argument("--train-size", type=int, default=None,
                    help="training subsample size N (before canaries); default 4,000 phrases, or all 3,000 images")
    ap.add_argument("--canaries", type=int, default=1000, help="m canaries per audit")
    ap.add_argument("--batch-size", type=int, default=None, help="expected Poisson batch size B (default 500; 256 "
                    "on images)")
    ap.add_argument("--epochs", type=float, default=None, help="default 2; 3 on images")
    ap.add_argument("--epsilons", type=float, nargs="+", default=None, help="default 1 4 8; 1 3 8 on images")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--modes", nargs="+", default=["bitfit", "last-layer"], choices=sorted(LEARNING_RATES))
    ap.add_argument("--no-blackbox", action="store_true", help="white-box audits only (seconds)")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/audit[-quick].json)")
    args = ap.parse_args(argv)
    images = args.task == "images"
    defaults = dict(train_size=3000 if images else 4000, batch_size=256 if images else 500,
                    epochs=3.0 if images else 2.0, epsilons=[1.0, 3.0, 8.0] if images else [1.0, 4.0, 8.0])
    if args.quick:
        defaults.update(train_size=1000, batch_size=200, epochs=1.0)
        args.canaries = 200
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = (ROOT / "bench" / "results"
                    / f"audit{'-images' if images else ''}{'-quick' if args.quick else ''}.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from privtune.audit import AuditSpec, audit
    from privtune.data import load_text_dataset

    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = open(args.out.with_suffix(".log"), "w", encoding="utf-8")

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    images = args.task == "images"
    if images:
        from privtune.data import embedded_fashion_mnist

        train_all = embedded_fashion_mnist()[0]
        what = "the image demo's Fashion-MNIST training images: subsample of {} of {} images"
        # the demo's backbone and head features; privtune's default learning rate of each mode
        kwargs = dict(model="efficientnet-lite0", labels=list(range(10)), image_features="stages")
        learning_rates = dict.fromkeys(LEARNING_RATES)
    else:
        train_all = load_text_dataset(args.data_dir / "train.tsv")
        what = "SST-2: random subsample of {} of {} phrases"
        kwargs = dict(labels=[0, 1], max_length=args.max_length)
        learning_rates = LEARNING_RATES
    g = torch.Generator().manual_seed(args.seed)
    train = train_all.subset(torch.randperm(len(train_all), generator=g)[: args.train_size].tolist())
    say(f"{what.format(len(train), len(train_all))} (seed {args.seed}); m = {args.canaries} "
        f"canaries per audit; B = {args.batch_size}, {args.epochs:g} epochs, C = 1, Adam, δ = {args.delta:g}; "
        f"{args.threads} thread(s); command: python bench/audit.py {' '.join(sys.argv[1:])}")
    rows = []
    for mode in args.modes:
        for eps in args.epsilons:
            t0 = time.perf_counter()
            spec = AuditSpec.create(mode=mode, epsilon=eps, delta=args.delta, epochs=args.epochs,
                                    batch_size=args.batch_size, learning_rate=learning_rates[mode], clip=1.0,
                                    num_canaries=args.canaries, blackbox=not args.no_blackbox, public_data=True,
                                    seed=args.seed)
            rep = audit(train, spec, progress=False, **kwargs)
            wb, bb = rep.whitebox, rep.blackbox
            row = {"mode": mode, "claimed_epsilon": wb.claimed_epsilon, "delta": args.delta, "m": args.canaries,
                   "noise_multiplier": wb.config["noise_multiplier"], "sample_rate": wb.config["sample_rate"],
                   "steps": wb.config["steps"],
                   "whitebox": {k: getattr(wb, k) for k in ("epsilon_lower_bound", "num_guesses", "correct_guesses",
                                                            "seconds")},
                   "blackbox": None if bb is None else {
                       k: getattr(bb, k) for k in ("epsilon_lower_bound", "num_guesses", "correct_guesses", "seconds")},
                   "seconds": time.perf_counter() - t0}
            rows.append(row)
            bbs = "not run" if bb is None else (f"{bb.epsilon_lower_bound:.3g} ({bb.correct_guesses}/{bb.num_guesses}, "
                                                f"{bb.seconds:.0f} s)")
            say(f"  {mode:<10} claimed ε={wb.claimed_epsilon:.3g}  white-box lb {wb.epsilon_lower_bound:.3g} "
                f"({wb.correct_guesses}/{wb.num_guesses}, {wb.seconds:.1f} s)  black-box lb {bbs}")
    say("")
    say(f"| mode | claimed ε (δ={args.delta:g}) | σ | T | white-box lb (v/r) | black-box lb (v/r) | m | time |")
    say("|---|---|---|---|---|---|---|---|")
    for r in rows:
        wb, bb = r["whitebox"], r["blackbox"]
        bbs = ("not run" if bb is None
               else f"{bb['epsilon_lower_bound']:.2f} ({bb['correct_guesses']}/{bb['num_guesses']})")
        say(f"| {r['mode']} | {r['claimed_epsilon']:.3g} | {r['noise_multiplier']:.3g} | {r['steps']} | "
            f"{wb['epsilon_lower_bound']:.2f} ({wb['correct_guesses']}/{wb['num_guesses']}) | {bbs} | {r['m']} | "
            f"{r['seconds']:.0f} s |")
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2) + "\n")
    say(f"wrote {args.out}")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
