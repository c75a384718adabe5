"""Fashion-MNIST bench: private tuning and fine-tuning of an ImageNet-pretrained EfficientNet-Lite0 on real images.

Split (seed 0): private = 58,000 Fashion-MNIST training images, public = the other 2,000 (declared public for
selection), reported = the 10,000 test images (scored once per cell, after its model is fixed; never selected
on).  Rows ε ∈ {1, 3, 8}, δ = 1e-5.  Cells (``--cells``):

* ``default``: ``privtune tune`` as a user runs it (hyperfree, every event charged) with ``--mode last-layer``,
  Mehta et al.'s zero-initialised head on cached features;
* ``auto``: ``privtune tune --mode auto`` (at n·ε ≥ 20,000 on images it pilots the last layer, bitfit and full);
* ``full``: ``privtune tune --mode full``, DP fine-tuning of every weight of the backbone;
* ``random``: charged random search over the same space (``--strategy random-search``);
* ``oracle``: the grid oracle, **NOT PRIVATE** (tuning not charged; a reference, never released);
* ``nonpriv-last-layer``: non-private multinomial logistic regression on the same cached features (the ceiling
  of the last-layer mode; its regularisation chosen on the public split);
* ``opacus-last-layer``: Opacus (DP-SGD, RDP accountant) training the same head on the same features with one
  fixed setting (the typical untuned user), for a comparison with a well-kept library;
* ``nonpriv-full``: non-private full fine-tuning of the same network (pretrained BatchNorm statistics, as privtune
  trains it), **NOT PRIVATE**: Adam, 2 epochs, batch 256, learning rate 1e-4 or 5e-4 chosen on the public split
  (the ceiling of the modes that train the backbone; needs a GPU to be quick);
* ``fixed``: ``privtune train`` with one fixed setting per ``--fixed MODE:η:α:EPOCHS[:CLIPPING[:OPTIMIZER]]``
  (comma-separated for several; expected batch 4,096, C = 1, by default flat clipping and Adam, everything
  charged): what a mode reaches with a setting chosen in advance, no tuning.  Comparing several settings on the test split and keeping the best is **NOT PRIVATE**;
  each file (``fixed-<mode>-lr<η>-a<α>-e<epochs>_eps<ε>.json``) records the public split's accuracy too, the one
  a selection may read.

``--device`` (cpu, cuda) is where every cell trains; ``--max-physical-batch-size`` the micro-batch of the modes that
train the backbone (memory only, never the privacy or the result); ``--time-budget`` (minutes) is passed to
``privtune tune``; ``--results`` writes the cells' files to another folder (a GPU run beside the CPU one).

Features are computed once per split and backbone (privtune's feature cache, ``features/``) and reused by every
cell.  Each cell writes ``bench/results/fashion_mnist/<cell>_eps<ε>.json`` (test accuracy, certificate ε, wall
time in seconds).  Usage::

    OMP_NUM_THREADS=2 python bench/fashion_mnist.py --cells default,nonpriv-last-layer --epsilons 1,3,8
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "fashion_mnist"
SOURCE = Path("/usr/share/datasets/fashion-mnist")
MODEL = "efficientnet-lite0"
#: input resolution in pixels (a public choice; ``--image-size``): at 128 the last layer's non-private ceiling is
#: about 2 points above 64's, for 4-5x the backbone cost of the one feature pass
IMAGE_SIZE = 128
#: what the head reads (``--image-features``): the network's final pooled features, or those with each stage's
#: pooled output ("stages")
IMAGE_FEATURES = "final"
DELTA = 1e-5
LABELS = list(range(10))
CELLS = ("default", "auto", "full", "random", "oracle", "nonpriv-last-layer", "opacus-last-layer", "nonpriv-full",
         "fixed")
#: expected (Poisson) batch of the ``fixed`` cells: hyperfree's choice for this data set
FIXED_BATCH = 4096
#: cells measured once, not per ε
EPSILON_FREE = ("nonpriv-last-layer", "nonpriv-full")


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def make_split(public_size: int = 2000, seed: int = 0) -> dict:
    """Private/public IDX files (uncompressed, standard naming) under RESULTS/split/, rebuilt when absent."""
    folder = RESULTS / "split"
    paths = {"train": folder / "private-images-idx3-ubyte", "public": folder / "public-images-idx3-ubyte",
             "test": SOURCE / "t10k-images-idx3-ubyte.gz"}
    if not paths["public"].with_name("public-labels-idx1-ubyte").exists():
        if not (SOURCE / "train-images-idx3-ubyte.gz").exists():
            raise SystemExit(f"Fashion-MNIST is not installed: {SOURCE} has no train-images-idx3-ubyte.gz. Install "
                             "the Debian package (apt-get install dataset-fashion-mnist), then run the bench again.")
        folder.mkdir(parents=True, exist_ok=True)
        from privtune.data.idx import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx

        x = read_idx(SOURCE / "train-images-idx3-ubyte.gz", IDX_IMAGES_MAGIC)
        y = read_idx(SOURCE / "train-labels-idx1-ubyte.gz", IDX_LABELS_MAGIC, "labels")
        public = np.zeros(len(x), dtype=bool)
        public[np.random.default_rng(seed).choice(len(x), public_size, replace=False)] = True
        for name, rows in (("private", ~public), ("public", public)):
            _write_idx(folder / f"{name}-images-idx3-ubyte", x[rows])
            _write_idx(folder / f"{name}-labels-idx1-ubyte", y[rows])
    return {k: str(v) for k, v in paths.items()}


#: where and how the cells train (``--device``, ``--max-physical-batch-size``, ``--time-budget``)
RUN_OPTIONS: dict = {}
#: show privtune's progress and log lines (``--verbose``)
VERBOSE = False


def _fresh_ledger(folder: Path) -> str:
    """The SQLite ledger URL of a cell's run (``<folder>.db``), its file and key removed first: a rerun of the cell
    starts a fresh ledger, not the spent one."""
    for scratch in (folder.with_name(folder.name + ".db"), folder.with_name(folder.name + ".db.key")):
        scratch.unlink(missing_ok=True)
    return f"sqlite:///{folder}.db"


def _tune_cell(split, eps, seed, **kw) -> dict:
    import privtune

    folder = RESULTS / "runs" / f"{kw.get('strategy', 'default')}_{kw.get('mode', 'auto')}_eps{eps:g}"
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    # last-layer: the test split is scored by the bench on the shared cached features (_test_accuracy), after the
    # run, exactly as privtune would score it; a mode that trains the backbone is scored by privtune itself
    # (the grid oracle releases no model: privtune scores its selected point on the test split itself)
    frozen = kw.get("mode") == "last-layer" and kw.get("strategy") != "grid-oracle"
    r = privtune.tune(split["train"], eval_data=None if frozen else split["test"], public_eval_data=split["public"],
                      labels=LABELS, model=MODEL, image_size=IMAGE_SIZE, image_features=IMAGE_FEATURES,
                      epsilon=eps, delta=DELTA,
                      ledger=_fresh_ledger(folder),
                      output_dir=folder, seed=seed, quiet=not VERBOSE, feature_cache_dir=str(RESULTS / "features"),
                      **RUN_OPTIONS, **kw)
    if frozen and r.metrics["mode"] != "last-layer":
        raise RuntimeError(f"mode last-layer ran {r.metrics['mode']}")
    if r.metrics.get("accuracy") is None and not frozen:  # the grid oracle: no model, so no test accuracy
        raise RuntimeError(f"{r.metrics['strategy']} reported no test accuracy (it releases no model); the bench "
                           "cannot score this cell")
    return {"test_accuracy": _test_accuracy(r.model, split) if frozen else float(r.metrics["accuracy"]),
            "certificate_epsilon": None if r.certificate is None else float(r.certificate.epsilon),
            "not_private": bool(r.metrics.get("not_private")), "mode": r.metrics["mode"],
            "strategy": r.metrics["strategy"], "hyperparameters": r.metrics.get("hyperparameters"),
            "trials": len(r.trials or []), "features_l2_normalised": _normalised(r.model)}


def _normalised(model) -> bool:
    """Whether the head read L2-normalised features: the released model's flag, or (the grid oracle releases no
    model) what privtune does for this backbone's last layer."""
    if model is not None:
        return bool(getattr(model, "normalize", False))
    from privtune.finetune.modes import head_input_normalization
    from privtune.models import load_classifier

    clf = load_classifier(MODEL, num_labels=10, seed=0, image_size=IMAGE_SIZE, image_features=IMAGE_FEATURES)
    return head_input_normalization(clf, "last-layer")


def _features(split, names=("train", "public", "test")) -> dict:
    """The cached features of the three splits (computed by the first cell, loaded by the others)."""
    from privtune.data import load_dataset
    from privtune.finetune.last_layer import cache_features
    from privtune.finetune.modes import head_input_normalization
    from privtune.models import load_classifier

    clf = load_classifier(MODEL, num_labels=10, seed=0, image_size=IMAGE_SIZE, image_features=IMAGE_FEATURES)
    clf.normalize = head_input_normalization(clf, "last-layer")  # as privtune tune does: the same cache key
    out = {"_normalised": bool(clf.normalize)}
    for name in names:
        fs = cache_features(clf, load_dataset(split[name], num_labels=10), cache_dir=RESULTS / "features")
        out[name] = (fs.features.numpy(), fs.labels.numpy())
    return out


def _test_accuracy(model, split) -> float:
    """Accuracy of a released last-layer model on the test images through the shared feature cache: the head on
    the cached features is what ``model.predict_logits`` computes (the backbone is the frozen pretrained one), so
    the 10,000 test images go through the backbone once for every cell, not once per cell."""
    import torch

    from privtune.data import load_dataset
    from privtune.finetune.last_layer import cache_features

    fs = cache_features(model, load_dataset(split["test"], num_labels=10), cache_dir=RESULTS / "features")
    with torch.no_grad():
        pred = model.head(fs.features.float()).argmax(1)
    return float((pred == fs.labels).float().mean())


def _nonprivate_cell(split) -> dict:
    """NOT PRIVATE: logistic regression on the cached features; C chosen on the public split."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    f = _features(split)
    scaler = StandardScaler().fit(f["train"][0])
    best = None
    for c in (0.01, 0.1, 1.0):
        m = LogisticRegression(C=c, max_iter=300).fit(scaler.transform(f["train"][0]), f["train"][1])
        score = m.score(scaler.transform(f["public"][0]), f["public"][1])
        if best is None or score > best[0]:
            best = (score, c, m)
    acc = best[2].score(scaler.transform(f["test"][0]), f["test"][1])
    return {"test_accuracy": float(acc), "certificate_epsilon": None, "not_private": True,
            "mode": "last-layer", "strategy": "non-private logistic regression",
            "hyperparameters": {"C": best[1], "public_accuracy": float(best[0])},
            "features_l2_normalised": f["_normalised"]}


def _opacus_cell(split, eps, seed) -> dict:
    """Opacus DP-SGD on the cached features, one fixed setting (batch 1,024, 10 epochs, lr 0.1, clip 1)."""
    import torch
    from opacus import PrivacyEngine

    f = _features(split)
    x, y = torch.tensor(f["train"][0]), torch.tensor(f["train"][1])
    torch.manual_seed(seed)
    head = torch.nn.Linear(x.shape[1], 10)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=1024, shuffle=True)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    engine = PrivacyEngine(accountant="rdp")
    head, opt, loader = engine.make_private_with_epsilon(module=head, optimizer=opt, data_loader=loader,
                                                          target_epsilon=eps, target_delta=DELTA, epochs=10,
                                                          max_grad_norm=1.0)
    for _ in range(10):
        for xb, yb in loader:
            if len(yb) == 0:
                continue
            opt.zero_grad()
            torch.nn.functional.cross_entropy(head(xb), yb).backward()
            opt.step()
    with torch.no_grad():
        acc = (head(torch.tensor(f["test"][0])).argmax(1).numpy() == f["test"][1]).mean()
    return {"test_accuracy": float(acc), "certificate_epsilon": float(engine.get_epsilon(DELTA)),
            "not_private": False, "mode": "last-layer", "strategy": "Opacus DP-SGD, fixed setting",
            "hyperparameters": {"batch_size": 1024, "epochs": 10, "learning_rate": 0.1, "momentum": 0.9,
                                "max_grad_norm": 1.0},
            "features_l2_normalised": f["_normalised"]}


def _nonprivate_full_cell(split, seed) -> dict:
    """NOT PRIVATE: full fine-tuning of the same network (zero-initialised head, pretrained BatchNorm statistics),
    Adam, 2 epochs of batch 256 per learning rate, the rate with the better public accuracy scored on test."""
    import torch
    import torch.nn.functional as F

    from privtune.data import load_dataset
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier

    device = torch.device(RUN_OPTIONS.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    data = {k: load_dataset(split[k], num_labels=10) for k in ("train", "public", "test")}

    def accuracy(clf, ds):
        pred = clf.predict_logits(ds, batch_size=512).argmax(1)
        return float((pred == torch.as_tensor(ds.labels)).float().mean())

    best = None
    for lr in (1e-4, 5e-4):
        torch.manual_seed(seed)
        clf = load_classifier(MODEL, num_labels=10, seed=seed, image_size=IMAGE_SIZE, image_features=IMAGE_FEATURES)
        apply_mode(clf, "full", zero_init_head=True)
        clf.to(device).train()
        opt = torch.optim.Adam([p for p in clf.parameters() if p.requires_grad], lr=lr)
        labels = torch.as_tensor(data["train"].labels)
        for _ in range(2):
            order = torch.randperm(len(data["train"]))
            for s in range(0, len(order), 256):
                idx = order[s:s + 256]
                logits = clf(**clf.encode(data["train"], idx))
                F.cross_entropy(logits, labels[idx].to(device)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        public = accuracy(clf, data["public"])
        if best is None or public > best[0]:
            best = (public, lr, accuracy(clf, data["test"]))
    return {"test_accuracy": best[2], "certificate_epsilon": None, "not_private": True, "mode": "full",
            "strategy": "non-private Adam fine-tuning",
            "hyperparameters": {"learning_rate": best[1], "epochs": 2, "batch_size": 256,
                                "public_accuracy": best[0]}}


def parse_fixed(spec: str) -> list[dict]:
    """``MODE:η:α:EPOCHS[:CLIPPING[:OPTIMIZER]][,...]`` → one setting per item (``--fixed``); α scales the
    backbone's rate; clipping flat (C = 1) or automatic, optimizer adam (default), adamw, sgd or lamb."""
    from privtune.choices import CLIPPINGS, OPTIMIZERS

    settings = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        parts = item.split(":")
        if not 4 <= len(parts) <= 6 or parts[0] not in ("last-layer", "bitfit", "full"):
            raise SystemExit(f"--fixed: {item!r} is not MODE:η:α:EPOCHS[:CLIPPING[:OPTIMIZER]] with MODE "
                             "last-layer, bitfit or full (e.g. bitfit:5e-3:1:3)")
        try:
            lr, alpha, epochs = (float(v) for v in parts[1:4])
        except ValueError:
            raise SystemExit(f"--fixed: {item!r}: η, α and EPOCHS must be numbers (e.g. full:1e-2:0.1:3)") from None
        clipping, optimizer = (parts[4:] + ["flat", "adam"][len(parts) - 4:])[:2]
        if clipping not in CLIPPINGS or optimizer not in OPTIMIZERS:
            raise SystemExit(f"--fixed: {item!r}: clipping is one of {', '.join(CLIPPINGS)} and optimizer one of "
                             f"{', '.join(OPTIMIZERS)}")
        settings.append({"mode": parts[0], "learning_rate": lr, "backbone_lr_scale": alpha, "epochs": epochs,
                         "clipping": clipping, "optimizer": optimizer})
    return settings


def fixed_key(setting: dict) -> str:
    """The ``fixed`` cell's file stem for one setting, e.g. ``fixed-bitfit-lr0.005-a1-e3``."""
    extra = "".join(f"-{setting[k]}" for k, default in (("clipping", "flat"), ("optimizer", "adam"))
                    if setting.get(k, default) != default)
    return (f"fixed-{setting['mode']}-lr{setting['learning_rate']:g}-a{setting['backbone_lr_scale']:g}"
            f"-e{setting['epochs']:g}{extra}")


def _fixed_cell(split, eps, seed, setting: dict) -> dict:
    """``privtune.train`` with one setting fixed in advance (every step charged), scored on the test split by
    privtune and on the public split here; the loop's NOT PRIVATE exact examples per second recorded beside."""
    import torch

    import privtune
    from privtune.data import load_dataset

    folder = RESULTS / "runs" / f"{fixed_key(setting)}_eps{eps:g}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    kw = {k: v for k, v in RUN_OPTIONS.items() if k in ("device", "max_physical_batch_size")}
    r = privtune.train(split["train"], eval_data=split["test"], labels=LABELS, model=MODEL, image_size=IMAGE_SIZE,
                       image_features=IMAGE_FEATURES, epsilon=eps, delta=DELTA, batch_size=FIXED_BATCH, seed=seed,
                       ledger=_fresh_ledger(folder), output_dir=None, progress=VERBOSE,
                       **setting, **kw)
    public = load_dataset(split["public"], num_labels=10)
    with torch.no_grad():
        pred = r.model.eval().predict_logits(public, batch_size=512).argmax(1).cpu()
    loop = (r.not_private or {}).get("metrics") or {}
    return {"test_accuracy": float(r.metrics["accuracy"]), "certificate_epsilon": float(r.certificate.epsilon),
            "not_private": bool(r.metrics.get("not_private")), "mode": setting["mode"],
            "strategy": "fixed setting (privtune train)", "hyperparameters": r.metrics.get("hyperparameters"),
            "public_accuracy": float((pred == torch.as_tensor(public.labels)).float().mean()),
            "train_seconds": r.metrics.get("train_seconds"),
            "examples_per_second_not_private": loop.get("examples_per_second"),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}


def run_cell(cell, split, eps, seed) -> dict:
    if cell == "default":
        return _tune_cell(split, eps, seed, mode="last-layer")
    if cell in ("auto", "full"):
        return _tune_cell(split, eps, seed, mode=cell)
    if cell == "random":
        return _tune_cell(split, eps, seed, mode="last-layer", strategy="random-search")
    if cell == "oracle":
        return _tune_cell(split, eps, seed, mode="last-layer", strategy="grid-oracle")
    if cell == "opacus-last-layer":
        return _opacus_cell(split, eps, seed)
    if cell == "nonpriv-full":
        return _nonprivate_full_cell(split, seed)
    return _nonprivate_cell(split)


def main(argv=None) -> int:
    global IMAGE_FEATURES, IMAGE_SIZE, MODEL, RESULTS, VERBOSE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epsilons", type=str, default="1,3,8")
    ap.add_argument("--cells", type=str, default="default,nonpriv-last-layer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=MODEL, help=f"the backbone, any privtune vision model name (default {MODEL}; "
                    "efficientnet-lite1 and -lite2 are bundled as well)")
    ap.add_argument("--image-size", type=int, default=128, help="input resolution in pixels (default 128)")
    ap.add_argument("--image-features", choices=("final", "stages"), default="final",
                    help="what the head reads: the network's final pooled features (default) or those with each "
                         "stage's pooled output (privtune's image_features)")
    ap.add_argument("--cache-only", type=str, default=None,
                    help="only cache these splits' features (e.g. test,public), in a process of their own")
    ap.add_argument("--device", default=None, help="where the cells train: cpu, cuda, cuda:N (default: cuda when "
                    "available, else cpu)")
    ap.add_argument("--max-physical-batch-size", type=int, default=None,
                    help="micro-batch of the modes that train the backbone (privtune's default: 32)")
    ap.add_argument("--time-budget", type=float, default=None, help="minutes, passed to privtune tune")
    ap.add_argument("--results", default=None, help=f"folder of the cells' files (default {RESULTS})")
    ap.add_argument("--verbose", action="store_true", help="show privtune's progress and log lines")
    ap.add_argument("--fixed", default=None, help="the fixed cell's settings: MODE:η:α:EPOCHS[:CLIPPING[:OPTIMIZER]], "
                    "comma-separated (e.g. bitfit:5e-3:1:3,last-layer:0.3:1:10:automatic:adamw)")
    args = ap.parse_args(argv)
    MODEL, IMAGE_SIZE, IMAGE_FEATURES, VERBOSE = args.model, args.image_size, args.image_features, args.verbose
    if args.results:
        RESULTS = Path(args.results).resolve()
    RUN_OPTIONS.update({k: v for k, v in (("device", args.device), ("time_budget", args.time_budget),
                                          ("max_physical_batch_size", args.max_physical_batch_size)) if v is not None})
    if args.cache_only:
        _features(make_split(), tuple(args.cache_only.split(",")))
        return 0
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    bad = [c for c in cells if c not in CELLS]
    if bad:
        ap.error(f"unknown cell(s) {bad}; choose from {', '.join(CELLS)}")
    fixed = parse_fixed(args.fixed) if args.fixed else []
    if "fixed" in cells and not fixed:
        ap.error("the fixed cell needs its settings: --fixed MODE:η:α:EPOCHS (e.g. bitfit:5e-3:1:3)")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    RESULTS.mkdir(parents=True, exist_ok=True)
    split = make_split()
    log = open(RESULTS / "log.txt", "a", encoding="utf-8")
    for eps in [float(e) for e in args.epsilons.split(",")]:
        jobs = [(c, s) for c in cells for s in (fixed if c == "fixed" else [None])]
        for cell, setting in jobs:
            if cell in EPSILON_FREE and (RESULTS / f"{cell}.json").exists():
                continue
            # seed 0's file has no suffix; further seeds (the ε = 1 default's) have their own
            name = fixed_key(setting) if setting else cell
            key = cell if cell in EPSILON_FREE else f"{name}_eps{eps:g}" + (f"_seed{args.seed}" if args.seed
                                                                                    else "")
            t0 = time.time()
            res = _fixed_cell(split, eps, args.seed, setting) if setting else run_cell(cell, split, eps, args.seed)
            res.update(cell=cell, epsilon=None if cell in EPSILON_FREE else eps, seed=args.seed,
                       wall_s=round(time.time() - t0, 1), model=MODEL, image_size=IMAGE_SIZE,
                       image_features=IMAGE_FEATURES, n_private=58_000, n_public=2_000,
                       n_test=10_000,
                       device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
            (RESULTS / f"{key}.json").write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
            msg = f"{key}: test {res['test_accuracy']:.4f}, certificate ε {res['certificate_epsilon']}, {res['wall_s']} s"
            print(msg, flush=True)
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {msg}\n")
            log.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
