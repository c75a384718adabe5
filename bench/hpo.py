"""Benchmark of private hyperparameter tuning on SST-2.

Part A (MiniLM features, last layer): for every total ε and seed, each strategy is run with its
whole tuning cost charged (linear-scaling, single-step, hyperfree, honestly charged random search)
next to the NOT PRIVATE grid oracle (every grid run at the full ε, selection uncharged).  Trials are
scored on a split of the SST-2 *training* set that the benchmark declares public (disjoint from
the private training part); accuracy is reported on the GLUE dev set, which no selector sees.

Output: dev accuracy mean ± std per strategy, RERR = (strategy − random)/(oracle − random), and
tuning compute relative to one final run (counted in full-batch gradient evaluations, i.e. steps ×
examples).  Features are cached once under bench/results/ (gitignored).

    python bench/hpo.py --quick            # 6k-example subset, ε ∈ {0.5, 1, 8}, 2 seeds (minutes)
    python bench/hpo.py                    # full SST-2 train, ε ∈ {0.25, 0.5, 1, 2, 8}, 3 seeds

Part B, ``--bitfit`` (DP-BiTFiT of MiniLM, end to end through the public API): on a subset of N
private SST-2 training phrases (``--bitfit-subset``, default 2000; 500 other training phrases declared
public), at each ``--bitfit-epsilons`` total, ``privtune.tune(mode="bitfit", strategy="hyperfree")``
against ``privtune.train(mode="bitfit")`` with one fixed, untuned setting (2 epochs, expected batch
256, DP-Adam lr 1e-2, C = 1: bench/sst2.py's fixed setting scaled to the subset) and the NOT PRIVATE
non-private BiTFiT on the same subset.  Dev accuracy, mean ± std over ``--bitfit-seeds`` (3) run
seeds on one fixed split (about 20 min on 2 cores).

    python bench/hpo.py --bitfit          # Part B only
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import offline  # noqa: E402,F401  (sets the offline environment: bench/offline.py)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
SST2 = Path(os.environ.get("PRIVTUNE_SST2", ROOT.parent.parent / "shared" / "data" / "sst2"))


def read_sst2_tsv(path: Path):
    """(texts, integer labels) of a GLUE SST-2 TSV (``label<TAB>sentence`` after a header line)."""
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(rows)
        for r in rows:
            labels.append(int(r[0]))
            texts.append(r[1])
    return texts, labels


def load_features(public_size: int, subset: int | None, seed: int = 0, progress: bool = True):
    """MiniLM features of SST-2 train (split into private train / declared-public validation) and dev."""
    from privtune.data import TextDataset
    from privtune.finetune import cache_features
    from privtune.models import load_classifier

    if not SST2.is_dir():
        sys.exit(f"SST-2 not found at {SST2}; set PRIVTUNE_SST2 to the folder with train.tsv and dev.tsv")
    tt, tl = read_sst2_tsv(SST2 / "train.tsv")
    dt, dl = read_sst2_tsv(SST2 / "dev.tsv")
    model = load_classifier(None, num_labels=2)
    cache = RESULTS / "features"
    out = {}
    for name, (texts, labels) in {"train": (tt, tl), "dev": (dt, dl)}.items():
        t0 = time.time()
        done = [0]

        def prog(k):
            done[0] += k
            if progress and done[0] % 5120 < k:
                print(f"  features {name}: {done[0]}/{len(texts)} ({time.time() - t0:.0f} s)", flush=True)

        fs = cache_features(model, TextDataset(texts=texts, labels=labels, num_labels=2), batch_size=128,
                            cache_dir=cache, progress=prog)
        out[name] = (fs.features.float(), fs.labels.long())
    X, y = out["train"]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(X.shape[0], generator=g)
    pub, priv = perm[:public_size], perm[public_size:]
    if subset is not None:
        priv = priv[:subset]
    return (X[priv], y[priv]), (X[pub], y[pub]), out["dev"]


def run_features(eps_list, seeds, strategies, train, public, dev, *, rs_trials=10, grid_points=7):
    from privtune.hpo import grid_oracle as go
    from privtune.hpo import hyperfree as hf
    from privtune.hpo import linear_scaling as ls
    from privtune.hpo import random_search as rs
    from privtune.hpo import single_step as ss
    from privtune.hpo.backends import FeatureBackend
    from privtune.hpo.common import Selector
    from privtune.hpo.recommend import recommend

    (X, y), (Xp, yp), (Xd, yd) = train, public, dev
    center = Xp.mean(0)  # mean of the declared-public split: free
    n = X.shape[0]
    rows = []
    for eps in eps_list:
        for seed in seeds:
            be = FeatureBackend(X, y, 2, center=center)
            sel = Selector("public_validation", Xp, yp, name="public")

            def dev_acc(state):
                return float((be.predict(state, Xd) == yd).float().mean())

            res = {}
            for name in strategies:
                t0 = time.time()
                be.runs = 0
                steps0 = _steps_counter(be)
                if name == "linear-scaling":
                    cfg = ls.LinearScalingConfig()
                    out = ls.run(be, sel, cfg, ls.plan(cfg, eps, 1e-5), seed=seed)
                    final_steps = out.final_hyperparameters["steps"]
                elif name == "random-search":
                    cfg = rs.RandomSearchConfig(trials=rs_trials)
                    out = rs.run(be, sel, cfg, rs.plan(cfg, eps, 1e-5), seed=seed)
                    final_steps = out.final_hyperparameters["steps"]
                elif name == "single-step":
                    cfg = ss.SingleStepConfig()
                    out = ss.run(be, cfg, ss.plan(cfg, eps, 1e-5), seed=seed)
                    final_steps = 1
                elif name == "hyperfree":
                    cfg = hf.HyperfreeConfig()
                    cands = [b for b in (256, 512, 1024, 2048, 4096) if b < n]
                    r = recommend(eps, 1e-5, n, 3, candidates=cands)
                    out = hf.run(be, cfg, hf.plan(cfg, eps, 1e-5, sample_rate=r.sample_rate, steps=r.steps),
                                 seed=seed)
                    final_steps = r.steps * r.sample_rate  # in full-batch equivalents
                elif name == "grid-oracle (NOT PRIVATE)":
                    o = go.run(be, sel, go.GridOracleConfig(lr_points=grid_points), eps, 1e-5, seed=seed)
                    out = None
                    acc = dev_acc(o.state)
                    final_steps = o.hyperparameters["steps"]
                else:
                    raise SystemExit(f"unknown strategy {name}")
                if out is not None:
                    acc = dev_acc(out.state)
                work = _steps_counter(be) - steps0
                res[name] = acc
                rows.append({"epsilon": eps, "seed": seed, "strategy": name, "dev_accuracy": acc,
                             "compute_rel_final": work / max(final_steps, 1e-9), "seconds": time.time() - t0})
                print(f"eps={eps:<5} seed={seed} {name:<26} dev={acc:.4f}  "
                      f"compute/final={rows[-1]['compute_rel_final']:.1f}  ({time.time() - t0:.0f} s)", flush=True)
    return rows


def _steps_counter(be):
    """Full-batch-equivalent gradient evaluations so far (monkey-patched counter on the backend)."""
    return getattr(be, "_work", 0.0)


def _install_counter():
    from privtune.hpo import _heads
    from privtune.hpo.backends import FeatureBackend

    orig_run = FeatureBackend.run

    def run(self, hp, **kw):
        work = kw["steps"] * kw.get("sample_rate", 1.0)
        if kw.get("hooks") is not None:  # hyperfree's probe: two extra forward passes (≈ 1/3 gradient) per update
            updates = kw["hooks"].events_at(kw["steps"])[-1]
            work += 2 / 3 * getattr(updates, "steps", getattr(updates, "count", 0)) * kw["sample_rate"]
        self._work = getattr(self, "_work", 0.0) + work
        return orig_run(self, hp, **kw)

    FeatureBackend.run = run
    del _heads


RERR_MIN_GAP = 0.005  # half a point of accuracy


def summarise(rows, strategies):
    eps_list = sorted({r["epsilon"] for r in rows})
    table = []
    for eps in eps_list:
        by = {s: [r["dev_accuracy"] for r in rows if r["epsilon"] == eps and r["strategy"] == s] for s in strategies}
        comp = {s: [r["compute_rel_final"] for r in rows if r["epsilon"] == eps and r["strategy"] == s]
                for s in strategies}
        mean = {s: statistics.mean(v) if v else math.nan for s, v in by.items()}
        sd = {s: statistics.stdev(v) if len(v) > 1 else 0.0 for s, v in by.items()}
        orc, rnd = mean.get("grid-oracle (NOT PRIVATE)", math.nan), mean.get("random-search", math.nan)
        # RERR is only meaningful when the oracle clearly beats random search: with a gap under
        # RERR_MIN_GAP (or negative) the ratio is noise over noise, so it is reported as n/a
        gap_ok = (orc - rnd) >= RERR_MIN_GAP
        for s in strategies:
            rerr = (mean[s] - rnd) / (orc - rnd) if s not in ("random-search", "grid-oracle (NOT PRIVATE)") and \
                gap_ok else math.nan
            table.append({"epsilon": eps, "strategy": s, "mean": mean[s], "std": sd[s], "n": len(by[s]),
                          "rerr": rerr, "compute_rel_final": statistics.mean(comp[s]) if comp[s] else math.nan})
    return table


def print_table(table):
    print()
    print(f"{'ε':>6}  {'strategy':<26} {'dev acc % (mean ± std)':>24} {'RERR':>7} {'tuning compute / final':>24}")
    for r in table:
        if r["strategy"] in ("random-search", "grid-oracle (NOT PRIVATE)"):
            rerr = ""
        else:
            rerr = "n/a" if math.isnan(r["rerr"]) else f"{100 * r['rerr']:.0f}%"
        print(f"{r['epsilon']:>6g}  {r['strategy']:<26} {100 * r['mean']:>14.2f} ± {100 * r['std']:.2f} (n={r['n']})"
              f" {rerr:>7} {r['compute_rel_final']:>24.1f}")
    print(f"RERR is n/a where the oracle beats random search by less than {100 * RERR_MIN_GAP:g} points (or not at "
          "all): the ratio would be noise over noise.")
    print("RERR = (strategy − random search)/(grid oracle − random search), all on dev accuracy; the oracle is "
          "NOT PRIVATE (tuning uncharged). Compute counts full-batch-equivalent gradient passes of all runs, "
          "divided by those of the final run.")


def run_bitfit(eps_list, subset: int, public_size: int = 500, seeds=(0,)):
    """Part B: DP-BiTFiT through privtune.tune / privtune.train on an SST-2 subset (see the module docstring)."""
    import random
    import tempfile

    import privtune
    from privtune.data import load_text_dataset
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier
    from privtune.training import evaluate, fit_nonprivate

    if not SST2.is_dir():
        sys.exit(f"SST-2 not found at {SST2}; set PRIVTUNE_SST2 to the folder with train.tsv and dev.tsv")
    texts, labels = read_sst2_tsv(SST2 / "train.tsv")
    idx = list(range(len(texts)))
    random.Random(0).shuffle(idx)  # one fixed split; the seeds below vary the runs (noise, sampling, search)
    seed = seeds[0]
    folder = RESULTS / "bitfit"
    folder.mkdir(parents=True, exist_ok=True)

    def write(name, rows):
        path = folder / name
        with open(path, "w", encoding="utf-8") as f:
            f.write("label\tsentence\n" + "".join(f"{labels[i]}\t{texts[i]}\n" for i in rows))
        return path

    pub = write("public.tsv", idx[:public_size])
    tr = write("train.tsv", idx[public_size:public_size + subset])
    dev = SST2 / "dev.tsv"
    rows = []
    t0 = time.time()
    model = load_classifier(None, num_labels=2, seed=seed)
    apply_mode(model, "bitfit")
    fit_nonprivate(model, load_text_dataset(tr, num_labels=2), epochs=1.0, batch_size=32, learning_rate=2e-3,
                   seed=seed)
    ref_acc = evaluate(model, load_text_dataset(dev, num_labels=2))["accuracy"]
    rows.append({"epsilon": "∞", "method": "non-private BiTFiT, 1 epoch (NOT PRIVATE)", "dev_accuracy": ref_acc,
                 "seconds": time.time() - t0})
    print(f"bitfit N={subset} non-private (NOT PRIVATE) dev={ref_acc:.4f} ({time.time() - t0:.0f} s)", flush=True)
    for eps in eps_list:
        for seed in seeds:
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.time()
                r = privtune.tune(tr, eval_data=dev, public_eval_data=pub, mode="bitfit", strategy="hyperfree",
                                  epsilon=eps, delta=1e-5, ledger=f"sqlite:///{tmp}/l.db",
                                  output_dir=Path(tmp) / "tune", seed=seed, quiet=True)
                rows.append({"epsilon": eps, "seed": seed, "method": "tune: hyperfree (bitfit)",
                             "dev_accuracy": r.metrics["accuracy"], "certificate_epsilon": r.certificate.epsilon,
                             "seconds": time.time() - t0})
                print(f"bitfit N={subset} eps={eps} seed={seed} hyperfree dev={r.metrics['accuracy']:.4f} "
                      f"(certificate ε={r.certificate.epsilon:.4f}, {time.time() - t0:.0f} s)", flush=True)
                t0 = time.time()
                f = privtune.train(tr, labels=[0, 1], eval_data=dev, mode="bitfit", epsilon=eps, delta=1e-5, epochs=2,
                                   batch_size=min(256, subset // 4), learning_rate=1e-2, optimizer="adam", clip=1.0,
                                   ledger=f"sqlite:///{tmp}/l2.db", output_dir=Path(tmp) / "train", seed=seed,
                                   progress=False)
                rows.append({"epsilon": eps, "seed": seed, "method": "train: fixed untuned setting",
                             "dev_accuracy": f.metrics["accuracy"], "certificate_epsilon": f.certificate.epsilon,
                             "seconds": time.time() - t0})
                print(f"bitfit N={subset} eps={eps} seed={seed} fixed dev={f.metrics['accuracy']:.4f} "
                      f"({time.time() - t0:.0f} s)", flush=True)
    print(f"\nDP-BiTFiT, MiniLM, N = {subset} SST-2 training phrases, dev accuracy (872 sentences), "
          f"seeds {list(seeds)} (mean ± std)")
    groups = {}
    for r in rows:
        groups.setdefault((str(r["epsilon"]), r["method"]), []).append(r)
    for (eps, method), rs in groups.items():
        acc = [100 * r["dev_accuracy"] for r in rs]
        secs = statistics.mean(r["seconds"] for r in rs)
        spread = f" ± {statistics.stdev(acc):.2f}" if len(acc) > 1 else ""
        print(f"  ε={eps:<5} {method:<42} {statistics.mean(acc):.2f}{spread} %  ({secs:.0f} s per run)")
    (RESULTS / f"hpo_bitfit_N{subset}.json").write_text(json.dumps(rows, indent=2))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small subset, fewer ε and seeds")
    ap.add_argument("--epsilons", type=str, default=None)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--subset", type=int, default=None, help="private training examples (default: all)")
    ap.add_argument("--public-size", type=int, default=2000)
    ap.add_argument("--strategies", type=str, default="linear-scaling,single-step,hyperfree,random-search,"
                    "grid-oracle (NOT PRIVATE)")
    ap.add_argument("--features-only", action="store_true", help="only compute and cache the features")
    ap.add_argument("--grid-points", type=int, default=7, help="learning rates in the oracle grid (× 6 step counts)")
    ap.add_argument("--rs-trials", type=int, default=10, help="random-search trials k")
    ap.add_argument("--summarise", type=Path, default=None, metavar="JSON",
                    help="reprint the table of an earlier run from its results JSON (no training)")
    ap.add_argument("--bitfit", action="store_true", help="run Part B (DP-BiTFiT through privtune.tune) only")
    ap.add_argument("--bitfit-subset", type=int, default=2000, help="Part B: private training examples")
    ap.add_argument("--bitfit-epsilons", type=str, default="1,8", help="Part B: total ε values")
    ap.add_argument("--bitfit-seeds", type=int, default=3, help="Part B: seeds per ε (runs vary, the split does not)")
    args = ap.parse_args(argv)
    if args.summarise:
        rows = json.loads(args.summarise.read_text())["rows"]
        names = list(dict.fromkeys(r["strategy"] for r in rows))
        print_table(summarise(rows, names))
        return 0
    if args.bitfit:
        torch.set_num_threads(max(1, min(2, len(os.sched_getaffinity(0)))))
        RESULTS.mkdir(parents=True, exist_ok=True)
        run_bitfit([float(e) for e in args.bitfit_epsilons.split(",")], args.bitfit_subset,
                   seeds=tuple(range(args.bitfit_seeds)))
        return 0
    torch.set_num_threads(max(1, min(2, len(os.sched_getaffinity(0)))))
    eps_list = [float(e) for e in (args.epsilons or ("0.5,1,8" if args.quick else "0.25,0.5,1,2,8")).split(",")]
    seeds = list(range(args.seeds or (2 if args.quick else 3)))
    subset = args.subset if args.subset is not None else (6000 if args.quick else None)
    RESULTS.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train, public, dev = load_features(args.public_size, subset)
    print(f"features: private train {train[0].shape[0]}, declared-public validation {public[0].shape[0]}, "
          f"dev {dev[0].shape[0]} ({time.time() - t0:.0f} s)", flush=True)
    if args.features_only:
        return 0
    _install_counter()
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    rows = run_features(eps_list, seeds, strategies, train, public, dev, rs_trials=args.rs_trials,
                        grid_points=args.grid_points)
    table = summarise(rows, strategies)
    print_table(table)
    tag = ("quick" if args.quick else "full") + ("_eps" + "_".join(f"{e:g}" for e in eps_list))
    (RESULTS / f"hpo_{tag}.json").write_text(json.dumps({"rows": rows, "table": table}, indent=2))
    print(f"\nwritten {RESULTS / f'hpo_{tag}.json'} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
