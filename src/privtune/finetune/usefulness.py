"""Whether a DP run can be expected to learn, and whether the model it released did.

Two warnings of ``privtune train`` and ``privtune tune`` (and :func:`privtune.train` / :func:`privtune.tune`):

* **before the ledger reservation** (:class:`privtune.errors.UnlikelyToLearnWarning`): DP fine-tuning of the
  backbone (``bitfit``, ``lora``, ``full``, ``two-phase``) asked for where it was measured to learn nothing,
  n·ε ≤ :data:`FINETUNE_AT_CHANCE_N_EPS`;
* **after the run** (:class:`privtune.errors.OneClassModelWarning`): the released model puts at least
  :data:`ONE_CLASS_SHARE` of its predictions on a split that is not private into one class.

Both read public quantities only: n (public by declaration: it sets q = B/n; at the unit level the number
of units N_u, never the private number of rows), ε, the mode, and the model's
predictions on the reported split (public by declaration) or on the split the user declares public, never on
the private training data.  ``--mode auto`` uses the same line to leave the fine-tuning modes out of its pilots
(:func:`backbone_cannot_learn`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence

from privtune.errors import OneClassModelWarning, UnlikelyToLearnWarning

#: n·ε (n private training examples, total ε) at or below which DP fine-tuning of the backbone is not expected
#: to learn.  Measured on SST-2 with the bundled MiniLM (majority class: 50.9 % of the 872 dev sentences):
#:
#: * n·ε = 2,000 (2,000 phrases, ε = 1): DP-BiTFiT tuned by hyperfree 52.6 ± 1.1 %, with the fixed setting of
#:   Bu et al. (DP-BiTFiT) 51.0 ± 0.1 %, 3 seeds each (docs/strategies.md, "Tuned DP-BiTFiT on 2,000 phrases",
#:   ``bench/hpo.py --bitfit``);
#: * n·ε = 3,000 (the demo's 3,000 phrases, ε = 1, seed 0): the 10-step BiTFiT and LoRA pilots scored 0.546 and
#:   0.586 on the public split against 0.662 for the DP linear probe, which reached 76.0 % dev after them and
#:   77.3 % without them (docs/training.md, "Warnings");
#: * n·ε = 4,000 (4,000 phrases, ε = 1): DP-BiTFiT 55.7 %, DP full fine-tuning 50.9 %: one class
#:   (docs/training.md "Benchmark", ``bench/sst2.py``).
#:
#: The smallest n·ε at which DP fine-tuning was measured to learn is 4× above the line: 16,000 (2,000 phrases at
#: ε = 8, DP-BiTFiT 75.9 % with the fixed setting, 67.3 % tuned), then 20,000 (20,000 phrases at ε = 1: 77.9 to
#: 81.7 %, docs/strategies.md).  Between 4,000 and 16,000 nothing was measured, so nothing is said there.
FINETUNE_AT_CHANCE_N_EPS = 4_000
#: the modes that train the backbone (every mode but last-layer)
BACKBONE_MODES = ("bitfit", "lora", "full", "two-phase")
#: a released model with at least this share of its predictions in one class on a split that is not private is
#: reported as (nearly) one class: on SST-2's dev split 95 % is 44 points above the majority class's 50.9 %
ONE_CLASS_SHARE = 0.95


def backbone_cannot_learn(mode: str, n: int, epsilon: float) -> bool:
    """True when ``mode`` trains the backbone and n·ε ≤ :data:`FINETUNE_AT_CHANCE_N_EPS` (n: private training
    examples, public by declaration; ``epsilon``: the run's total ε)."""
    return mode in BACKBONE_MODES and n * float(epsilon) <= FINETUNE_AT_CHANCE_N_EPS


def threshold_evidence(kind: str | None) -> str:
    """Where :data:`FINETUNE_AT_CHANCE_N_EPS` was measured, worded for data of ``kind`` ("text", "image")."""
    if kind == "image":
        return "on text: SST-2, MiniLM; applied to images as is, where it has not been measured"
    return "SST-2, MiniLM"


def count_phrase(n: int, unit: str | None = None) -> str:
    """How a warning names the public size: ``n = 1,000 private examples``, or at the unit level (``unit``: the
    privacy unit's name) ``n = N_u = 41 units (user_id)``: there the number of rows is private, and the count
    that sets the noise per unit is the number of units."""
    return f"n = {n:,} private examples" if unit is None else f"n = N_u = {n:,} units ({unit})"


def unlikely_to_learn_message(mode: str, n: int, epsilon: float, *, command: str, kind: str | None = None,
                              unit: str | None = None) -> str | None:
    """The pre-run warning for ``mode`` on ``n`` private examples at total ``epsilon`` (None: no warning).
    ``command`` (``"train"`` or ``"tune"``) names the command the advice is for; ``kind`` the data's kind
    (:func:`threshold_evidence`); ``unit`` the privacy unit (then ``n`` is the number of units N_u, and the
    message counts units, never rows)."""
    if not backbone_cannot_learn(mode, n, epsilon):
        return None
    return (f"mode {mode} on {count_phrase(n, unit)} at ε = {epsilon:.3g} (n·ε = {n * epsilon:,.0f}) is unlikely "
            f"to learn: DP fine-tuning of the backbone was measured at chance (a model predicting about one class) "
            f"up to n·ε = {FINETUNE_AT_CHANCE_N_EPS:,}, where the DP linear probe on cached features reached 76-77 % "
            f"({threshold_evidence(kind)}; docs/training.md). Use more data or a larger ε, or `--mode last-layer`"
            + (", or `privtune tune --mode auto`" if command == "train" else " or `--mode auto`")
            + " (which chooses last-layer here).")


def majority_prediction(counts: Sequence[int], label_names: Sequence[str] | None, split: str | None) -> dict | None:
    """The released model's most predicted class on a split that is not private, from its per-class prediction
    counts: ``{"split", "class", "share", "one_class"}`` (``share`` in [0, 1]; ``one_class`` when
    ``share`` ≥ :data:`ONE_CLASS_SHARE`).  None when nothing was predicted."""
    total = int(sum(int(c) for c in counts))
    if total == 0:
        return None
    top = max(range(len(counts)), key=lambda k: int(counts[k]))
    name = str(label_names[top]) if label_names is not None and top < len(label_names) else str(top)
    share = int(counts[top]) / total
    return {"split": split, "class": name, "share": round(share, 4), "one_class": share >= ONE_CLASS_SHARE}


def one_class_message(check: dict | None) -> str | None:
    """The post-run warning for a :func:`majority_prediction` result (None: no warning)."""
    if not check or not check["one_class"]:
        return None
    # the split by its file name: this line goes to log.txt after the release, so it names no machine path
    split = os.path.basename(str(check["split"]).rstrip("/\\")) or check["split"]
    return (f"the released model predicts class {check['class']!r} for {check['share']:.1%} of {split}: "
            "it has learnt (nearly) nothing beyond one class. Use more data or a larger ε, or `--mode last-layer` "
            "or `privtune tune --mode auto`, before relying on this model.")


def warn(message: str | None, category: type[Warning], log: Callable[[str], None] | None = None) -> None:
    """Issue ``message`` as a Python warning of ``category`` (the CLI prints it as one ``warning:`` line) and
    write it to the run's log; nothing when ``message`` is None."""
    if message is None:
        return
    if log is not None:
        log(f"warning: {message}")
    warnings.warn(message, category, stacklevel=3)


__all__ = ["FINETUNE_AT_CHANCE_N_EPS", "BACKBONE_MODES", "ONE_CLASS_SHARE", "backbone_cannot_learn",
           "unlikely_to_learn_message", "count_phrase", "majority_prediction", "one_class_message", "warn",
           "UnlikelyToLearnWarning", "OneClassModelWarning"]
