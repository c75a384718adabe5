"""Build the chitchat slice embedded in privtune (src/privtune/data/embedded/): the generation demo's data.

Source: the PyPI package ``chitchat-dataset`` 0.9.0 (BYU PCC lab, MIT licence): crowd-sourced conversations,
read as context → response pairs by :func:`privtune.data.generation.load_chitchat` (one previous turn as the
context).  Short pairs only (context ≤ 160 characters, response ≤ 120).  The conversations are shuffled
(seed 0) and assigned whole, in that order, to the public split, then the reported split, then the private
split, until each holds its number of pairs, so that no conversation is on two sides.  Output (JSONL, columns
``context``, ``response``, ``conversation``):

* ``chitchat_train.jsonl``: 800 pairs, the demo's private training data;
* ``chitchat_public.jsonl``: 200 pairs from other conversations, declared public by the demo (selection by
  perplexity, the generations shown in the report);
* ``chitchat_test.jsonl``: 200 pairs from other conversations, the reported split.

Usage::

    python scripts/make_embedded_chitchat.py [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "privtune" / "data" / "embedded"
SIZES = {"chitchat_public": 200, "chitchat_test": 200, "chitchat_train": 800}
MAX_CONTEXT, MAX_RESPONSE = 160, 120


def build(seed: int = 0) -> dict[str, list[dict]]:
    from privtune.data.generation import load_chitchat, split_by_group

    ds = load_chitchat(context_turns=1)
    by_conv: dict[str, list[dict]] = {}
    for p, r, g in zip(ds.prompts, ds.responses, ds.groups):
        if len(p) <= MAX_CONTEXT and len(r) <= MAX_RESPONSE:
            by_conv.setdefault(g, []).append({"context": p, "response": r, "conversation": g})
    splits = split_by_group(by_conv, SIZES, seed)
    seen: dict[str, str] = {}
    for name, rows in splits.items():
        for row in rows:
            assert seen.setdefault(row["conversation"], name) == name, "a conversation on two sides"
    return splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    splits = build(args.seed)
    for name, rows in splits.items():
        (OUT / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                         encoding="utf-8")
    manifest_path = OUT / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest["chitchat"] = {
        "source": "PyPI chitchat-dataset 0.9.0 (BYU PCC lab, MIT licence)", "seed": args.seed,
        "pairs": {name: len(rows) for name, rows in splits.items()},
        "conversations": {name: len({r["conversation"] for r in rows}) for name, rows in splits.items()},
        "max_context_chars": MAX_CONTEXT, "max_response_chars": MAX_RESPONSE,
        "split": "by conversation: shuffled conversations assigned whole to public, test, then train",
    }
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(manifest["chitchat"], indent=2))


if __name__ == "__main__":
    main()
