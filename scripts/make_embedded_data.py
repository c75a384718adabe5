"""Build the SST-2 subset embedded in privtune (src/privtune/data/embedded/).

Source: the GLUE SST-2 files in ../shared/data/sst2 (train.tsv: 67,349 labelled phrases; dev.tsv: 872
sentences).  Output (TSV, header ``label<TAB>sentence``):

* ``sst2_train.tsv``: 3,000 training-set phrases (the demo's private training data);
* ``sst2_public_validation.tsv``: 500 further training-set phrases, disjoint from the above by text,
  declared public for hyperparameter selection in the demo;
* ``sst2_dev.tsv``: all 872 dev sentences (the reported split).

Phrases are drawn uniformly at random (seed 0) among distinct training phrases with at least
``--min-words`` words (default 3; SST-2's training set contains many one- and two-word sub-phrases
that carry little signal), and never a phrase that also occurs in dev.  Usage::

    python scripts/make_embedded_data.py [--source ../shared/data/sst2] [--seed 0]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "privtune" / "data" / "embedded"


def read(path: Path) -> list[tuple[int, str]]:
    with path.open(encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header, body = rows[0], rows[1:]
    li, si = header.index("label"), header.index("sentence")
    return [(int(r[li]), r[si]) for r in body]


def write(path: Path, rows: list[tuple[int, str]]) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write("label\tsentence\n")
        for lab, s in rows:
            assert "\t" not in s and "\n" not in s
            f.write(f"{lab}\t{s}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=ROOT.parent / "shared" / "data" / "sst2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=3000)
    ap.add_argument("--validation", type=int, default=500)
    ap.add_argument("--min-words", type=int, default=3)
    args = ap.parse_args()

    train = read(args.source / "train.tsv")
    dev = read(args.source / "dev.tsv")
    dev_texts = {s.strip() for _, s in dev}
    seen: set[str] = set()
    pool = []
    for lab, s in train:
        t = s.strip()
        if len(t.split()) < args.min_words or t in seen or t in dev_texts:
            continue
        seen.add(t)
        pool.append((lab, t))
    rng = random.Random(args.seed)
    picked = rng.sample(pool, args.train + args.validation)
    tr, va = picked[: args.train], picked[args.train :]
    assert not ({t for _, t in tr} & {t for _, t in va})
    OUT.mkdir(parents=True, exist_ok=True)
    write(OUT / "sst2_train.tsv", tr)
    write(OUT / "sst2_public_validation.tsv", va)
    write(OUT / "sst2_dev.tsv", [(lab, s.strip()) for lab, s in dev])
    manifest = {
        "source": "GLUE SST-2 (Socher et al. 2013; Wang et al. 2019), ../shared/data/sst2",
        "seed": args.seed,
        "min_words": args.min_words,
        "files": {
            "sst2_train.tsv": {"rows": len(tr), "from": "train.tsv", "positive": sum(l for l, _ in tr)},
            "sst2_public_validation.tsv": {"rows": len(va), "from": "train.tsv (disjoint from sst2_train.tsv)",
                                            "positive": sum(l for l, _ in va)},
            "sst2_dev.tsv": {"rows": len(dev), "from": "dev.tsv (all rows; reported split)",
                             "positive": sum(l for l, _ in dev)},
        },
    }
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    total = sum(p.stat().st_size for p in OUT.iterdir() if p.is_file())
    print(json.dumps(manifest["files"], indent=1))
    print(f"total size {total / 1024:.1f} KiB in {OUT}")


if __name__ == "__main__":
    main()
