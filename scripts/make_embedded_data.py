"""Build the SST-2 subset embedded in privtune (src/privtune/data/embedded/).

Source: the GLUE SST-2 files in ../shared/data/sst2 (train.tsv: 67,349 labelled phrases; dev.tsv: 872
sentences).  Output (TSV, header ``label<TAB>sentence``):

* ``sst2_train.tsv``: 3,000 training-set phrases (the demo's private training data);
* ``sst2_public_validation.tsv``: 500 further training-set phrases, declared public for
  hyperparameter selection in the demo;
* ``sst2_dev.tsv``: all 872 dev sentences (the reported split).

SST-2's training "phrases" are nested sub-phrases of the same review sentences ("its own
pretentious self-examination" and "by its own pretentious self-examination" are two rows), so
disjointness by exact text is not enough: a private phrase inside a public one is published by it.
The split is therefore **containment-disjoint at word level**: after normalising case and
whitespace (lower-case, words split on whitespace), no private phrase is a contiguous word
sequence of a public phrase or of a dev sentence, and no public phrase or dev sentence is one of a
private phrase.  Construction (seed 0):

1. the pool: distinct training phrases with at least ``--min-words`` words (default 3; SST-2's
   training set contains many one- and two-word sub-phrases that carry little signal) that are
   not contained in, and do not contain, a dev sentence;
2. the 500 public phrases are drawn uniformly at random from the pool;
3. every pool phrase that contains a public phrase or is contained in one is removed, and the
   3,000 private phrases are drawn uniformly at random from what is left.

The script checks the result (``containment_violations``) before writing.  Usage::

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


def words(text: str) -> tuple[str, ...]:
    """The phrase as compared: lower-case words, any run of whitespace a separator."""
    return tuple(text.lower().split())


def spans(w: tuple[str, ...]) -> set[tuple[str, ...]]:
    """Every contiguous word sequence (length ≥ 1) of ``w``."""
    return {w[i:j] for i in range(len(w)) for j in range(i + 1, len(w) + 1)}


def containment_violations(inner: list[str], outer: list[str]) -> list[tuple[str, str]]:
    """Pairs (a, b), a from ``inner`` and b from ``outer``, where one is a word sub-sequence of the other.

    Used by the tests on the shipped files, so it is exact (no sampling)."""
    outer_words = [words(b) for b in outer]
    outer_spans: dict[tuple[str, ...], str] = {}
    for b, w in zip(outer, outer_words):
        for sp in spans(w):
            outer_spans.setdefault(sp, b)
    outer_full = {w: b for b, w in zip(outer, outer_words)}
    bad = []
    for a in inner:
        wa = words(a)
        if wa in outer_spans:  # a inside some b
            bad.append((a, outer_spans[wa]))
            continue
        hit = next((outer_full[sp] for sp in spans(wa) if sp in outer_full), None)  # some b inside a
        if hit is not None:
            bad.append((a, hit))
    return bad


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
    dev_spans: set[tuple[str, ...]] = set()
    dev_words = set()
    for _, s in dev:
        dev_words.add(words(s))
        dev_spans |= spans(words(s))
    seen: set[tuple[str, ...]] = set()
    pool = []
    for lab, s in train:
        t = " ".join(s.split())
        w = words(t)
        if len(w) < args.min_words or w in seen or w in dev_spans or any(sp in dev_words for sp in spans(w)):
            continue
        seen.add(w)
        pool.append((lab, t))
    rng = random.Random(args.seed)
    va = rng.sample(pool, args.validation)
    public_spans: set[tuple[str, ...]] = set()
    public_words = {words(t) for _, t in va}
    for w in public_words:
        public_spans |= spans(w)
    rest = [(lab, t) for lab, t in pool
            if words(t) not in public_spans and not any(sp in public_words for sp in spans(words(t)))]
    tr = rng.sample(rest, args.train)
    for outer in ([t for _, t in va], [s for _, s in dev]):
        bad = containment_violations([t for _, t in tr], outer)
        assert not bad, bad[:3]
    OUT.mkdir(parents=True, exist_ok=True)
    write(OUT / "sst2_train.tsv", tr)
    write(OUT / "sst2_public_validation.tsv", va)
    write(OUT / "sst2_dev.tsv", [(lab, s.strip()) for lab, s in dev])
    manifest = {
        "source": "GLUE SST-2 (Socher et al. 2013; Wang et al. 2019), ../shared/data/sst2",
        "seed": args.seed,
        "min_words": args.min_words,
        "disjointness": ("containment at word level (lower-case, whitespace-split): no private phrase is a "
                         "contiguous word sequence of a public phrase or dev sentence, or contains one"),
        "pool": {"distinct_phrases": len(pool), "after_removing_public_overlaps": len(rest)},
        "files": {
            "sst2_train.tsv": {"rows": len(tr), "from": "train.tsv", "positive": sum(l for l, _ in tr)},
            "sst2_public_validation.tsv": {"rows": len(va), "from": "train.tsv (containment-disjoint from sst2_train.tsv)",
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
