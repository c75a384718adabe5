"""The names a user chooses among, declared once, importing nothing.

The YAML schema (:mod:`privtune.cli.config_file`) and the command line read their choices and
the defaults their help shows from here, so that ``privtune tune --help`` (``train``, ``predict``, ``audit``, ``budget``) and
``privtune config check`` do not import torch, SciPy or the tuning stack.  The modules that implement each choice
import its tuple from here (``privtune.optim.OPTIMIZERS`` is this module's ``OPTIMIZERS``), and
``tests/test_choices.py`` checks that each implementation covers exactly these names.
"""

from __future__ import annotations

#: privacy accountants (privtune.accounting.accountant)
ACCOUNTANTS = ("pld", "rdp")
#: how batches are drawn (privtune.accounting.events)
SAMPLING_SCHEMES = ("poisson", "shuffle", "full_batch")
#: clipping rules: flat (Abadi, min(1, C/||g||)) or automatic (AUTO-S) (privtune.engine.private_gradient)
CLIPPINGS = ("flat", "automatic")
#: optimizers applied to the privatised gradient (privtune.optim)
OPTIMIZERS = ("sgd", "adam", "adamw", "lamb")
#: what ``train`` can train (privtune.finetune.modes)
TRAIN_MODES = ("full", "bitfit", "last-layer", "lora", "two-phase")
#: the fine-tuning modes ``tune`` can train (TRAIN_MODES without two-phase; privtune.hpo.common)
TUNABLE_MODES = ("last-layer", "bitfit", "lora", "full")
#: ``tune(mode=...)``: a tunable mode, or "auto" (privtune.hpo.tune)
TUNE_MODES = ("auto", *TUNABLE_MODES)
#: tuning strategies, in the order of ``--strategy``'s choices and of the docs (privtune.hpo.registry)
STRATEGIES = ("linear-scaling", "hyperfree", "single-step", "random-search", "grid-oracle")
#: causal language models known by name (privtune.models.causal_lm.KNOWN_CAUSAL_LMS): ``--model NAME`` makes a
#: run a generation run, whatever its data's column names
CAUSAL_LM_NAMES = ("smollm2-135m",)
#: how ``tune`` scores trials (privtune.hpo.common.SELECTION_SOURCE_OF maps each to its score source)
SELECTIONS = ("public-validation", "private-validation", "train-accuracy", "train-loss")
#: where independent trials run (privtune.hpo.executors)
EXECUTORS = ("local", "ray")
#: what DP training does with a vision backbone's BatchNorm layers (privtune.models.vision): keep them in eval mode
#: (the pretrained running statistics) or replace each with a GroupNorm; train mode is refused
#: (BATCHNORM_TRAIN_REFUSAL)
BATCHNORM_POLICIES = ("eval", "group")
#: why ``batchnorm="train"`` is refused, in the one error every entry point gives
BATCHNORM_TRAIN_REFUSAL = (
    "BatchNorm in train mode normalises each example by the statistics of its batch, so one example changes "
    "every other example's output: per-example gradients, and so differential privacy, do not exist. Use eval "
    "(the default: the pretrained running statistics, a fixed map per example) or group (a GroupNorm in place "
    "of each BatchNorm).")
#: what a vision backbone gives its head (privtune.models.vision): its final pooled features, or those
#: with the mean-pooled output of each of its stages, each L2-normalised, concatenated
IMAGE_FEATURES = ("final", "stages")
#: ``image_size``: the input resolution in pixels (square), smallest and largest accepted
IMAGE_SIZE_BOUNDS = (8, 4096)
#: how a text classifier pools its token states into one vector (privtune.models.classifier)
POOLING_CHOICES = ("auto", "mean", "cls", "model")
#: ``recommend(prefer=...)``: the smallest batch on the noise plateau (the paper's rule) or the largest batch
#: with at least min_steps steps (privtune.hpo.recommend)
PREFERENCES = ("smallest", "cap")

#: the defaults of ``privtune.tune`` that ``privtune tune --help`` shows (tests/test_choices.py checks that
#: they are tune()'s own)
TUNE_DEFAULTS = {"mode": "auto", "strategy": "hyperfree", "epsilon": 1.0, "delta": 1e-5, "executor": "local"}
#: the defaults of ``privtune.train`` that ``privtune train --help`` shows (checked like TUNE_DEFAULTS)
TRAIN_DEFAULTS = {"accountant": "pld", "clip": 1.0, "clipping": "flat", "max_physical_batch_size": 32,
                  "max_rows_per_unit": 8, "optimizer": "adam", "pooling": "auto", "sampling": "poisson"}
#: the defaults ``privtune budget --help`` shows: a new dataset's accountant (``Ledger.init_dataset``) and the
#: sampling of a recorded external run (``DPSGDEvent``) (checked like TUNE_DEFAULTS)
BUDGET_DEFAULTS = {"accountant": "pld", "sampling": "poisson"}
#: the defaults ``privtune account --help`` shows: the accountant of ``privtune.accounting.account`` and the sampling
#: of a ``DPSGDEvent`` (checked like TUNE_DEFAULTS)
ACCOUNT_DEFAULTS = {"accountant": "pld", "sampling": "poisson"}
#: the defaults of ``privtune.recommend`` that ``privtune recommend`` uses (checked like TUNE_DEFAULTS)
RECOMMEND_DEFAULTS = {"min_steps": 20, "plateau_tol": 0.10, "prefer": "smallest"}

__all__ = [
    "ACCOUNTANTS", "SAMPLING_SCHEMES", "CLIPPINGS", "OPTIMIZERS", "TRAIN_MODES", "TUNABLE_MODES", "TUNE_MODES",
    "STRATEGIES", "SELECTIONS", "EXECUTORS", "PREFERENCES", "TUNE_DEFAULTS", "TRAIN_DEFAULTS", "RECOMMEND_DEFAULTS",
    "BUDGET_DEFAULTS", "ACCOUNT_DEFAULTS",
    "POOLING_CHOICES",
    "BATCHNORM_POLICIES", "BATCHNORM_TRAIN_REFUSAL", "IMAGE_FEATURES", "IMAGE_SIZE_BOUNDS",
]
