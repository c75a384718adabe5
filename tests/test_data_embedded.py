"""The embedded demo split: its public phrases must not publish its private ones (issue 13 item 9)."""

from __future__ import annotations

import csv
import json

from privtune.data.datasets import embedded_path


def _sentences(split: str) -> list[str]:
    with embedded_path(split).open(encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    col = rows[0].index("sentence")
    return [r[col] for r in rows[1:]]


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.lower().split())


def _spans(w: tuple[str, ...]) -> set[tuple[str, ...]]:
    return {w[i:j] for i in range(len(w)) for j in range(i + 1, len(w) + 1)}


def _overlaps(private: list[str], other: list[str]) -> list[str]:
    """Private phrases that are a contiguous word sequence of an ``other`` phrase, or contain one
    (case- and whitespace-insensitive)."""
    other_words = {_words(b) for b in other}
    other_spans = set().union(*(_spans(w) for w in other_words))
    return [a for a in private if _words(a) in other_spans or _spans(_words(a)) & other_words]


def test_private_phrases_are_containment_disjoint_from_public_and_dev():
    train, public, dev = _sentences("train"), _sentences("public_validation"), _sentences("test")
    assert (len(train), len(public), len(dev)) == (3000, 500, 872)
    # SST-2 phrases are nested sub-phrases of the same reviews: exact-text disjointness is not enough
    assert _overlaps(train, public) == []
    assert _overlaps(train, dev) == []


def test_manifest_states_the_disjointness_and_counts():
    manifest = json.loads(embedded_path("train").with_name("manifest.json").read_text(encoding="utf-8"))
    assert "containment" in manifest["disjointness"]
    assert manifest["files"]["sst2_train.tsv"]["rows"] == 3000
    assert manifest["files"]["sst2_public_validation.tsv"]["rows"] == 500
