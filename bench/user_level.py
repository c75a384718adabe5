"""User-level DP: what a step costs at the unit level against the example level (``--overhead``), and the price
of the honest unit on SST-2 with the review sentence as unit (``--sst2``) and on chat with the sender as unit
(``--chat``).

    python bench/user_level.py --overhead --out bench/results/user_level/overhead.json
    python bench/user_level.py --sst2 --out bench/results/user_level/sst2.json
    python bench/user_level.py --chat --out bench/results/user_level/chat.json

``--sst2``: SST-2's training phrases (``--sst2-dir``, GLUE's ``train.tsv`` and ``dev.tsv``) with the review sentence
as the privacy unit.  GLUE does not say which sentence a phrase comes from, so the sentences are rebuilt by this
rule: **a sentence is a training phrase that is no contiguous sub-phrase (by tokens) of another training phrase;
each phrase belongs to the longest sentence that contains it, ties broken by the sentence's position in the
file** (phrases are taken longest first, so every sentence is met before its sub-phrases).  On GLUE's 67,349
phrases this gives 6,886 sentences, 9.8 phrases each on average, at most 46.  A seeded subset of
``--sentences`` sentences (``random.Random(0).sample`` of the sentence ids) with all their phrases is the private
data; the reported split is GLUE's 872 dev sentences.  At each ε of ``--epsilons`` and each seed of ``--seeds``:
``privtune tune --mode last-layer`` (hyperfree, everything charged, δ = ``--delta``) at the user level
(``--privacy-unit review``, k = ``--max-rows-per-unit``) and at the example level, on the backbone features
cached once (``feature_cache_dir``).  For the example-level run the result also gives what it guarantees the
most active review (c rows): by group privacy, (ε, δ)-DP for one row gives a group of c rows (c·ε, c·e^{(c−1)ε}·δ),
computed from the run's certificate ε and δ (a δ term ≥ 1 is no guarantee at all).

``--chat``: the chitchat conversations (PyPI ``chitchat-dataset``, one previous turn as the context) with the
**sender of the response as the privacy unit**, SmolLM2-135M-Instruct with LoRA (``privtune tune``'s generation
default).  The splits are disjoint by person, not only by row: conversations are taken in a seeded order
(``random.Random(0)``), a conversation is used only if both its participants answer in it (so both are known),
and it goes to the split that already owns one of its participants, or, when neither is owned yet, to the first
split in the order public, reported, private that still has room; a conversation whose participants are owned by
two splits, or by a full one, is skipped.  So no person's words (as response or as context) are on two sides.
Sizes: ``--public`` pairs (selection by perplexity), ``--reported`` pairs (scored, never selected on) and
``--chat-private`` private pairs.  Cells, one seed each, at each ε of ``--epsilons``: the zero-shot model (the
floor, once), ``privtune tune`` at the user level (``--privacy-unit sender``, k = ``--max-rows-per-unit``,
``--unit-batch-size`` expected senders per step for ``--unit-epochs`` epochs of senders) and at the example
level (``--batch-size`` rows per step, ``--epochs``), everything charged.  Scores as in ``bench/generation.py``:
BLEU, chrF, ROUGE-L of greedy replies to the first ``--scored-rows`` reported pairs, perplexity on all of them.
The gain of a run is its drop in perplexity from the zero-shot model (the BLEU gain too); the price of the unit
is the user-level gain over the example-level gain at the same ε.  The example-level result also gives what it
guarantees the most active sender (group privacy at that sender's row count, as for ``--sst2``).

``--overhead`` times one DP step of :func:`privtune.training.fit` at the example level and at the unit level
with **the same rows in every step**: a full batch of R rows, at the unit level grouped into R/r units of r
rows with the cap k = r (so every unit contributes all its rows and the engine sees the same R rows; what is
added is the unit sampler, the weights 1/m_u and their multiplication into the clip factors).  Two workloads:

* ``bitfit``: DP-BiTFiT of the bundled all-MiniLM-L6-v2 on R = 64 phrases of the embedded SST-2 subset;
* ``head``: a linear head on R = 4,096 cached 384-d features (random: speed does not depend on the values),
  the closed-form head gradient.

At ``--rates`` below 1 both levels sample Poisson at q (rows at the example level, units at the unit level: the
same expected rows) and the figure is the time per ``R`` rows used.  Each (workload, rate, level) runs
``--steps`` steps after one warm-up step, alternating levels, ``--repeats`` times; the figure is the median CPU
seconds per step (``--clock cpu``: ``time.process_time``, one thread) or wall
seconds (``--clock wall``).  The ratio is user-level over example-level; the target is ≤ 1.2.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _clock(kind: str):
    return time.process_time if kind == "cpu" else time.perf_counter


def _workload(name: str):
    """``(make_model, train_set, rows)`` of a workload: a fresh model per run, the same data."""
    from privtune.data import embedded_sst2
    from privtune.finetune import apply_mode
    from privtune.finetune.last_layer import FeatureSet
    from privtune.models import load_classifier

    if name == "bitfit":
        train = embedded_sst2()[0].subset(range(64))

        def make():
            clf = load_classifier(None, num_labels=2, seed=0)
            apply_mode(clf, "bitfit")
            return clf

        return make, train, 64
    g = torch.Generator().manual_seed(0)
    feats = FeatureSet(torch.randn(4096, 384, generator=g), torch.randint(0, 2, (4096,), generator=g), 2)

    def make_head():
        return torch.nn.Linear(384, 2)

    return make_head, feats, 4096


def _time_steps(make, train, rows: int, steps: int, clock, units: list | None, r: int, q: float = 1.0) -> float:
    """Seconds per step of ``rows`` rows (steps 2 … steps+1; step 1 is the warm-up) of one fit at rate q: the
    median over steps at q = 1 (every step has the same rows); below 1 (Poisson: the rows vary from step to step)
    the total time over the total rows used, times ``rows``."""
    from privtune.specs import LoopOptions, NoiseSpec, OptimizerSpec
    from privtune.training import fit

    marks: list[float] = []
    used: list[int] = []

    def mark(info) -> None:
        marks.append(clock())
        used.append(info.batch_size)

    extra = {} if units is None else {"privacy_unit": units, "max_rows_per_unit": r}
    fit(make(), train, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=q, steps=steps + 1, **extra),
        optimizer=OptimizerSpec(learning_rate=1e-3), options=LoopOptions(seed=0, max_physical_batch_size=rows),
        callback=mark, device="cpu")
    per_step = [b - a for a, b in zip(marks, marks[1:])]
    if q >= 1.0:
        return statistics.median(per_step)
    return sum(per_step) / sum(used[1:]) * rows


def overhead(args) -> dict:
    torch.set_num_threads(1)
    clock = _clock(args.clock)
    out = {"workloads": {}}
    for name in args.workloads:
        make, train, rows = _workload(name)
        units = [i // args.rows_per_unit for i in range(rows)]
        for q in args.rates:
            runs = {"example": [], "user": []}
            for _ in range(args.repeats):
                runs["example"].append(_time_steps(make, train, rows, args.steps, clock, None, args.rows_per_unit, q))
                runs["user"].append(_time_steps(make, train, rows, args.steps, clock, units, args.rows_per_unit, q))
            ex, us = statistics.median(runs["example"]), statistics.median(runs["user"])
            out["workloads"][f"{name} q={q:g}"] = {
                "rows": rows, "units": rows // args.rows_per_unit, "rows_per_unit": args.rows_per_unit,
                "sample_rate": q, "seconds_per_step_of_all_rows": {"example_level": ex, "user_level": us},
                "ratio_user_over_example": us / ex, "repeats": runs}
            print(f"{name} q={q:g}: {rows} rows ({rows // args.rows_per_unit} units of {args.rows_per_unit}): example "
                  f"{ex * 1e3:.2f} ms, user {us * 1e3:.2f} ms per {rows} rows ({args.clock}), ratio {us / ex:.3f}")
    return out


def assign_sentences(phrases: list[str]) -> list[int]:
    """The sentence of every phrase by the rule of the module doc: a sentence is a phrase that is no contiguous
    token sub-sequence of another phrase; a phrase belongs to the longest sentence containing it (ties: the
    sentence first in the file).  Returns one sentence id per phrase (ids in the order the sentences are met)."""
    order = sorted(range(len(phrases)), key=lambda i: (-len(phrases[i].split()), i))
    owner: dict[str, int] = {}  # every sub-phrase of a sentence met so far -> the first (longest) such sentence
    sentence_of = [0] * len(phrases)
    count = 0
    for i in order:
        p = " ".join(phrases[i].split())
        if p in owner:
            sentence_of[i] = owner[p]
            continue
        toks = p.split()
        for a in range(len(toks)):
            for b in range(a + 1, len(toks) + 1):
                owner.setdefault(" ".join(toks[a:b]), count)
        sentence_of[i] = count
        count += 1
    return sentence_of


def _group_privacy(epsilon: float, delta: float, rows: int) -> dict:
    """(c·ε, c·e^{(c−1)ε}·δ) for a group of c = ``rows`` rows (the δ term as log10, and capped at 1 in words)."""
    import math

    log10_delta = math.log10(rows) + (rows - 1) * epsilon / math.log(10) + math.log10(delta)
    return {"rows": rows, "epsilon": rows * epsilon, "delta_log10": log10_delta,
            "delta": 10 ** log10_delta if log10_delta < 0 else None, "meaningful": log10_delta < 0}


def sst2(args) -> dict:
    """The ``--sst2`` part (module doc): user level against example level on the review-sentence units."""
    import random
    import tempfile

    import privtune

    torch.set_num_threads(1)
    root = Path(args.sst2_dir)
    rows = [line.rstrip("\n").split("\t") for line in open(root / "train.tsv", encoding="utf-8")][1:]
    sentence_of = assign_sentences([r[1] for r in rows])
    n_sentences = max(sentence_of) + 1
    chosen = set(random.Random(0).sample(range(n_sentences), args.sentences))
    keep = [i for i in range(len(rows)) if sentence_of[i] in chosen]
    per_unit: dict[int, int] = {}
    for i in keep:
        per_unit[sentence_of[i]] = per_unit.get(sentence_of[i], 0) + 1
    work = Path(tempfile.mkdtemp(prefix="privtune-user-level-"))
    data = work / "train.tsv"
    data.write_text("label\tsentence\treview\n" + "".join(f"{rows[i][0]}\t{rows[i][1]}\ts{sentence_of[i]}\n"
                                                        for i in keep), encoding="utf-8")
    c_max = max(per_unit.values())
    out = {"subset": {"rule": "phrases of random.Random(0).sample(range(sentences), --sentences) sentences",
                      "sentences_in_train": n_sentences, "phrases_in_train": len(rows),
                      "sentences": len(per_unit), "phrases": len(keep), "most_phrases_of_one_sentence": c_max,
                      "mean_phrases_per_sentence": len(keep) / len(per_unit)},
           "delta": args.delta, "max_rows_per_unit": args.max_rows_per_unit, "runs": []}
    print(f"sst2: {len(keep)} phrases of {len(per_unit)} sentences (at most {c_max} phrases each)", flush=True)
    for eps in args.epsilons:
        for seed in args.seeds:
            for level in ("user", "example"):
                t0 = time.perf_counter()
                unit = {"privacy_unit": "review", "max_rows_per_unit": args.max_rows_per_unit} if level == "user" else {}
                r = privtune.tune(str(data), eval_data=str(root / "dev.tsv"), mode="last-layer", epsilon=eps,
                                  delta=args.delta, labels=["0", "1"], seed=seed, quiet=True, write_files=False,
                                  ledger=f"sqlite:///{work / f'{level}-{eps:g}-{seed}.db'}",
                                  feature_cache_dir=str(work / "features"), **unit)
                run = {"level": level, "epsilon": eps, "seed": seed, "dev_accuracy": r.metrics["accuracy"],
                       "certificate_epsilon": r.certificate.epsilon, "certificate_delta": r.certificate.delta,
                       "neighbouring": r.certificate.neighbouring, "seconds": round(time.perf_counter() - t0, 1)}
                if level == "example":
                    run["most_active_review"] = _group_privacy(r.certificate.epsilon, r.certificate.delta, c_max)
                out["runs"].append(run)
                print(f"ε={eps:g} seed={seed} {level}: dev {run['dev_accuracy']:.4f} (certificate ε "
                      f"{run['certificate_epsilon']:.4g}, {run['seconds']} s)", flush=True)
    return out


def split_by_person(conversations: dict[str, list[dict]], sizes: dict[str, int],
                    seed: int = 0) -> dict[str, list[dict]]:
    """``{split: rows}`` with no person on two sides (the rule of the module doc): ``conversations`` maps a
    conversation id to its rows (``sender`` = who wrote the response); splits are filled in the order of
    ``sizes``."""
    import random

    order = sorted(conversations)
    random.Random(seed).shuffle(order)
    owner: dict[str, str] = {}
    out: dict[str, list[dict]] = {name: [] for name in sizes}
    for cid in order:
        rows = conversations[cid]
        people = {r["sender"] for r in rows}
        if len(people) < 2:  # the opening turn's writer answers nowhere: unknown, so not used
            continue
        owners = {owner[p] for p in people if p in owner}
        if len(owners) > 1:
            continue
        free = [n for n in sizes if len(out[n]) < sizes[n]]
        if not free:
            break
        name = owners.pop() if owners else free[0]
        if name not in free:
            continue
        owner.update((p, name) for p in people)
        out[name] += rows[: sizes[name] - len(out[name])]
    short = {n: len(r) for n, r in out.items() if len(r) < sizes[n]}
    if short:
        raise SystemExit(f"too few conversations for the split sizes {sizes}: got {short}")
    return out


def _chat_cell(args, files: dict, work: Path, level: str | None, eps: float | None) -> dict:
    """One column: the zero-shot model (``level=None``) or ``privtune tune`` at the user or example level."""
    from privtune.data.generation import load_generation_dataset
    from privtune.hpo.tune import tune
    from privtune.models.generator import load_generator
    from privtune.tasks.generation import Generation

    t0 = time.perf_counter()
    if level is None:
        model, extra = load_generator(args.model, max_length=args.max_length), {"epsilon": 0.0}
    else:
        unit = ({"privacy_unit": "sender", "max_rows_per_unit": args.max_rows_per_unit,
                 "batch_size": args.unit_batch_size, "epochs": args.unit_epochs} if level == "user"
                else {"batch_size": args.batch_size, "epochs": args.epochs})
        r = tune(str(files["private"]), eval_data=str(files["reported"]), public_eval_data=str(files["public"]),
                 model=args.model, mode="lora", epsilon=eps, delta=args.delta, max_length=args.max_length,
                 ledger=f"sqlite:///{work / f'ledger-{level}-{eps:g}.db'}", output_dir=work / f"run-{level}-{eps:g}",
                 quiet=True, seed=None, max_physical_batch_size=args.micro_batch, **unit)
        model = r.model
        extra = {"level": level, "epsilon": r.certificate.epsilon, "delta": r.certificate.delta,
                 "neighbouring": r.certificate.neighbouring, "hyperparameters": r.metrics["hyperparameters"]}
    s = Generation().evaluate(model, load_generation_dataset(files["reported"]), scored_rows=args.scored_rows)
    cell = {k: s[k] for k in ("bleu", "chrf", "rouge_l", "perplexity", "scored_rows")}
    return {**cell, **extra, "seconds": round(time.perf_counter() - t0, 1)}


def chat(args, save) -> dict:
    """The ``--chat`` part (module doc): user level (sender) against example level on chitchat."""
    import collections
    import os
    import tempfile

    from privtune.data.generation import load_chitchat

    work = Path(tempfile.mkdtemp(prefix="privtune-user-level-chat-"))
    os.environ.setdefault("PRIVTUNE_HOME", str(work / "home"))
    ds = load_chitchat(context_turns=1)
    conversations: dict[str, list[dict]] = {}
    for p, r, g, who in zip(ds.prompts, ds.responses, ds.groups, ds.senders):
        conversations.setdefault(g, []).append({"context": p, "response": r, "sender": who})
    splits = split_by_person(conversations, {"public": args.public, "reported": args.reported,
                                             "private": args.chat_private})
    files = {}
    for name, rows in splits.items():
        files[name] = work / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    per_sender = collections.Counter(r["sender"] for r in splits["private"])
    c_max = max(per_sender.values())
    out = {"subset": {"rule": "split_by_person (module doc), seed 0", "pairs": {n: len(r) for n, r in splits.items()},
                      "senders": {n: len({r['sender'] for r in rows}) for n, rows in splits.items()},
                      "most_rows_of_one_sender": c_max,
                      "mean_rows_per_sender": len(splits["private"]) / len(per_sender)},
           "model": args.model, "max_length": args.max_length, "delta": args.delta,
           "max_rows_per_unit": args.max_rows_per_unit, "cells": {}}
    print(f"chat: {out['subset']['pairs']} pairs; private senders {len(per_sender)} (at most {c_max} rows)", flush=True)
    cells = [("zero-shot", None, None)] + [(f"{lv}@eps={e:g}", lv, e) for e in args.epsilons for lv in args.levels]
    for name, level, eps in cells:
        cell = _chat_cell(args, files, work, level, eps)
        if level == "example":
            cell["most_active_sender"] = _group_privacy(cell["epsilon"], cell["delta"], c_max)
        out["cells"][name] = cell
        print(f"{name}: perplexity {cell['perplexity']:.2f}, BLEU {cell['bleu']:.2f} (ε {cell['epsilon']:.4g}, "
              f"{cell['seconds']} s)", flush=True)
        save(out)
    return out


def _machine() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = None
    try:
        import os

        load = os.getloadavg()
    except OSError:
        load = None
    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or
            platform.machine(), "threads": torch.get_num_threads(), "git_commit": commit, "load_average_at_end": load}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--overhead", action="store_true", help="time a user-level step against an example-level one")
    ap.add_argument("--workloads", nargs="+", default=["head", "bitfit"], choices=("head", "bitfit"))
    ap.add_argument("--rows-per-unit", type=int, default=4, help="r: rows of every unit (and the cap k = r)")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 0.25],
                    help="sampling rates q: 1 (every row each step) and Poisson rates (units at q, rows at q)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per level, alternating")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--sst2", action="store_true", help="SST-2 with the review sentence as unit (module doc)")
    ap.add_argument("--sst2-dir", default="/work/shared/data/sst2", help="GLUE SST-2: train.tsv and dev.tsv")
    ap.add_argument("--sentences", type=int, default=4000, help="review sentences in the private subset")
    ap.add_argument("--epsilons", type=float, nargs="+", default=[3.0, 8.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--max-rows-per-unit", type=int, default=8, help="k at the user level")
    ap.add_argument("--chat", action="store_true", help="chitchat generation with the sender as unit (module doc)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chat-private", type=int, default=2000, help="private pairs")
    ap.add_argument("--public", type=int, default=1000, help="public pairs (selection)")
    ap.add_argument("--reported", type=int, default=500, help="reported pairs (scored)")
    ap.add_argument("--scored-rows", type=int, default=200, help="reported pairs decoded for BLEU/chrF/ROUGE-L")
    ap.add_argument("--max-length", type=int, default=64, help="tokens per pair")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=64, help="rows per step at the example level")
    ap.add_argument("--epochs", type=float, default=1.0, help="epochs of rows at the example level")
    ap.add_argument("--unit-batch-size", type=int, default=16, help="expected senders per step at the user level")
    ap.add_argument("--unit-epochs", type=float, default=2.0, help="epochs of senders at the user level")
    ap.add_argument("--levels", nargs="+", default=["user", "example"], choices=("user", "example"))
    ap.add_argument("--out", default=None, help="also write the results as JSON to this path")
    args = ap.parse_args(argv)
    if args.overhead + args.sst2 + args.chat != 1:
        ap.error("choose what to run: --overhead, --sst2 or --chat")
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    command = " ".join(["python", "bench/user_level.py", *(argv if argv is not None else sys.argv[1:])])

    def save(res: dict) -> None:  # the chat bench writes after every cell: a long run that stops keeps its cells
        timing = {"clock": args.clock, "statistic": "median seconds per step over steps, then over repeats"}
        doc = {"command": command, **(timing if args.overhead else {}), "machine": _machine(),
               "seconds_total_wall": round(time.perf_counter() - t0, 1),
               "cpu_seconds_total": round(time.process_time() - cpu0, 1), **res}
        if args.out:
            path = Path(args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")

    save(chat(args, save) if args.chat else overhead(args) if args.overhead else sst2(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
