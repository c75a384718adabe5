"""Build the Fashion-MNIST subset embedded in privtune (src/privtune/data/embedded/): the image demo's data.

Source: the Fashion-MNIST IDX files (Xiao, Rasul and Vollgraf 2017; Zalando SE, MIT licence), by default those
of Debian's ``dataset-fashion-mnist`` in /usr/share/datasets/fashion-mnist/.  Output (gzip IDX, standard
naming, so ``--data`` finds each labels file next to its images):

* ``fashion_train-images-idx3-ubyte.gz``: 3,000 training-set images (the demo's private training data);
* ``fashion_public-images-idx3-ubyte.gz``: 500 other training-set images, declared public by the demo for
  selection;
* ``fashion_test-images-idx3-ubyte.gz``: 1,000 test-set images (the reported split).

The 3,500 training-set indices are one uniform draw without replacement (seed 0), so the private and public
images are distinct rows of the training set; the test images are a uniform draw from the test set.  The
script also refuses to write when a private image is byte-identical to a public or test image (Fashion-MNIST
holds a few exact duplicates).  Usage::

    python scripts/make_embedded_fashion_mnist.py [--source /usr/share/datasets/fashion-mnist] [--seed 0]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "privtune" / "data" / "embedded"
SIZES = {"fashion_train": 3000, "fashion_public": 500, "fashion_test": 1000}


def read_idx(path: Path) -> np.ndarray:
    raw = gzip.decompress(path.read_bytes())
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    # mtime=0: the same bytes on every rebuild
    path.write_bytes(gzip.compress(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes(), 9, mtime=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    x_tr, y_tr = read_idx(a.source / "train-images-idx3-ubyte.gz"), read_idx(a.source / "train-labels-idx1-ubyte.gz")
    x_te, y_te = read_idx(a.source / "t10k-images-idx3-ubyte.gz"), read_idx(a.source / "t10k-labels-idx1-ubyte.gz")
    rng = np.random.default_rng(a.seed)
    drawn = rng.choice(len(x_tr), SIZES["fashion_train"] + SIZES["fashion_public"], replace=False)
    idx = {"fashion_train": np.sort(drawn[:SIZES["fashion_train"]]),
           "fashion_public": np.sort(drawn[SIZES["fashion_train"]:]),
           "fashion_test": np.sort(rng.choice(len(x_te), SIZES["fashion_test"], replace=False))}
    splits = {"fashion_train": (x_tr, y_tr), "fashion_public": (x_tr, y_tr), "fashion_test": (x_te, y_te)}
    private = {x_tr[i].tobytes() for i in idx["fashion_train"]}
    for name in ("fashion_public", "fashion_test"):
        x = splits[name][0]
        dup = [int(i) for i in idx[name] if x[i].tobytes() in private]
        if dup:  # a byte-identical image on both sides would be published by the public split
            keep = np.array([i for i in idx[name] if x[i].tobytes() not in private])
            print(f"{name}: dropped {len(dup)} image(s) identical to a private one")
            idx[name] = keep
    files = {}
    for name, rows in idx.items():
        x, y = splits[name]
        write_idx(OUT / f"{name}-images-idx3-ubyte.gz", x[rows])
        write_idx(OUT / f"{name}-labels-idx1-ubyte.gz", y[rows])
        files[f"{name}-images-idx3-ubyte.gz"] = {
            "rows": int(len(rows)), "from": "t10k" if name == "fashion_test" else "train",
            "per_class": np.bincount(y[rows], minlength=10).tolist()}
    manifest_path = OUT / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest["fashion_mnist"] = {
        "source": "Fashion-MNIST (Xiao, Rasul and Vollgraf 2017), Debian dataset-fashion-mnist",
        "licence": "MIT (Expat), Copyright 2017 Zalando SE; see data/embedded/README.md",
        "seed": a.seed,
        "disjointness": "private and public are distinct training-set rows (one draw without replacement); "
                        "no public or test image is byte-identical to a private one",
        "labels": "0 T-shirt/top, 1 Trouser, 2 Pullover, 3 Dress, 4 Coat, 5 Sandal, 6 Shirt, 7 Sneaker, 8 Bag, "
                  "9 Ankle boot",
        "files": files,
    }
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
