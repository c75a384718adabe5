"""``privtune tune`` on prompt → response pairs: charged trials of a causal language model, selected by
perplexity on a split declared public, through the one run pipeline (:func:`privtune.run.pipeline.execute`).

Every trial is a DP fine-tuning run (:func:`privtune.training.fit`, the one loop) with the same sampling rate q,
steps T and noise multiplier σ; σ is calibrated so that **all** trials together compose to the requested total
(ε, δ) (PLD accountant), and every trial is charged whether or not it is selected.  The selected trial's model
is the release: no further run.  Selection reads only the public split (perplexity per response token, at no
privacy cost); the reported split is scored once, after the selection.

**Public warm start.**  A public split of at least :data:`WARM_START_MIN_PUBLIC` pairs is cut in two halves (a
fixed, seeded permutation: public data): the first half fine-tunes the model without noise (LoRA,
:data:`WARM_START_EPOCHS` epochs at :data:`WARM_START_LEARNING_RATE`, merged into the weights), every trial
starts from that model, and the second half selects.  The public split is data the user declares public, so
this costs no ε.  Measured on BBC headlines (1,000 private pairs, ε = 8, the sweep's selected setting, one seed):
the warm start on 100 public pairs lowered the DP model's reported perplexity from 31.6 to 24.1 (BLEU 1.39 →
1.52, ROUGE-L 22.8 → 25.5), and the DP run on the warm-started model beat the warm-started model alone (27.1).

Strategies:

* the default (``strategy="hyperfree"``, tune's default name; the hyperfree learning-rate probe itself is not
  available for generators): a **learning-rate sweep**, the mode's default learning rate × {1/3, 1, 3}; with
  ``mode="auto"`` one trial per applicable mode at its default learning rate;
* ``"random-search"``: ``trials`` (default 6) learning rates drawn log-uniformly in [¼, 4] × the mode's
  default, the modes cycled under ``mode="auto"``.

Modes: ``lora`` (the default for causal LMs), ``full``, ``bitfit`` where the model has biases, ``auto`` among
those that apply.
"""

from __future__ import annotations

import contextlib
import math
import random
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from privtune import _release
from privtune.accounting.events import DPSGDEvent
from privtune.errors import InvalidParameterError
from privtune.run import pipeline as run_pipeline
from privtune.run import release
from privtune.run.budget import BudgetRequest

#: the strategies a generator can be tuned with (tune's default name maps to the learning-rate sweep)
GENERATION_STRATEGIES = {"hyperfree": "lr-sweep", "random-search": "random-search"}
#: the learning-rate multipliers of the sweep
SWEEP_FACTORS = (1 / 3, 1.0, 3.0)
DEFAULT_RANDOM_TRIALS = 6
DEFAULT_EPOCHS = 2.0
#: the smallest public split that is cut for a warm start (fewer pairs: all of it selects)
WARM_START_MIN_PUBLIC = 20
#: the warm start: non-private LoRA epochs over its half of the public split, and its learning rate (Adam)
WARM_START_EPOCHS = 3.0
WARM_START_LEARNING_RATE = 2e-3
#: the warm start's batch size (pairs)
WARM_START_BATCH_SIZE = 16
#: generations shown in the report, for prompts of the public split only
SHOWN_GENERATIONS = 5


@dataclass(frozen=True)
class GenerationTuneRequest:
    """:func:`privtune.hpo.tune`'s arguments that apply to a generator."""

    data: Any
    eval_data: Any = None
    public_eval_data: Any = None
    model: Any = None
    mode: str = "auto"
    strategy: str = "hyperfree"
    epsilon: float = 1.0
    delta: float | None = 1e-5
    ledger: Any = None
    output_dir: Any = None
    seed: int | None = None
    trials: int | None = None
    epochs: float | None = None
    batch_size: int | None = None
    clip: float | None = None
    max_physical_batch_size: int = 32
    max_length: int | None = None
    text_column: str | None = None
    label_column: str | None = None
    quiet: bool = False
    write_files: bool = True
    device: Any = None
    scored_rows: int | None = None  # reported rows decoded for BLEU/chrF/ROUGE-L (None: the task's default)
    privacy_unit: Any = None  # user level: the unit column (or keys, or a callable); None: one example
    max_rows_per_unit: int | None = None  # k, the public cap on one unit's rows per step (None: the default)


@dataclass(frozen=True)
class _Inputs:
    train: Any
    public: Any
    reported: Any
    model_source: Any
    modes: list
    fingerprint: str
    file_name: str | None
    demo: bool
    out: Path | None
    privacy: Any
    units: Any = None  # user level: the training rows' privtune.engine.units.UnitIndex; None: one example
    max_rows_per_unit: int | None = None
    warm_start: Any = None  # the public pairs the model is first fine-tuned on without noise; None: no warm start
    public_name: str | None = None  # the public split's name (its file), as the report states it

    @property
    def n(self) -> int:
        """The public size the plan is made from: the number of rows, or at the unit level of units N_u."""
        return len(self.train) if self.units is None else self.units.num_units

    @property
    def unit_description(self) -> dict | None:
        from privtune.engine.units import unit_description

        return None if self.units is None else unit_description(self.units, self.max_rows_per_unit)


@dataclass(frozen=True)
class _Plan:
    candidates: list  # [{"mode", "learning_rate"}] in trial order
    batch_size: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    events: list
    strategy: str


@dataclass(frozen=True)
class _Files:
    run_id: str
    log: Callable[[str], None]
    created: list = field(default_factory=list)
    fresh: list = field(default_factory=list)


@dataclass
class _Outcome:
    model: Any
    events: list
    trials: list
    selected: int
    fit: Any
    seconds: float


def _run_seed(seed: int | None) -> int:
    return int(seed) if seed is not None else secrets.randbits(62)


class GenerationTuneJob:
    """``privtune tune`` on prompt → response pairs as a :class:`privtune.run.pipeline.Job`."""

    command = "tune"

    def __init__(self, request: GenerationTuneRequest):
        self.request = request
        self._seed = _run_seed(request.seed)

    # ------------------------------------------------------------------ load
    def load(self) -> _Inputs:
        from privtune._validation import check_real
        from privtune.data.generation import EMBEDDED_CHITCHAT, embedded_chitchat
        from privtune.ledger import check_ledger_argument, dataset_identity
        from privtune.models.generator import generation_modes, load_generator
        from privtune.specs import PrivacySpec
        from privtune.tasks.generation import Generation, check_generation_disjoint

        r = self.request
        if r.strategy not in GENERATION_STRATEGIES:
            raise InvalidParameterError(
                f"`strategy` {r.strategy!r} is not available for prompt → response data. Use random-search, or leave "
                "--strategy unset (a charged learning-rate sweep).")
        check_real(r.epsilon, "epsilon", low=0.0)
        check_ledger_argument(r.ledger)
        task = Generation()
        demo = isinstance(r.data, str) and r.data == EMBEDDED_CHITCHAT
        if demo:
            train, public, test = embedded_chitchat()
            public = public if r.public_eval_data is None else None
            reported = test if r.eval_data is None else None
        else:
            train, public, reported = task.load_split(r.data, "data", text_column=r.text_column,
                                                      label_column=r.label_column), None, None
        if r.public_eval_data is not None:
            public = task.load_split(r.public_eval_data, "public_eval_data", text_column=r.text_column,
                                     label_column=r.label_column)
        if r.eval_data is not None:
            reported = task.load_split(r.eval_data, "eval_data", text_column=r.text_column, label_column=r.label_column)
        check_generation_disjoint(train, public, "public_eval_data")
        check_generation_disjoint(train, reported, "eval_data")
        units, k = self._units(train, demo)
        model_source = "smollm2-135m" if demo and r.model is None else r.model
        probe = load_generator(model_source, max_length=r.max_length)  # errors here, before any charge
        modes = generation_modes(probe) if r.mode == "auto" else [r.mode]
        from privtune.models.generator import apply_generation_mode

        apply_generation_mode(probe, modes[0])  # an inapplicable mode (bitfit without biases) fails here
        del probe
        trials = self._trial_count(len(modes))
        if trials > 1 and public is None:
            raise InvalidParameterError(
                f"Tuning a generator with {trials} trials selects by perplexity on a split you declare public: pass "
                "--public-eval-data FILE (prompt → response pairs that are not private), or --trials 1 (no selection; "
                "or use privtune train).")
        fp, file_name = dataset_identity(train)
        out = self._output_dir()
        privacy = PrivacySpec(epsilon=r.epsilon, delta=r.delta).for_dataset(len(train) if units is None
                                                                             else units.num_units)
        public_name = None if public is None else release.split_name(r.public_eval_data or public)
        warm, public = public_halves(public)
        return _Inputs(train=train, public=public, reported=reported, model_source=model_source, modes=modes,
                       fingerprint=fp, file_name=file_name, demo=demo, out=out, privacy=privacy, units=units,
                       max_rows_per_unit=k, warm_start=warm, public_name=public_name)

    def _units(self, train: Any, demo: bool) -> tuple[Any, int | None]:
        """User level: the training rows' units (δ < 1/N_u checked; a public or reported split with the unit
        column shares no unit with them) and k; ``(None, None)`` at example level.  Before any charge."""
        from privtune.engine.units import (DEFAULT_MAX_ROWS_PER_UNIT, check_max_rows_per_unit, check_unit_delta,
                                           check_units_disjoint, checked_units, load_units)

        r = self.request
        if r.privacy_unit is None:
            if r.max_rows_per_unit is not None:
                raise InvalidParameterError(
                    "`max_rows_per_unit` applies only with `privacy_unit` (user-level DP). Pass privacy_unit=COLUMN "
                    "(CLI --privacy-unit), or drop max_rows_per_unit.")
            return None, None
        k = check_max_rows_per_unit(DEFAULT_MAX_ROWS_PER_UNIT if r.max_rows_per_unit is None
                                    else r.max_rows_per_unit)
        data = train.source if demo else r.data
        units = checked_units(load_units(data, r.privacy_unit, len(train)), len(train), k, "poisson")
        if r.delta is not None:
            check_unit_delta(r.delta, units.num_units, units.name)
        for split, what in ((r.public_eval_data, "public_eval_data"), (r.eval_data, "eval_data")):
            check_units_disjoint(data, split, r.privacy_unit, what)
        return units, k

    def _trial_count(self, n_modes: int) -> int:
        from privtune._validation import check_int

        r = self.request
        if r.trials is not None:
            return check_int(r.trials, "trials", low=1)
        if GENERATION_STRATEGIES[r.strategy] == "random-search":
            return DEFAULT_RANDOM_TRIALS
        return n_modes if n_modes > 1 else len(SWEEP_FACTORS)

    def _output_dir(self) -> Path | None:
        r = self.request
        if not r.write_files:
            return None
        out = Path(r.output_dir).expanduser() if r.output_dir is not None else _release.default_run_dir()
        _release.check_output_path(out, release.RELEASED_FILES, release.RELEASED_DIRS)
        if out.exists() and (out / "certificate.json").exists():
            raise InvalidParameterError(f"`output_dir` {str(out)!r} already holds a finished run. Pass a new directory.")
        return out

    # ------------------------------------------------------------------ plan
    def plan(self, inputs: _Inputs) -> _Plan:
        from privtune.accounting import calibrate_noise_multiplier
        from privtune.hpo import common
        from privtune.models.generator import GENERATION_LEARNING_RATES

        r = self.request
        n = inputs.n  # at the unit level N_u: q = B/N_u, and batch_size counts units
        strategy = GENERATION_STRATEGIES[r.strategy]
        k = self._trial_count(len(inputs.modes))
        rng = random.Random(self._seed)
        candidates = []
        for i in range(k):
            mode = inputs.modes[i % len(inputs.modes)]
            base = GENERATION_LEARNING_RATES[mode]
            if strategy == "random-search":
                lr = base * math.exp(rng.uniform(math.log(0.25), math.log(4.0)))
            elif len(inputs.modes) > 1:
                lr = base
            else:
                lr = base * SWEEP_FACTORS[i % len(SWEEP_FACTORS)]
            candidates.append({"mode": mode, "learning_rate": lr})
        epochs = DEFAULT_EPOCHS if r.epochs is None else float(r.epochs)
        if not epochs > 0:
            raise InvalidParameterError(f"`epochs` must be > 0. Got {r.epochs!r}.")
        delta = inputs.privacy.delta
        # no batch size given: Rehn et al.'s rule, as for classifiers (measured on 1,000 BBC pairs at ε = 8, 2 epochs
        # per trial: its batch of 64 recovered 62 % and 58 % of non-private LoRA's BLEU gain in two runs, a fixed
        # 128 42 %)
        B = min(n, r.batch_size if r.batch_size is not None
                else common.recommended_schedule(r.epsilon, delta, n, epochs).batch_size)
        if B < 1:
            raise InvalidParameterError(f"`batch_size` must be ≥ 1. Got {r.batch_size!r}.")
        q = B / n
        T = max(1, math.ceil(epochs / q - 1e-9))
        sampling = "full_batch" if q == 1.0 else "poisson"
        # k identical trials compose like one run of k·T steps
        sigma = calibrate_noise_multiplier(r.epsilon, delta, sample_rate=q, steps=k * T, accountant="pld",
                                           sampling=sampling)
        events = [DPSGDEvent(sigma, q, T, sampling=sampling, label=f"trial {i + 1}/{k}: {c['mode']}")
                  for i, c in enumerate(candidates)]
        return _Plan(candidates=candidates, batch_size=B, sample_rate=q, steps=T, noise_multiplier=sigma,
                     events=events, strategy=strategy)

    # ------------------------------------------------------------------ prepare, reserve
    def prepare(self, inputs: _Inputs, plan: _Plan) -> _Files:
        created: list = []
        fresh: list = []
        out = inputs.out
        if out is not None:
            log_existed = (out / "log.txt").exists()
            created = _release.prepare_output_dir(out, release.RELEASED_FILES, release.RELEASED_DIRS)
            if not log_existed:
                fresh.append(out / "log.txt")
        # at the unit level the number of rows is private: N_u and k only, and no time (steps take time in
        # proportion to the rows their units contribute)
        log = release.run_log(out / "log.txt" if out is not None else None, timestamps=inputs.units is None)
        size = (f"N={len(inputs.train)}" if inputs.units is None else f"N_u={inputs.n} units of {inputs.units.name} "
                f"(at most {inputs.max_rows_per_unit} rows each per step)")
        log(f"start privtune tune (generation): strategy={plan.strategy} trials={len(plan.candidates)} "
            f"{size} q={plan.sample_rate:.5g} T={plan.steps} σ={plan.noise_multiplier:.5g} "
            f"total ε={self.request.epsilon:g} δ={inputs.privacy.delta:g}")
        return _Files(run_id=uuid.uuid4().hex, log=log, created=created, fresh=fresh)

    def budget_request(self, inputs: _Inputs, plan: _Plan, files: _Files) -> BudgetRequest:
        return BudgetRequest(
            fingerprint=inputs.fingerprint, total_epsilon=float(self.request.epsilon), delta=inputs.privacy.delta,
            accountant="pld", command="tune",
            config={"strategy": plan.strategy, "trials": plan.candidates,
                    "output_dir": str(inputs.out) if inputs.out else None},
            resume_key=files.run_id, events=plan.events, file_name=inputs.file_name, run_dir=inputs.out,
            privacy_unit=None if inputs.units is None else inputs.units.name)

    def open_ledger(self, inputs: _Inputs, files: _Files) -> tuple[Any, str]:
        from privtune.run.budget import open_ledger_for

        return open_ledger_for(self.request.ledger, run_dir=inputs.out, in_run_dir=inputs.demo)

    def before_reserving(self, inputs: _Inputs, files: _Files):
        return None

    def refused(self, files: _Files) -> None:
        _release.discard_unreserved(files.created, files.fresh)

    def reserved(self, budget: Any, inputs: _Inputs, plan: _Plan, files: _Files) -> None:
        if budget.registered:
            st = budget.status
            files.log(f"dataset {st.dataset_id} registered in the ledger with total ε={st.total_epsilon:.4g}, "
                      f"δ={st.delta:g}")

    # ------------------------------------------------------------------ run
    def run(self, inputs: _Inputs, plan: _Plan, files: _Files, budget: Any) -> _Outcome:
        from privtune.models.generator import apply_generation_mode, load_generator
        from privtune.tasks.generation import Generation
        from privtune.specs import ClippingSpec, LoopOptions, NoiseSpec, OptimizerSpec
        from privtune.training import fit

        r, task = self.request, Generation()
        trials, best, best_fit, best_score, t0 = [], None, None, math.inf, time.perf_counter()
        warm_weights = self._warm_start(inputs, files) if inputs.warm_start is not None else None
        for i, cand in enumerate(plan.candidates):
            model = load_generator(inputs.model_source, max_length=r.max_length)
            if warm_weights is not None:
                model.backbone.load_state_dict(warm_weights)
            apply_generation_mode(model, cand["mode"])
            noise = NoiseSpec(noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate, steps=plan.steps,
                              **({} if inputs.units is None else
                                 {"privacy_unit": inputs.units, "max_rows_per_unit": inputs.max_rows_per_unit}))
            options = LoopOptions(seed=(self._seed + 2 * i) % 2**62 if r.seed is not None else None,
                                  max_physical_batch_size=r.max_physical_batch_size)
            result = fit(model, inputs.train, noise=noise, optimizer=OptimizerSpec(learning_rate=cand["learning_rate"]),
                         clipping=ClippingSpec(clip=r.clip or 1.0), options=options, device=r.device,
                         progress=not r.quiet, task=task)
            score = (task.evaluate(model, inputs.public, generate=False)["perplexity"] if inputs.public is not None
                     else None)
            trials.append({**cand, "trial": i + 1, "public_perplexity": score,
                           "noise_multiplier": plan.noise_multiplier, "steps": plan.steps})
            files.log(f"trial {i + 1}/{len(plan.candidates)}: mode={cand['mode']} lr={cand['learning_rate']:.3g} "
                      f"public perplexity={score if score is None else round(score, 3)}")
            if best is None or (score is not None and score < best_score):
                best, best_fit, best_score = (model, result, score if score is not None else math.inf)
                selected = i
        return _Outcome(model=best, events=list(plan.events), trials=trials, selected=selected, fit=best_fit,
                        seconds=time.perf_counter() - t0)

    def _warm_start(self, inputs: _Inputs, files: _Files) -> dict:
        """The weights of the model fine-tuned without noise on the warm-start half of the public split (LoRA,
        merged): public data only, so nothing is charged."""
        from privtune.models.generator import apply_generation_mode, load_generator
        from privtune.training import fit_nonprivate

        r = self.request
        model = load_generator(inputs.model_source, max_length=r.max_length)
        apply_generation_mode(model, "lora")
        fit_nonprivate(model, inputs.warm_start, epochs=WARM_START_EPOCHS, batch_size=WARM_START_BATCH_SIZE,
                       learning_rate=WARM_START_LEARNING_RATE, seed=self._seed, device=r.device)
        files.log(f"public warm start: LoRA without noise on {len(inputs.warm_start)} public pairs (declared public: "
                  f"no privacy cost), {WARM_START_EPOCHS:g} epochs at η={WARM_START_LEARNING_RATE:g}, merged into the "
                  "weights every trial starts from")
        return model.merged_state_dict()

    # ------------------------------------------------------------------ certify
    def describe(self, inputs: _Inputs, plan: _Plan, files: _Files, outcome: _Outcome,
                 budget: Any) -> run_pipeline.Described:
        import privtune

        r = self.request
        metadata = {"command": "tune", "task": "text-generation", "strategy": plan.strategy,
                    "trials": len(plan.candidates), "selection": self._selection(inputs),
                    "hyperparameters": self._hyper(plan, outcome, inputs), "dataset_id": budget.dataset_id,
                    "run_id": files.run_id, "privtune_version": privtune.__version__,
                    "seeds": {"explicit_seed": r.seed},
                    "notes": [f"all {len(plan.candidates)} trials are charged; the selected trial's model is released"]
                    + ([f"every trial started from the model fine-tuned without noise on {len(inputs.warm_start)} "
                        "pairs of the public split (declared public: no privacy cost)"]
                       if inputs.warm_start is not None else [])}
        if inputs.units is not None:  # the unit's name, k and N_u (public)
            metadata["privacy_unit"] = inputs.unit_description
        from privtune.accounting.certificate import neighbouring_relation

        return run_pipeline.Described(events=outcome.events, delta=inputs.privacy.delta, accountant="pld",
                                      metadata=metadata, seed=r.seed, epsilon_limit=float(r.epsilon),
                                      neighbouring=neighbouring_relation(None if inputs.units is None
                                                                         else inputs.units.name))

    def _selection(self, inputs: _Inputs) -> str:
        if inputs.public is None:
            return "none (one trial)"
        if inputs.warm_start is None:
            return f"public-validation: perplexity on {inputs.public_name}"
        return (f"public-validation: perplexity on {len(inputs.public)} pairs of {inputs.public_name} (its other "
                f"{len(inputs.warm_start)} pairs warm-start the model)")

    def _hyper(self, plan: _Plan, outcome: _Outcome, inputs: _Inputs) -> dict:
        chosen = plan.candidates[outcome.selected]
        hyper = {"mode": chosen["mode"], "learning_rate": chosen["learning_rate"], "batch_size": plan.batch_size,
                 "sample_rate": plan.sample_rate, "steps": plan.steps, "noise_multiplier": plan.noise_multiplier,
                 "clip": self.request.clip or 1.0, "optimizer": "adam", "max_length": outcome.model.max_length}
        if inputs.units is not None:
            hyper["privacy_unit"] = inputs.unit_description
        if inputs.warm_start is not None:
            hyper["public_warm_start"] = {"pairs": len(inputs.warm_start), "mode": "lora, merged",
                                          "epochs": WARM_START_EPOCHS, "learning_rate": WARM_START_LEARNING_RATE,
                                          "batch_size": WARM_START_BATCH_SIZE}
        return hyper

    def figures(self, inputs: _Inputs, plan: _Plan, files: _Files, outcome: _Outcome, budget: Any,
                certificate: Any) -> tuple[dict, dict]:
        from privtune.tasks.generation import Generation

        r, task, model = self.request, Generation(), outcome.model
        metrics: dict = {"task": "text-generation", "strategy": plan.strategy, "mode": plan.candidates[
            outcome.selected]["mode"], "selection": self._selection(inputs), "trials": len(plan.candidates),
            "epsilon": float(certificate.epsilon), "delta": float(inputs.privacy.delta),
            "total_epsilon": float(r.epsilon), "hyperparameters": self._hyper(plan, outcome, inputs),
            "dataset_id": budget.dataset_id, "ledger_url": budget.ledger_url,
            "ledger_registered_new_dataset": budget.registered, "train_seconds": outcome.seconds, "accuracy": None}
        if r.strategy == "hyperfree":
            metrics["strategy_note"] = ("the hyperfree learning-rate probe is not available for generators; the "
                                        "default tunes them with a charged learning-rate sweep")
        try:
            metrics["ledger_remaining_epsilon"] = budget.ledger.status(inputs.fingerprint).remaining_epsilon
        except Exception:  # noqa: BLE001 - informative only
            metrics["ledger_remaining_epsilon"] = None
        if inputs.reported is not None:  # scored once, after the selection
            scores = task.evaluate(model, inputs.reported, scored_rows=r.scored_rows)
            metrics.update({k: scores.get(k) for k in ("perplexity", "bleu", "chrf", "rouge_l", "scored_rows")})
            metrics["reported_split"] = release.split_name(r.eval_data or inputs.reported)
            files.log(f"reported split: perplexity {scores['perplexity']:.3f}, BLEU {scores['bleu']:.2f}, "
                      f"ROUGE-L {scores['rouge_l']:.2f}")
        if inputs.public is not None:  # generations for PUBLIC prompts only: the report is shareable
            metrics["public_generations"] = {
                "split": inputs.public_name,
                "samples": task.samples(model, inputs.public, SHOWN_GENERATIONS)}
        history = {"final_run": outcome.fit.history, "trials": outcome.trials,
                   "strategy": {"name": plan.strategy, "selected_trial": outcome.selected + 1,
                                "published": f"all {len(plan.candidates)} trials"}}
        return metrics, history

    # ------------------------------------------------------------------ write, commit
    def release_target(self, inputs: _Inputs, files: _Files, outcome: _Outcome) -> run_pipeline.ReleaseTarget:
        r = self.request
        config = None
        if inputs.out is not None:
            cfg = {"data": r.data, "eval_data": r.eval_data, "public_eval_data": r.public_eval_data, "model": r.model,
                   "mode": r.mode, "strategy": r.strategy, "epsilon": r.epsilon, "delta": inputs.privacy.delta,
                   "trials": r.trials, "epochs": r.epochs, "batch_size": r.batch_size, "output": inputs.out,
                   "ledger": r.ledger if isinstance(r.ledger, str) else None, "seed": r.seed}
            if isinstance(r.privacy_unit, str):  # a unit read from a column reloads (keys passed in Python do not)
                cfg.update(privacy_unit=r.privacy_unit, max_rows_per_unit=inputs.max_rows_per_unit)
            config, _ = release.effective_config(cfg, path_keys=("data", "eval_data", "public_eval_data", "model",
                                                                 "output"))
        return run_pipeline.ReleaseTarget(run_dir=inputs.out, model=outcome.model, config=config, log=files.log)

    def session(self, inputs: _Inputs):
        return contextlib.nullcontext()

    def on_main(self, stage: str, fn: Callable[[], Any]) -> Any:
        return fn()

    def result(self, inputs: _Inputs, plan: _Plan, files: _Files, outcome: _Outcome, released: Any) -> dict:
        """The fields of :class:`privtune.hpo.tune.TuneResult` (which :func:`privtune.hpo.tune` builds)."""
        files.log(f"done: ε={released.certificate.epsilon:.4g} δ={released.certificate.delta:g}")
        return {"model": outcome.model, "certificate": released.certificate, "trials": outcome.trials,
                "metrics": released.metrics, "history": released.history, "run_dir": inputs.out}


def public_halves(public: Any) -> tuple[Any, Any]:
    """``(warm-start pairs, selection pairs)`` of a public split: two halves of a fixed seeded permutation when it
    has at least :data:`WARM_START_MIN_PUBLIC` pairs (the public split is public: its order may be fixed), else
    ``(None, public)``."""
    if public is None or len(public) < WARM_START_MIN_PUBLIC:
        return None, public
    order = list(range(len(public)))
    random.Random(0).shuffle(order)
    half = len(order) // 2
    return public.subset(sorted(order[:half])), public.subset(sorted(order[half:]))


def tune_generation(request: GenerationTuneRequest) -> dict:
    """:func:`privtune.hpo.tune` on prompt → response pairs (see the module doc); returns the fields of its
    :class:`privtune.hpo.tune.TuneResult`."""
    return run_pipeline.execute(GenerationTuneJob(request))


__all__ = ["GENERATION_STRATEGIES", "GenerationTuneJob", "GenerationTuneRequest", "public_halves", "tune_generation"]
