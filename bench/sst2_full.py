"""Private fine-tuning of MiniLM on the full SST-2 training set, tuning included.

Data: private = the SST-2 training phrases minus a public split of ``--public-size`` (2,000) phrases that no
private phrase contains or is contained in (word level, lower-case; SST-2 holds the sub-phrases of its sentences,
so the public phrases, of at least 3 words, are those with the fewest training phrases inside them or around
them, and those relatives leave the private set), minus the phrases whose text is also a GLUE dev sentence
(tune refuses overlapping splits).  The GLUE dev set
(872 sentences) is reported and never used for selection: every selection reads the public split only.

Rows: total ε (``--epsilons``, default 1,3,8; δ = 1e-5).  Columns (``--cells``):

  default        ``privtune.tune`` with no strategy or mode given (hyperfree, mode auto)
  bitfit         ``privtune.tune(mode="bitfit")``
  full           ``privtune.tune(mode="full")``
  last-layer     ``privtune.tune(mode="last-layer")``: the head on cached features of the frozen backbone
  random-last-layer  ``privtune.tune(mode="last-layer", strategy="random-search")``: privtune's charged random
                 search over the head on the same cached features
  oracle-last-layer  NOT PRIVATE: ``privtune.tune(mode="last-layer", strategy="grid-oracle")``, privtune's grid
                 oracle over the same head on the same features (every grid point at the full ε, the best on the
                 public split; its head is scored on the dev set and never released)
  default-no-eta-trials  ablation: the default with ``strategy_options={"lr_trials": []}`` (no η placement)
  full-no-eta-trials     the same ablation of ``full``
  full-batch4096         ``full`` at expected batch 4,096 (the planner's choice at ε = 3; at ε = 1 it plans 2,048)
  random         charged random search, k = 8 trials over the space below, every trial's events composed
                 (one σ for all: the composition of all trials meets ε), best on the public split released
  oracle         NOT PRIVATE grid oracle over the same space: every grid point run at the full ε, selection
                 uncharged; a reference, never a private result
  nonpriv-bitfit NOT PRIVATE non-private BiTFiT, 1 epoch (ε = ∞)
  nonpriv-full   NOT PRIVATE non-private full fine-tuning, 1 epoch (ε = ∞)
  default-lr0-1e-2  the default with ``strategy_options={"lr0": 0.01}`` (η placement from η0 = 1e-2)
  default-public-warm-start  experiment: the default from a NOT PRIVATE warm start (full fine-tuning on a seeded
                 half of the public split, 3 epochs), the other half the public split it selects on; costs no
                 ε (public data only)
  fixed-bitfit   one fixed DP-BiTFiT setting, its choice NOT charged (a reference): zero head, flat C = 1,
                 Adam 1e-2, expected batch 1,024, 3 epochs, σ calibrated to the full ε;
                 ``fixed-bitfit-normalised`` the same on the checkpoint's L2-normalised features,
                 ``fixed-bitfit-normalised-lr3e-2`` that at Adam 3e-2 (they isolate the head change)
  fixed-full     one fixed DP full fine-tuning setting, its choice NOT charged (a reference): zero head, flat
                 C = 1, Adam 5e-4 (Li et al. 2022's SST-2 rate), expected batch 1,024, 1 epoch, σ calibrated to ε;
                 ``fixed-full-lr2e-3`` the same at Adam 2e-3, ``fixed-full-lr2e-3-epochs3`` that for 3 epochs,
                 ``fixed-full-lr5e-3`` and ``fixed-full-lr1e-2`` one epoch at those rates;
                 ``fixed-full-alpha0.1`` / ``-alpha0.03`` / ``-alpha0.3``: the head at Adam 1e-2 and every pre-trained weight at
                 α·1e-2 (``backbone_lr_scale``, Mehta et al.), one epoch; ``fixed-full-alpha0.1-batch256`` that at
                 expected batch 256 (the same compute in 4× the steps); ``fixed-full-alpha0.1-epochs3`` three epochs,
                 ``fixed-full-alpha0.1-epochs3-frozen-embeddings`` that with the word-embedding table frozen
  clipped-full-lr2e-3  NOT PRIVATE: the fixed-full-lr2e-3 recipe at σ = 0 (clipping kept): what is left
                 of the recipe without its noise

The search space of ``random`` and ``oracle``: DP-BiTFiT (flat clipping C = 1, Adam, zero-initialised head)
at the seed-003 recommended expected batch for (ε, n, 3 epochs); learning rate log-uniform in
[1.25e-3, 8e-2] (random) or the grid {2.5e-3, 1e-2, 4e-2} (oracle); epochs in {1, 2, 3} (random) or
{1, 3} (oracle).  ``random-full`` and ``oracle-full``: the same searches over DP full fine-tuning, the mode
the default trains from 60,000 examples (η is the head's rate; the pre-trained weights step at α·η with the
mode's α = 0.1): the default's own space at full size.

Each cell reports dev accuracy, certificate ε, wall time and compute relative to one final run (examples
through DP/non-private gradient steps of the whole cell ÷ those of its released run; forward-only passes
such as scoring are not counted).  Each (cell, ε, seed) is its own JSON file under
``bench/results/sst2_full/<tag>/``, kept in git with the trial files and ``log.txt`` (not the split's rows, which
the bench rebuilds, nor the tune runs' output folders with their models); an existing file is reused (resumable),
and a cell without one is printed as "not run"; ``random`` and ``oracle`` also resume trial by trial (``runs/<key>/trial<i>.json``), since
at full size they are 12 (oracle) and 18 (random) epochs of DP-BiTFiT, more than one sitting on a CPU;
``--trials 4,5`` runs only those trials, so that two processes (one thread each) can share a cell; the one that
finishes last writes the cell.  A trial
file also holds ``iterate_averages``: the public and dev accuracy of two averages of that run's iterates (EMA and
second-half mean; post-processing kept beside the run to measure averaging, never selected or reported as the cell).  Logs: each tune run's
``log.txt`` in the same folder, the script's output in ``log.txt``.

``--backbone NAME`` runs the cells on another backbone (a name such as ``all-mpnet-base-v2``, or a directory; default
the bundled all-MiniLM-L6-v2); its results go to their own folder (``<tag>_<name>``) and record the backbone.

    OMP_NUM_THREADS=2 python bench/sst2_full.py --quick --cells default,bitfit   # ε = 1 on a 20k subset
    OMP_NUM_THREADS=2 python bench/sst2_full.py --cells default --epsilons 1 --seeds 3
    python bench/sst2_full.py --table                                          # reprint, run nothing

On a machine with a GPU every cell runs there (privtune's default device) with micro-batches of 256 examples
(``--max-physical-batch-size``; memory and speed only), and its results go to their own folder (``full_cuda``):
docs/benchmarks.md (``python scripts/make_benchmarks.py``) shows what is kept.  ``--seed S`` runs one seed of each cell, so that several processes
can share the GPU (e.g. the default cell's three seeds at once).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import offline  # noqa: E402,F401  (sets the offline environment: bench/offline.py)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "scripts"))
from hpo import SST2, read_sst2_tsv  # noqa: E402  (bench/ is on sys.path)
from make_embedded_data import containment_violations, spans, words  # noqa: E402
from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec

RESULTS = HERE / "results" / "sst2_full"
CELLS = ("default", "bitfit", "full", "random", "oracle", "nonpriv-bitfit", "nonpriv-full", "default-no-eta-trials",
         "default-public-warm-start",
         "full-no-eta-trials", "full-batch4096", "random-full", "oracle-full",
         "default-lr0-1e-2", "fixed-bitfit", "fixed-bitfit-normalised", "fixed-bitfit-normalised-lr3e-2",
         "fixed-full", "fixed-full-lr2e-3", "fixed-full-lr2e-3-epochs3", "fixed-full-lr5e-3", "fixed-full-lr1e-2",
         "last-layer", "random-last-layer", "oracle-last-layer")
#: the fixed, uncharged DP references (one setting each, its choice not charged)
class Fixed(NamedTuple):
    mode: str
    learning_rate: float  # Adam η of the head (and of everything else unless backbone_lr_scale < 1)
    normalised: bool  # the head reads the checkpoint's L2-normalised features
    epochs: float
    backbone_lr_scale: float = 1.0  # Mehta et al.'s pre-trained-layer multiplier α: η·α outside the head
    noise: bool = True  # False: σ = 0 with clipping kept (NOT PRIVATE; isolates the noise from the recipe)
    batch_size: int = 1024  # expected Poisson batch
    train_embeddings: bool = True  # False: the backbone's input embedding table stays at its pre-trained value


FIXED = {"fixed-bitfit": Fixed("bitfit", 1e-2, False, 3.0), "fixed-bitfit-normalised": Fixed("bitfit", 1e-2, True, 3.0),
         "fixed-bitfit-normalised-lr3e-2": Fixed("bitfit", 3e-2, True, 3.0),
         # DP full fine-tuning at Li et al. (2022)'s SST-2 learning rate for Adam (5e-4 at batch 1,024); one epoch
         # (about 20 min on one thread), and larger rates and 3 epochs (about an hour): looking for where 85 % starts
         "fixed-full": Fixed("full", 5e-4, False, 1.0), "fixed-full-lr2e-3": Fixed("full", 2e-3, False, 1.0),
         "fixed-full-lr2e-3-epochs3": Fixed("full", 2e-3, False, 3.0),
         "fixed-full-lr5e-3": Fixed("full", 5e-3, False, 1.0), "fixed-full-lr1e-2": Fixed("full", 1e-2, False, 1.0),
         # the recipe of fixed-full-lr2e-3 without noise: what one epoch of 60 clipped steps can reach at all
         "clipped-full-lr2e-3": Fixed("full", 2e-3, False, 1.0, noise=False),
         # the head at DP-BiTFiT's rate (1e-2), the pre-trained weights at α·1e-2 (Mehta et al., Table 8)
         "fixed-full-alpha0.1": Fixed("full", 1e-2, False, 1.0, backbone_lr_scale=0.1),
         "fixed-full-alpha0.03": Fixed("full", 1e-2, False, 1.0, backbone_lr_scale=0.03),
         "fixed-full-alpha0.3": Fixed("full", 1e-2, False, 1.0, backbone_lr_scale=0.3),
         # the same compute (one epoch) in 4× the steps: does the step count bound DP full fine-tuning?
         "fixed-full-alpha0.1-batch256": Fixed("full", 1e-2, False, 1.0, backbone_lr_scale=0.1, batch_size=256),
         # three epochs of the best one-epoch recipe: where does 85 % start (a GPU cell: ~1.5 h per thread on a CPU)
         "fixed-full-alpha0.1-epochs3": Fixed("full", 1e-2, False, 3.0, backbone_lr_scale=0.1),
         # the same without the word-embedding table (11.7 M of MiniLM's 22.7 M weights; under noise each of its rows
         # random-walks, while a batch's signal reaches only the rows of the tokens it holds)
         "fixed-full-alpha0.1-epochs3-frozen-embeddings": Fixed("full", 1e-2, False, 3.0, backbone_lr_scale=0.1,
                                                                train_embeddings=False)}
CELLS = CELLS + tuple(c for c in FIXED if c not in CELLS)
NOT_PRIVATE = {"oracle", "oracle-full", "oracle-last-layer", "nonpriv-bitfit", "nonpriv-full", *(c for c, f in FIXED.items() if not f.noise)}
DELTA = 1e-5
RS_TRIALS, RS_LR, RS_EPOCHS = 8, (1.25e-3, 8e-2), (1, 2, 3)
GRID_LR, GRID_EPOCHS = (2.5e-3, 1e-2, 4e-2), (1, 3)
DEV_RECORDED = "GLUE SST-2 dev.tsv (in ../shared/data/sst2, or $PRIVTUNE_SST2)"
#: the backbone of every cell (``--backbone``): None is privtune's default, the bundled all-MiniLM-L6-v2
BACKBONE: dict = {"model": None}


# ----------------------------------------------------------------------------------------- data
def make_split(public_size: int, subset: int | None, folder: Path, seed: int = 0) -> dict:
    """Write train.tsv (private), public.tsv; return their paths and sizes (cached in ``folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    meta_path = folder / "split.json"
    # the files are found next to split.json (the folder may have moved: a worktree, a copy); git keeps split.json
    # and the results but not the two .tsv files (rows of SST-2, rebuilt here, the same for the same seed)
    kept = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if kept is not None and (folder / "train.tsv").exists() and (folder / "public.tsv").exists():
        return {**kept, "train": str(folder / "train.tsv"), "public": str(folder / "public.tsv"),
                "dev": str(SST2 / "dev.tsv")}
    texts, labels = read_sst2_tsv(SST2 / "train.tsv")
    dev_texts, _ = read_sst2_tsv(SST2 / "dev.tsv")
    dev_set = {t.strip() for t in dev_texts}
    rows, seen = [], set()
    for t, y in zip(texts, labels):
        t = " ".join(t.split())
        if t and t not in seen:
            seen.add(t)
            rows.append((t, y))
    # containment relation between training phrases (SST-2 holds the sub-phrases of its sentences): the public
    # phrases are those with the fewest relatives (random among ties), so removing their relatives costs little
    index = {words(t): i for i, (t, _) in enumerate(rows)}
    relatives: list[set] = [set() for _ in rows]
    for i, (t, _) in enumerate(rows):
        w = words(t)
        for sp in spans(w):
            j = index.get(sp)
            if j is not None and j != i:
                relatives[i].add(j)
                relatives[j].add(i)
    rng = random.Random(seed)
    order = [i for i, (t, _) in enumerate(rows) if len(words(t)) >= 3 and t not in dev_set]
    rng.shuffle(order)
    order.sort(key=lambda i: len(relatives[i]))  # stable: random among equal counts
    pub_idx, removed = set(), set()
    for i in order:
        if len(pub_idx) == public_size:
            break
        if i in removed:
            continue
        pub_idx.add(i)
        removed |= relatives[i]
    public = [rows[i] for i in sorted(pub_idx)]
    private = [r for i, r in enumerate(rows) if i not in pub_idx and i not in removed and r[0] not in dev_set]
    dropped = len(rows) - len(public) - len(private)
    if subset is not None:
        private = random.Random(seed + 1).sample(private, subset)
    assert not containment_violations([t for t, _ in private], [t for t, _ in public])

    def write(name, rs):
        with open(folder / name, "w", encoding="utf-8") as f:
            f.write("label\tsentence\n" + "".join(f"{y}\t{t}\n" for t, y in rs))
        return str(folder / name)

    sizes = {"n_private": len(private), "n_public": len(public), "dropped_for_disjointness": dropped,
             "source_phrases": len(rows)}
    if kept is not None and {k: kept.get(k) for k in sizes} != sizes:  # the results beside it were on another split
        raise SystemExit(f"{meta_path} records a split of {[kept.get(k) for k in sizes]} phrases, rebuilt "
                         f"{list(sizes.values())}: the results in {folder} belong to another split; move them away")
    meta = {"train": write("train.tsv", private), "public": write("public.tsv", public), "dev": str(SST2 / "dev.tsv"),
            **sizes}
    # no machine paths in what git keeps: the rows sit beside split.json, the dev set is GLUE's (found under SST2)
    meta_path.write_text(json.dumps({**meta, "train": "train.tsv", "public": "public.tsv", "dev": DEV_RECORDED},
                                    indent=2))
    return meta


# ----------------------------------------------------------------------------------------- compute count
class _Counter:
    """Examples through gradient steps, per loop (DP: ``_Loop``; non-private: counted by the caller)."""

    def __init__(self):
        self.loops: list[int] = []

    def install(self):
        from privtune import training

        orig = training._Loop._one_step
        counter = self

        def one_step(loop):
            if getattr(loop, "_bench_id", None) is None:
                loop._bench_id = len(counter.loops)
                counter.loops.append(0)
            info = orig(loop)
            counter.loops[loop._bench_id] += int(info.batch_size)
            return info

        training._Loop._one_step = one_step


COUNTER = _Counter()
#: examples per forward/backward pass, set by ``main`` (memory and speed only: the Poisson batches, the clipping and
#: the noise do not depend on it)
PHYSICAL = {"max_physical_batch_size": 32}


def _relative(final_examples: float) -> float | None:
    total = sum(COUNTER.loops)
    return round(total / final_examples, 2) if final_examples else None


# ----------------------------------------------------------------------------------------- cells
def _shared_features(cell: str) -> dict:
    """The last-layer cells share one feature cache (``bench/results/sst2_full/features/<backbone>/``, ignored by
    git): the frozen backbone's features of the private, public and dev phrases are computed by the first such cell
    and read by the others (privtune keys them by backbone, pooling and data).  These features are a deterministic
    function of the private phrases: NOT PRIVATE, kept on this machine only, never released."""
    if cell != "last-layer":
        return {}
    name = Path(BACKBONE["model"]).name if BACKBONE["model"] else "all-MiniLM-L6-v2"
    return {"feature_cache_dir": str(RESULTS / "features" / name)}


def _tune_cell(split, eps, seed, folder, **kw):
    import privtune

    if BACKBONE["model"] is not None:
        kw.setdefault("model", BACKBONE["model"])
    r = privtune.tune(split["train"], eval_data=split["dev"], public_eval_data=split["public"], labels=[0, 1],
                      epsilon=eps, delta=DELTA, ledger=f"sqlite:///{folder / 'ledger.db'}",
                      output_dir=folder / "run", seed=seed, quiet=True, **PHYSICAL, **kw)
    hp = r.metrics.get("hyperparameters") or {}
    final = COUNTER.loops[-1] if COUNTER.loops else 0
    # the grid oracle certifies nothing (NOT PRIVATE): its cell has no certificate ε
    return {"dev_accuracy": r.metrics["accuracy"],
            "certificate_epsilon": (None if r.certificate is None or r.metrics.get("not_private")
                                    else r.certificate.epsilon),
            "mode": r.metrics["mode"], "strategy": r.metrics["strategy"], "hyperparameters": hp,
            "compute_vs_final": _relative(final),
            "trials": [{"phase": t.get("phase"), "hyperparameters": t.get("hyperparameters"), "score": t.get("score")}
                       for t in r.trials]}


def _dp_model(seed, mode="bitfit", normalize_features=None, train_embeddings=True):
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier

    m = load_classifier(BACKBONE["model"], num_labels=2, seed=seed)
    apply_mode(m, mode, zero_init_head=True, normalize_features=normalize_features)
    if not train_embeddings:
        m.backbone.get_input_embeddings().weight.requires_grad_(False)
    return m


def _fixed_cell(split, eps, seed, fixed: Fixed):
    """One fixed DP setting at the full ε (its choice is not charged: a reference, not a tuned result); without
    noise (``fixed.noise`` False) the same recipe at σ = 0, NOT PRIVATE."""
    from privtune.accounting import calibrate_noise_multiplier, compute_epsilon
    from privtune.data import load_text_dataset
    from privtune.hpo.recommend import steps_for_epochs
    from privtune.training import evaluate

    train = load_text_dataset(split["train"], num_labels=2)
    n = len(train)
    q, steps = fixed.batch_size / n, steps_for_epochs(n, fixed.batch_size, fixed.epochs)
    sigma = float(calibrate_noise_multiplier(eps, DELTA, q, steps)) if fixed.noise else 0.0
    m, events = _dp_fit(train, q, steps, sigma, fixed.learning_rate, seed, mode=fixed.mode,
                        normalize_features=fixed.normalised, backbone_lr_scale=fixed.backbone_lr_scale,
                        train_embeddings=fixed.train_embeddings)
    return {"dev_accuracy": evaluate(m, load_text_dataset(split["dev"], num_labels=2))["accuracy"],
            "certificate_epsilon": compute_epsilon(events, DELTA), "compute_vs_final": 1.0,
            "hyperparameters": {"mode": fixed.mode, "learning_rate": fixed.learning_rate,
                                "backbone_lr_scale": fixed.backbone_lr_scale, "normalised_head": fixed.normalised,
                                "batch_size": fixed.batch_size, "epochs": fixed.epochs, "steps": steps,
                                "train_embeddings": fixed.train_embeddings,
                                "noise_multiplier": sigma},
            "label": ("fixed setting: its choice is NOT charged (reference only)" if fixed.noise else
                      "NOT PRIVATE: the fixed recipe without noise (σ = 0, clipping kept)")}


class _IterateAverages:
    """Two averages of a run's iterates, kept beside it to measure whether averaging would help (a
    :class:`privtune.training.LoopHook`; post-processing of the released iterates, so no privacy cost; the run
    itself is unchanged: no random numbers are drawn):

    * ``ema``: the exponential moving average with De et al. (2022)'s warm-up, weight β_t = min(0.999,
      (1 + t)/(10 + t)) on the old average after step t (an effective window of about t/9 steps);
    * ``tail``: the plain mean of the iterates after the second half of the steps (t > T/2).

    :meth:`swapped_in` evaluates the model at an average and puts the last iterate back."""

    NAMES = ("ema", "tail")

    def __init__(self, total_steps: int):
        self.total_steps, self.avg, self.tail_count = int(total_steps), {}, 0

    def before_step(self, loop, batch):
        pass

    def on_end(self, loop):
        pass

    @staticmethod
    def _params(loop):
        return [p for p in loop.module.parameters() if p.requires_grad]

    def after_step(self, loop, batch):
        import torch

        t = loop.step + 1  # the loop counts this step after its hooks ran
        params = self._params(loop)
        with torch.no_grad():
            if "ema" not in self.avg:
                self.avg["ema"] = [p.detach().clone() for p in params]
            beta = min(0.999, (1.0 + t) / (10.0 + t))
            for a, p in zip(self.avg["ema"], params):
                a.mul_(beta).add_(p.detach(), alpha=1.0 - beta)
            if 2 * t > self.total_steps:
                self.tail_count += 1
                if "tail" not in self.avg:
                    self.avg["tail"] = [p.detach().clone() for p in params]
                else:
                    for a, p in zip(self.avg["tail"], params):
                        a.add_(p.detach() - a, alpha=1.0 / self.tail_count)

    def evaluate(self, model, datasets: dict) -> dict:
        """{average: {name: accuracy}} for each dataset in ``datasets`` ({name: dataset})."""
        import torch

        from privtune.training import evaluate

        params = [p for p in model.parameters() if p.requires_grad]
        last = [p.detach().clone() for p in params]
        out = {}
        try:
            for name in self.NAMES:
                if name not in self.avg:
                    continue
                with torch.no_grad():
                    for p, a in zip(params, self.avg[name]):
                        p.copy_(a)
                out[name] = {f"{d}_accuracy": evaluate(model, ds)["accuracy"] for d, ds in datasets.items()}
        finally:
            with torch.no_grad():
                for p, v in zip(params, last):
                    p.copy_(v)
        return out


def _dp_fit(train, q, steps, sigma, lr, seed, mode="bitfit", normalize_features=None, backbone_lr_scale=1.0,
            train_embeddings=True, hooks=()):
    from privtune.training import fit

    m = _dp_model(seed, mode, normalize_features, train_embeddings)
    t0 = time.time()

    def show(info):  # a line every 10 steps: these cells run for an hour on a CPU
        if info.step % 10 == 0 or info.step == steps:
            took = time.time() - t0
            left = took / info.step * (steps - info.step)  # at this run's mean rate so far
            print(f"    step {info.step}/{steps}  {took:.0f} s, about {left / 60:.0f} min left in this run", flush=True)

    res = fit(m, train, noise=NoiseSpec(noise_multiplier=sigma, sample_rate=q, steps=steps),
              optimizer=OptimizerSpec(name="adam", learning_rate=lr, backbone_lr_scale=backbone_lr_scale),
              clipping=ClippingSpec(clip=1.0, clipping="flat"), options=LoopOptions(seed=seed, **PHYSICAL),
              callback=show, hooks=hooks)
    return m, list(res.events)


def _search_cell(split, eps, seed, points, charged: bool, folder: Path, only=None, mode="bitfit"):
    """Random search (charged: one σ for all trials, composed) or the grid oracle (each point at ε).

    Each trial is its own file ``folder/trial<i>.json`` (setting, σ, events, public and dev accuracy, seconds),
    reused when it exists: at full size a cell is 12 or 18 epochs of DP-BiTFiT, more than one CPU session, so it
    is resumable trial by trial.  Selection reads the public accuracy only; the dev accuracy of every trial is
    recorded so that the selected one's can be reported without keeping its model.  ``only`` (trial indices) lets
    several processes share one cell; the cell's result is made by whichever finds every trial done (else None).
    ``mode``: what every trial trains (``"full"``: the head at η, the pre-trained weights at the mode's α·η)."""
    from privtune.accounting import calibrate_noise_multiplier, compute_epsilon
    from privtune.accounting.events import event_from_dict, event_to_dict
    from privtune.data import load_text_dataset
    from privtune.finetune.modes import default_backbone_lr_scale
    from privtune.hpo.recommend import recommend, steps_for_epochs
    from privtune.training import evaluate

    alpha = default_backbone_lr_scale(mode)
    train = load_text_dataset(split["train"], num_labels=2)
    public = load_text_dataset(split["public"], num_labels=2)
    dev = load_text_dataset(split["dev"], num_labels=2)
    n = len(train)
    cands = [b for b in (64, 128, 256, 512, 1024, 2048, 4096) if b < n]
    b = recommend(eps, DELTA, n, 3.0, candidates=cands, min_steps=20).batch_size
    q = b / n
    steps = [steps_for_epochs(n, b, e) for _, e in points]
    sigma_all = float(calibrate_noise_multiplier(eps, DELTA, q, sum(steps))) if charged else None
    if only is not None and not only <= set(range(len(points))):
        raise SystemExit(f"--trials: this cell has trials 0 to {len(points) - 1}; got {sorted(only)}")

    def kept(i, setting):  # trial i's file, written by this or another process (None when absent)
        path = folder / f"trial{i}.json"
        if not path.exists():
            return None
        trial = json.loads(path.read_text())
        if {k: trial[k] for k in setting} != setting:
            raise SystemExit(f"{path} holds another setting than trial {i} of this cell; remove {folder}")
        return trial

    done, settings = {}, {}
    for i, ((lr, ep), T) in enumerate(zip(points, steps)):
        sigma = sigma_all if charged else float(calibrate_noise_multiplier(eps, DELTA, q, T))
        settings[i] = setting = {"learning_rate": lr, "epochs": ep, "steps": T, "batch_size": b, "sigma": sigma}
        trial = kept(i, setting)
        if trial is not None:
            print(f"    trial {i}: done before, reused", flush=True)
        elif only is not None and i not in only:
            print(f"    trial {i}: left to another process (--trials)", flush=True)
            continue
        else:
            t0 = time.time()
            averages = _IterateAverages(T)
            m, evs = _dp_fit(train, q, T, sigma, lr, seed + i, mode=mode, backbone_lr_scale=alpha, hooks=[averages])
            trial = {**setting, "public_accuracy": evaluate(m, public)["accuracy"],
                     "dev_accuracy": evaluate(m, dev)["accuracy"], "events": [event_to_dict(e) for e in evs],
                     "seconds": round(time.time() - t0, 1), "dp_examples": sum(COUNTER.loops[-1:]),
                     # the same run's iterates averaged (not what the search selects or reports; see the class)
                     "iterate_averages": averages.evaluate(m, {"public": public, "dev": dev})}
            part = folder / f"trial{i}.json.part"  # renamed when complete: another process never reads half a file
            part.write_text(json.dumps(trial, indent=2))
            os.replace(part, folder / f"trial{i}.json")
        done[i] = trial
        print(f"    trial {i} lr={lr:.3g} epochs={ep} T={T} σ={sigma:.3g}: public {trial['public_accuracy']:.4f}",
              flush=True)
    # the trials left to other processes may have finished while this one ran its own: look again, so that the
    # process that finishes last writes the cell whichever order they end in
    for i in sorted(set(settings) - set(done)):
        trial = kept(i, settings[i])
        if trial is not None:
            done[i] = trial
            print(f"    trial {i}: finished by another process meanwhile, reused", flush=True)
    if len(done) < len(points):
        return None
    trials = [done[i] for i in range(len(points))]
    best = max(trials, key=lambda t: t["public_accuracy"])  # first of equals: the search's order
    events = [event_from_dict(e) for t in trials for e in t["events"]]
    cert_eps = compute_epsilon(events, DELTA) if charged else eps
    out = {"dev_accuracy": best["dev_accuracy"], "certificate_epsilon": cert_eps, "batch_size": b, "mode": mode,
           "backbone_lr_scale": alpha,
           "selected": {k: best[k] for k in ("learning_rate", "epochs", "steps")},
           "trials": [{k: v for k, v in t.items() if k != "events"} for t in trials],
           "compute_vs_final": round(sum(steps) / best["steps"], 2),
           # the whole cell, over every session that ran a trial (the main loop would time this session only)
           "seconds": round(sum(t["seconds"] for t in trials), 1),
           "dp_examples": sum(t["dp_examples"] for t in trials)}
    if not charged:
        out["label"] = "NOT PRIVATE: each grid point is (ε, δ)-DP alone; the selection is uncharged"
    return out


def _nonprivate_cell(split, mode, seed):
    from privtune.data import load_text_dataset
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier
    from privtune.training import evaluate, fit_nonprivate

    train = load_text_dataset(split["train"], num_labels=2)
    m = load_classifier(BACKBONE["model"], num_labels=2, seed=seed)
    apply_mode(m, mode, zero_init_head=True)
    fit_nonprivate(m, train, epochs=1.0, batch_size=32, learning_rate=2e-3 if mode == "bitfit" else 5e-5, seed=seed)
    return {"dev_accuracy": evaluate(m, load_text_dataset(split["dev"], num_labels=2))["accuracy"],
            "certificate_epsilon": math.inf, "label": "NOT PRIVATE (no noise)", "compute_vs_final": 1.0}


def _public_warm_start(split, seed, folder):
    """Half of the declared-public split (a seeded shuffle) trains a NOT PRIVATE warm start, all weights, 3 epochs
    of Adam 5e-5 at batch 32; the other half is left for selection, so that no candidate is scored on phrases its
    start was fitted to.  Only public data is read: the warm start costs no ε.  Returns the split to tune with
    (its ``public`` the selection half), the warm model's folder and its dev accuracy (a public model's)."""
    from privtune.data import load_text_dataset
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier
    from privtune.training import evaluate, fit_nonprivate

    header, *rows = Path(split["public"]).read_text(encoding="utf-8").splitlines(keepends=True)
    random.Random(seed).shuffle(rows)
    halves = {"public_warm.tsv": rows[: len(rows) // 2], "public_select.tsv": rows[len(rows) // 2:]}
    for name, part in halves.items():
        (folder / name).write_text(header + "".join(part), encoding="utf-8")
    m = load_classifier(BACKBONE["model"], num_labels=2, seed=seed)
    apply_mode(m, "full", zero_init_head=True)
    fit_nonprivate(m, load_text_dataset(folder / "public_warm.tsv", num_labels=2), epochs=3.0, batch_size=32,
                   learning_rate=5e-5, seed=seed)
    m.save_pretrained(folder / "warm_model")
    dev = evaluate(m, load_text_dataset(split["dev"], num_labels=2))["accuracy"]
    print(f"    public warm start ({len(halves['public_warm.tsv'])} public phrases): dev {100 * dev:.2f} %",
          flush=True)
    return {**split, "public": str(folder / "public_select.tsv")}, folder / "warm_model", dev


def run_cell(cell, split, eps, seed, folder, epochs=None, trials=None):
    COUNTER.loops.clear()
    extra = {} if epochs is None else {"epochs": epochs}
    if cell == "default":
        return _tune_cell(split, eps, seed, folder, **extra)
    if cell in ("bitfit", "full", "last-layer"):
        return _tune_cell(split, eps, seed, folder, mode=cell, **_shared_features(cell), **extra)
    if cell == "random-last-layer":
        return _tune_cell(split, eps, seed, folder, mode="last-layer", strategy="random-search",
                          **_shared_features("last-layer"), **extra)
    if cell == "oracle-last-layer":  # NOT PRIVATE reference: tuning uncharged, no model released
        return _tune_cell(split, eps, seed, folder, mode="last-layer", strategy="grid-oracle",
                          **_shared_features("last-layer"), **extra)
    if cell == "default-no-eta-trials":  # ablation: the default without hyperfree's η-placement trials
        return _tune_cell(split, eps, seed, folder, strategy_options={"lr_trials": []}, **extra)
    if cell == "full-no-eta-trials":  # ablation: --mode full from η0 (the trials' choice isolated)
        return _tune_cell(split, eps, seed, folder, mode="full", strategy_options={"lr_trials": []}, **extra)
    if cell == "full-batch4096":  # --mode full at twice the planned batch at ε = 1 (same epochs, half the steps)
        return _tune_cell(split, eps, seed, folder, mode="full", batch_size=4096, **extra)
    if cell == "default-public-warm-start":  # experiment: the default from a warm start on half the public split
        select_split, warm, warm_dev = _public_warm_start(split, seed, folder)
        return {**_tune_cell(select_split, eps, seed, folder, model=str(warm), **extra),
                "warm_start_dev_accuracy": warm_dev}
    if cell == "default-lr0-1e-2":  # the default placing η from η0 = 1e-2 instead of the mode's 5e-3
        return _tune_cell(split, eps, seed, folder, strategy_options={"lr0": 0.01}, **extra)
    if cell in FIXED:
        return _fixed_cell(split, eps, seed, FIXED[cell])
    search_mode = "full" if cell.endswith("-full") else "bitfit"
    if cell in ("random", "random-full"):
        rng = random.Random(1000 + seed)
        points = [(math.exp(rng.uniform(*map(math.log, RS_LR))), rng.choice(RS_EPOCHS)) for _ in range(RS_TRIALS)]
        return _search_cell(split, eps, seed, points, charged=True, folder=folder, only=trials, mode=search_mode)
    if cell in ("oracle", "oracle-full"):
        return _search_cell(split, eps, seed, [(lr, e) for lr in GRID_LR for e in GRID_EPOCHS], charged=False,
                            folder=folder, only=trials, mode=search_mode)
    return _nonprivate_cell(split, "bitfit" if cell == "nonpriv-bitfit" else "full", seed)


# ----------------------------------------------------------------------------------------- table
def _cell_key(cell, eps, seed):
    return f"{cell}_eps{eps:g}_seed{seed}" if cell not in ("nonpriv-bitfit", "nonpriv-full") else f"{cell}_seed{seed}"


def table(tag_dir: Path, epsilons, cells, seeds_of) -> str:
    """The markdown table of ``cells`` × ``epsilons`` from the JSON files in ``tag_dir``.  A column with nothing
    at any ε is left out and named on a line under the table, so that the table stays readable."""
    rows = {eps: [_cell_text(tag_dir, cell, eps, seeds_of) for cell in cells] for eps in epsilons}
    shown = [i for i in range(len(cells)) if any(rows[eps][i] != "not run" for eps in epsilons)] or [0]
    lines = [f"| total ε | {' | '.join(cells[i] for i in shown)} |", "|---" * (len(shown) + 1) + "|"]
    lines += [f"| {eps:g} | " + " | ".join(rows[eps][i] for i in shown) + " |" for eps in epsilons]
    unshown = [c for i, c in enumerate(cells) if i not in shown]
    if unshown:
        lines.append(f"\nnot run at any of these ε: {', '.join(unshown)}")
    return "\n".join(lines)


def _cell_text(tag_dir: Path, cell, eps, seeds_of) -> str:
    """One cell of the table: mean ± sd of dev accuracy over the seeds that exist, a search's progress, or
    "not run"."""
    res = [json.loads(p.read_text()) for s in seeds_of(cell, eps)
           if (p := tag_dir / f"{_cell_key(cell, eps, s)}.json").exists()]
    if not res:
        done = len(list((tag_dir / "runs" / _cell_key(cell, eps, 0)).glob("trial*.json")))
        of = {"random": RS_TRIALS, "oracle": len(GRID_LR) * len(GRID_EPOCHS)}.get(cell.removesuffix("-full"))
        return f"in progress ({done}/{of} trials; rerun to resume)" if done and of else "not run"
    acc = [100 * r["dev_accuracy"] for r in res]
    spread = f" ± {statistics.stdev(acc):.1f}" if len(acc) > 1 else ""
    certified = [r["certificate_epsilon"] for r in res if r["certificate_epsilon"] is not None]
    ce = f"ε {max(certified):.3g}" if certified else "NOT PRIVATE"
    rel = res[0].get("compute_vs_final")
    return (f"{statistics.mean(acc):.1f}{spread} % (n={len(res)}; {ce}; "
            f"{statistics.mean(r['seconds'] for r in res) / 60:.1f} min; {rel}×)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="ε = 1 on a 20,000-phrase private subset")
    ap.add_argument("--epsilons", type=str, default=None, help="total ε values (default 1,3,8; --quick: 1)")
    ap.add_argument("--cells", type=str, default=",".join(CELLS), help=f"columns to run, from {','.join(CELLS)}")
    ap.add_argument("--seeds", type=int, default=None, help="seeds of the ε = 1 default cell (3; others: 1)")
    ap.add_argument("--public-size", type=int, default=2000)
    ap.add_argument("--subset", type=int, default=None, help="private phrases (default all; --quick 20000)")
    ap.add_argument("--epochs", type=float, default=None,
                    help="epochs of the tune cells (default: the strategy's, 3); a shorter measurement only")
    ap.add_argument("--trials", type=str, default=None,
                    help="random/oracle: run only these trial indices (e.g. 4,5), to share a cell between processes")
    ap.add_argument("--seed", type=int, default=None,
                    help="run only this seed of each cell (to spread the default cell's seeds over processes)")
    ap.add_argument("--max-physical-batch-size", type=int, default=None,
                    help="examples per forward/backward pass: memory and speed only (default 32 on a CPU, 256 on "
                         "a GPU)")
    ap.add_argument("--backbone", type=str, default=None,
                    help="backbone name (all-MiniLM-L6-v2, all-mpnet-base-v2) or directory; default the bundled MiniLM")
    ap.add_argument("--table", action="store_true", help="print the table of what exists; run nothing")
    args = ap.parse_args(argv)
    BACKBONE["model"] = args.backbone
    try:
        trials = None if args.trials is None else {int(t) for t in args.trials.split(",") if t.strip()}
    except ValueError:
        ap.error(f"--trials takes trial indices separated by commas, e.g. 4,5; got {args.trials!r}")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    cuda = torch.cuda.is_available()  # privtune's default device: the GPU when there is one
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    PHYSICAL["max_physical_batch_size"] = args.max_physical_batch_size or (256 if cuda else 32)
    subset = args.subset if args.subset is not None else (20_000 if args.quick else None)
    tag = "quick" if args.quick else ("full" if subset is None else f"subset{subset}")
    if args.epochs is not None:
        tag += f"_epochs{args.epochs:g}"
    if args.backbone is not None and args.backbone.strip().lower() != "all-minilm-l6-v2":
        tag += "_" + Path(args.backbone).name.lower()  # another backbone: its own table
    if cuda:  # GPU results are their own table (kept apart from the CPU's)
        tag += "_cuda"
    tag_dir = RESULTS / tag
    epsilons = [float(e) for e in (args.epsilons or ("1" if args.quick else "1,3,8")).split(",")]
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    bad = [c for c in cells if c not in CELLS]
    if bad:
        ap.error(f"unknown cell(s) {bad}; choose from {', '.join(CELLS)}")
    if trials is not None and set(cells) - {"random", "oracle", "random-full", "oracle-full"}:
        ap.error("--trials splits the search cells only; give --cells random, oracle, random-full or oracle-full")
    n_default = args.seeds or (1 if args.quick else 3)

    def seeds_of(cell, eps):
        if args.seed is not None:  # one seed asked for: that seed, whatever the cell
            return [args.seed]
        if cell == "default" and eps == 1.0:
            return list(range(n_default))
        # other cells: seed 0, and every further seed someone ran with --seed
        ran = {int(p.stem.rsplit("_seed", 1)[1]) for p in tag_dir.glob(f"{_cell_key(cell, eps, 0)[:-1]}*.json")}
        return sorted(ran | {0})

    if args.table:  # both tables, wherever this runs: the CPU one and the GPU one (``_cuda``) if it exists
        cpu_dir = RESULTS / tag.removesuffix("_cuda")
        for name, folder in (("CPU", cpu_dir), ("GPU", cpu_dir.with_name(cpu_dir.name + "_cuda"))):
            if folder.is_dir():
                print(f"{name}: {folder}\n{table(folder, epsilons, cells, seeds_of)}\n")
        return 0
    split = make_split(args.public_size, subset, tag_dir)
    log = open(tag_dir / "log.txt", "a", encoding="utf-8")

    def say(msg):
        print(msg, flush=True)
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {msg}\n")
        log.flush()

    say(f"split: {split['n_private']} private, {split['n_public']} public (containment-disjoint; "
        f"{split['dropped_for_disjointness']} dropped), dev {SST2 / 'dev.tsv'}")
    COUNTER.install()
    for eps in epsilons:
        for cell in cells:
            if cell.startswith("nonpriv") and eps != epsilons[0]:
                continue
            for seed in seeds_of(cell, eps):
                key = _cell_key(cell, eps, seed)
                path = tag_dir / f"{key}.json"
                if path.exists():
                    say(f"{key}: done before, reused")
                    continue
                folder = tag_dir / "runs" / key
                if (folder / "run").exists():  # an interrupted cell leaves a half-made run: start it afresh
                    import shutil

                    shutil.rmtree(folder)
                folder.mkdir(parents=True, exist_ok=True)
                say(f"{key}: running")
                t0 = time.time()
                res = run_cell(cell, split, eps, seed, folder, args.epochs, trials)
                if res is None:
                    say(f"{key}: trials left to another process; the process that finishes last writes the cell")
                    continue
                seconds = res.pop("seconds", None) or time.time() - t0  # a resumable cell times all its sessions
                res.update({"cell": cell, "epsilon": eps, "seed": seed, "seconds": round(seconds, 1),
                            "backbone": args.backbone or "all-MiniLM-L6-v2",
                            "n_private": split["n_private"], "not_private": cell in NOT_PRIVATE,
                            "threads": torch.get_num_threads(), "device": device, **PHYSICAL})
                res.setdefault("dp_examples", sum(COUNTER.loops))
                if res["dp_examples"]:  # DP cells: examples through DP steps per second of the whole cell
                    res["dp_examples_per_second"] = round(res["dp_examples"] / seconds, 1)
                else:
                    res.pop("dp_examples")
                path.write_text(json.dumps(res, indent=2, default=str))
                cert = res["certificate_epsilon"]
                say(f"{key}: dev {100 * res['dev_accuracy']:.2f} %, "
                    + ("NOT PRIVATE (no certificate), " if cert is None else f"certificate ε {cert:.4g}, ")
                    + f"{res['seconds'] / 60:.1f} min, compute {res.get('compute_vs_final')}× one final run"
                    + (f", {res['dp_examples_per_second']} DP examples/s" if "dp_examples_per_second" in res else ""))
    say("\n" + table(tag_dir, epsilons, cells, seeds_of))
    return 0


if __name__ == "__main__":
    sys.exit(main())
