"""Resumable ``privtune tune`` runs: the run's seeds, the private state file, replay of completed trials.

A tune run is a deterministic function of one master seed (OS entropy unless the user gives one):
every trial, score and final run derives its seeds from it.  Completed trials are appended to a
private state file in the run directory (mode 0600) and replayed on ``--resume`` instead of being
recomputed, because re-running a trial with fresh noise would be a release nobody accounted for; the
interrupted one is recomputed with the same seeds, which reproduces the same release.  The file
holds noise seeds, so it is deleted when the run finishes.  Used by :func:`privtune.hpo.tune.tune`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from privtune.cli.config_file import save_effective_config
from privtune.errors import InvalidParameterError, PrivtuneError
from privtune.hpo import common
from privtune.hpo.backends import Backend
from privtune.hpo.common import BudgetPlan, Selector, as_plain
from privtune.hpo.executors import seeded_torch as _seeded_torch
from privtune.hpo.registry import get as get_strategy
from privtune.ledger import url_without_password
from privtune.report.progress import BATCH_LOSS_LABEL
from privtune.run.release import effective_config

# --------------------------------------------------------------------------------------
# resumable runs: the run's seeds, the private state file, replay of completed trials
# --------------------------------------------------------------------------------------

#: RUN_DIR/STATE_FILE: private state of an unfinished run (mode 0600, deleted when the run finishes)
STATE_FILE = ".tune_state.jsonl"
_STATE_VERSION = 1
#: configuration keys that do not change what a run computes (not compared on resume; a run interrupted on Ray
#: may be resumed in process and the other way round)
_NOT_COMPARED = ("quiet", "feature_cache_dir", "output", "executor", "ray_address")
#: tune() arguments that are not configuration (never written to config.yaml)
_NOT_CONFIG = ("write_files", "unknown", "resume")
_PATH_ARGS = ("data", "eval_data", "public_eval_data", "model", "feature_cache_dir", "output_dir")
#: selection source -> the user-facing name written into config.yaml
_SELECTION_FLAG = {source: flag for flag, source in common.SELECTION_SOURCE_OF.items()}


def derive_seed(master: int, *parts: Any) -> int:
    """A 62-bit seed derived from a run's master seed and a name/index (SHA-256; independent streams)."""
    import hashlib

    h = hashlib.sha256(repr((int(master),) + tuple(parts)).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") >> 2


def _effective_config(args: dict, run_dir: Path | None) -> tuple[dict, list]:
    """Every tune() argument that was set, keyed like ``privtune tune --config`` (paths as given).

    Returns (config, names of arguments that cannot be written to a file, e.g. in-memory datasets; they
    appear as a non-existent path naming the problem).
    The OS-drawn seed of a run without ``seed`` is never part of it (it is secret)."""
    out: dict = {}
    for k, v in args.items():
        if k in _NOT_CONFIG or v is None:
            continue
        key = "output" if k == "output_dir" else k
        if k == "selection":
            v = _SELECTION_FLAG.get(str(v), v)  # a source given as selection= is written as its flag
        elif k == "executor":
            v = getattr(v, "name", v)  # an Executor instance is written as its --executor name
        elif k == "strategy_options":
            v = as_plain(dict(v))
        out[key] = v
    if run_dir is not None:
        out["output"] = str(run_dir)
    return effective_config(out, path_keys=[("output" if k == "output_dir" else k) for k in _PATH_ARGS])


def _compared(cfg: dict) -> dict:
    """The part of ``cfg`` a resume must match, as stored in the state file: a ledger URL without its
    password (the state file is private, but never holds a database password either)."""
    out = json.loads(json.dumps(as_plain({k: v for k, v in cfg.items() if k not in _NOT_COMPARED}), sort_keys=True))
    if isinstance(out.get("ledger"), str):
        out["ledger"] = url_without_password(out["ledger"])
    return out


def _state_path(run_dir: Path | None) -> Path | None:
    return None if run_dir is None else Path(run_dir) / STATE_FILE


def _read_state(path: Path) -> tuple[dict, list]:
    """(header, completed call entries) of a state file; a torn last line (a crash while writing it)
    is dropped: that trial had not completed and is recomputed with the same seeds."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidParameterError(f"`resume`: cannot read the run state {str(path)!r} ({exc}).") from None
    bad = PrivtuneError(f"`resume`: the run state {str(path)!r} is damaged; this run cannot be resumed exactly. "
                        "Its ledger reservation stays charged; start a new run in a new directory.")
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("version") != _STATE_VERSION or "seed" not in header:
        raise bad
    entries: list = []
    for i, line in enumerate(lines[1:], start=1):
        try:
            entries += json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise bad from None
    return header, entries


def _write_state_lines(path: Path, objs: list, create: bool = False) -> None:
    from privtune._release import private_open

    flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else os.O_APPEND)
    fd = private_open(path, flags)  # 0600 whatever the umask: it holds the run's noise seeds
    with os.fdopen(fd, "a" if not create else "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(o) + "\n" for o in objs))
        f.flush()
        os.fsync(f.fileno())


def _check_resume_config(header: dict, cfg: dict, path: Path) -> None:
    old, new = dict(header.get("config") or {}), _compared(cfg)
    if isinstance(old.get("ledger"), str):  # a state file written before passwords were removed from it
        old["ledger"] = url_without_password(old["ledger"])
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if diff:
        shown = "; ".join(f"{k}: was {old.get(k)!r}, now {new.get(k)!r}" for k in diff[:6])
        raise InvalidParameterError(
            f"`resume`: the configuration differs from the interrupted run in {str(path.parent)!r} ({shown}). "
            f"Resume with exactly the same options, e.g. `privtune tune --resume --config "
            f"{path.parent / 'config.yaml'}`."
        )


class _Replayed:
    """The model of a trial replayed from the state file: not stored (only its score is needed).  It has no
    attributes and is not a model: a backend answers its outputs with ``_REPLAYED_OUTPUTS``, and a selector
    refuses to score those, so any use of it fails loudly instead of releasing something wrong."""

    __slots__ = ("label",)

    def __init__(self, label: str):
        self.label = label


_REPLAYED_OUTPUTS = object()


def _state_to_json(state: Any) -> dict | None:
    from privtune.hpo._heads import LinearHead

    if isinstance(state, LinearHead):
        return {"type": "linear_head", "dtype": str(state.weight.dtype).replace("torch.", ""),
                "weight": state.weight.detach().cpu().tolist(),
                "bias": None if state.bias is None else state.bias.detach().cpu().tolist()}
    return None


def _state_from_json(d: dict | None, label: str) -> Any:
    from privtune.hpo._heads import LinearHead

    if not d:
        return _Replayed(label)
    dt = getattr(torch, d["dtype"])
    return LinearHead(torch.tensor(d["weight"], dtype=dt),
                      None if d["bias"] is None else torch.tensor(d["bias"], dtype=dt))


def _plain_key(d: dict) -> dict:
    return json.loads(json.dumps(as_plain(d), sort_keys=True))


class _Journal:
    """Seeds, replay and progress of one tune() run.

    Every trial run and every selection score gets its noise seed from (master seed, call index)
    (:func:`derive_seed`), so a run is a deterministic function of its master seed.  Each completed
    trial (its run: events, history, a feature head; and its score) is appended to the private
    state file as one line, after it completes.  On resume the same calls happen in the same order:
    completed ones are answered from the file (not recomputed: re-running a trial with fresh noise
    would be an unaccounted release), the interrupted one is recomputed with the same seeds, which
    reproduces the same release (exactly on CPU).  Final runs are never stored: they are recomputed
    with their seeds.
    """

    def __init__(self, seed: int, path: Path | None, replay: list, prog, delta: float, accountant: str,
                 base_events: list):
        self.seed = int(seed)
        self.path = path
        self.replay = list(replay)
        self.pos = 0
        self.pending: list = []
        self.prog = prog
        self.delta, self.accountant = delta, accountant
        self.base_events = list(base_events)  # charged before any run (private feature centering)
        self.spent: list = []                 # events of the completed runs and scores
        self.n_run = self.n_score = self.n_trial = 0
        self.trials_expected: int | None = None
        self.show_epsilon = True
        self.replayed = 0
        #: repeat-and-select random search: per-trial progress would publish the hidden number of trials
        self.hide_trials = False
        self.config_written = False
        self.reservation = None

    def set_plan(self, plan: BudgetPlan) -> None:
        """Trial count for the display; no running ε where the accounting is not a composition of the
        runs (repeat-and-select: one event for all trials, shown when the run ends)."""
        self.trials_expected = plan.trials_expected()
        if plan.accounting == "repeat-and-select":
            self.show_epsilon = False

    # -------------------------------------------------------------- file
    def next(self, kind: str, key: dict) -> dict | None:
        if self.pos >= len(self.replay):
            return None
        e = self.replay[self.pos]
        if e.get("kind") != kind or e.get("key") != key:
            raise PrivtuneError(
                f"`resume`: the run state does not match this run at call {self.pos + 1} (stored: {e.get('kind')} "
                f"{e.get('key')}; now: {kind} {key}); the run cannot be resumed exactly. Its ledger reservation stays "
                "charged; start a new run in a new directory.")
        self.pos += 1
        return e

    def flush(self) -> None:
        if self.pending and self.path is not None:
            from privtune._release import charged_write

            with charged_write("the run's state", self.path.parent, "it continues from the last trial recorded"):
                _write_state_lines(self.path, [self.pending])
        self.pending = []

    # -------------------------------------------------------------- progress
    def epsilon(self, extra: list = ()) -> float | None:
        if not self.show_epsilon:
            return None
        evs = self.base_events + self.spent + list(extra)
        return common.epsilon_of(evs, self.delta, self.accountant) if evs else 0.0

    def report_epsilon(self) -> None:
        eps = self.epsilon()
        if eps is not None:
            self.prog.set_epsilon(eps)

    def phase_name(self, label: str) -> str:
        if "final" in label:
            return f"final run ({label})"
        if "pilot" in label:
            return label
        self.n_trial += 1
        n = f"/{self.trials_expected}" if self.trials_expected else ""
        return f"trial {self.n_trial}{n} ({label})"


class _StepProgress:
    """Per-step progress of one run: examples and loss as the run reports them, and the ε spent so
    far over the whole tune (everything completed before this run plus this run's steps so far,
    composed by the accountant), updated a few times per run."""

    def __init__(self, journal: _Journal, events_at, total: int, updates: int = 8):
        self.j, self.events_at, self.total = journal, events_at, max(1, int(total))
        self.every = max(1, self.total // updates)
        self.k = 0

    def advance(self, n: float = 1, *, examples: int | None = None, loss: float | None = None,
                epsilon: float | None = None) -> None:
        del epsilon  # the run's own ε; the display shows the tune's cumulative ε
        self.k += int(n)
        eps = None
        if self.k % self.every == 0 or self.k >= self.total:
            eps = self.j.epsilon(self.events_at(self.k))
        self.j.prog.advance(n, examples=examples, loss=loss, epsilon=eps)


def _run_events(sigma: float, q: float, k: int) -> list:
    from privtune.accounting.events import DPSGDEvent, GaussianEvent

    if k <= 0:
        return []
    return [GaussianEvent(sigma, k)] if q >= 1.0 else [DPSGDEvent(sigma, q, k)]


class _JournalBackend:
    """A :class:`~privtune.hpo.backends.Backend` whose runs are seeded from the journal, replayed when
    completed, and shown; everything else is the wrapped backend's."""

    def __init__(self, inner: Backend, journal: _Journal):
        self._inner, self._j = inner, journal

    @property
    def kind(self) -> str:
        return self._inner.kind

    @property
    def mode(self) -> str:
        return self._inner.mode

    @property
    def n(self) -> int:
        return self._inner.n

    @property
    def runs(self) -> int:
        return self._inner.runs

    @property
    def data_kind(self) -> str | None:
        return getattr(self._inner, "data_kind", None)

    @property
    def executor(self) -> Any:
        return self._inner.executor

    @property
    def device(self) -> Any:
        return self._inner.device

    def run(self, hp: dict, **kw) -> Any:
        j = self._j
        j.flush()
        label, final, index, key, name = self._begin(kw)
        if not final:
            e = j.next("run", key)
            if e is not None:
                return self._replay(e, label, name)
        kw["seed"] = derive_seed(j.seed, "run", index)
        hooks = kw.get("hooks")
        stepwise = self._inner.kind == "model" or hooks is not None  # per-step progress (a head trial: per run)
        if stepwise:
            steps = int(kw.get("steps") or 1)
            sigma, q = float(kw["noise_multiplier"]), float(kw["sample_rate"])
            events_at = hooks.events_at if hooks is not None else (lambda k: _run_events(sigma, q, k))
            j.prog.start_phase(hooks.phase if hooks is not None else name, total=steps, unit="steps",
                               work=q * self._inner.n * steps,
                               kind="features" if self._inner.kind == "features" else f"model:{self._inner.mode}",
                               loss_label=hooks.loss_label if hooks is not None else BATCH_LOSS_LABEL)
            kw["progress"] = _StepProgress(j, events_at, steps)
        try:
            with _seeded_torch(derive_seed(j.seed, "torch", index)):
                res = self._inner.run(hp, **kw)
        finally:
            if stepwise:
                j.prog.end_phase()
        self._record(res, key, final, show=not stepwise)
        return res

    def run_trials(self, calls: list, score) -> list:
        """A batch of independent trials (:func:`privtune.hpo.executors.run_trials`), each followed by its
        score in call order.  In process: exactly :meth:`run` then ``score`` per trial.  On a remote executor
        (Ray): the completed trials of an interrupted run are replayed first, the others are seeded here, in
        call order (the same run indices, hence the same seeds, as in process), run as one batch of tasks, and
        recorded and scored here as their results come back, in call order (one state-file line per trial)."""
        from privtune.hpo.executors import TrialJob

        executor = self._inner.executor
        out: list = []
        if executor is None or executor.in_process:
            for call in calls:
                res = self.run(call.hp, **call.kwargs)
                out.append((res, score(res, call) if score is not None else None))
            return out
        j = self._j
        j.flush()
        out = [None] * len(calls)
        todo = []  # (position, call, key, final, job)
        for pos, call in enumerate(calls):
            kw = dict(call.kwargs)
            label, final, index, key, name = self._begin(kw)
            e = None if final or todo else j.next("run", key)  # the state file holds completed trials in order
            if e is not None:
                res = self._replay(e, label, name)
                out[pos] = (res, score(res, call) if score is not None else None)
                continue
            kw["seed"] = derive_seed(j.seed, "run", index)
            kw.pop("progress", None)  # per-step progress cannot leave a task; shown per trial instead
            todo.append((pos, call, key, final, TrialJob(call.hp, kw, derive_seed(j.seed, "torch", index))))
        results = executor.map(self._inner, [t[4] for t in todo])
        for (pos, call, key, final, _), res in zip(todo, results):
            self._record(res, key, final, show=True)
            out[pos] = (res, score(res, call) if score is not None else None)
        return out

    def _begin(self, kw: dict) -> tuple:
        """(label, final?, run index, replay key, display name) of the next run, in call order."""
        j = self._j
        label = str(kw.get("label", ""))
        index = j.n_run
        j.n_run += 1
        key = _plain_key({"label": label, "steps": kw.get("steps"), "sample_rate": kw.get("sample_rate"),
                          "noise_multiplier": kw.get("noise_multiplier"),
                          "learning_rate": kw.get("learning_rate")})
        return label, "final" in label, index, key, j.phase_name(label)

    def _replay(self, e: dict, label: str, name: str) -> Any:
        from privtune.accounting.events import event_from_dict
        from privtune.hpo.backends import TrialRun

        j = self._j
        j.replayed += 1
        events = [event_from_dict(d) for d in e["events"]]
        j.spent += events
        if not j.hide_trials:
            j.prog.log(f"{name}: completed before the interruption; replayed from the run state, not recomputed")
        return TrialRun(state=_state_from_json(e.get("state"), label), events=events, history=e.get("history") or {})

    def _record(self, res: Any, key: dict, final: bool, show: bool) -> None:
        """Charge a completed run to the display and queue it for the state file (final runs are not stored)."""
        from privtune.accounting.events import event_to_dict

        j = self._j
        j.spent += list(res.events)
        if not final:
            j.pending.append({"kind": "run", "key": key, "events": [event_to_dict(e) for e in res.events],
                              "history": as_plain(res.history or {}), "state": _state_to_json(res.state)})
        else:
            j.report_epsilon()
        if show and j.prog.phase is not None and not j.hide_trials:
            j.prog.advance(1)

    def logits(self, state: Any, data: Any) -> Any:
        if isinstance(state, _Replayed):
            return _REPLAYED_OUTPUTS
        if getattr(self._inner, "kind", "") != "model":
            return self._inner.logits(state, data)
        t0 = time.monotonic()  # a score's forward passes: planned work of the time-left estimate, done now
        out = self._inner.logits(state, data)
        # the rows as published (a declared public size): the estimate is printed and logged
        rows = getattr(data, "public_size", None)
        self._j.prog.record_work("predict", len(data) if rows is None else int(rows), time.monotonic() - t0)
        return out

    def predict(self, state: Any, data: Any) -> Any:
        if isinstance(state, _Replayed):
            return _REPLAYED_OUTPUTS
        return self._inner.predict(state, data)


class _JournalSelector:
    """A :class:`~privtune.hpo.common.Scorer` whose charged noise is seeded from (master seed, score index) and
    whose completed scores are replayed on resume (never drawn twice); everything else is the wrapped
    :class:`~privtune.hpo.common.Selector`'s."""

    def __init__(self, inner: Selector, journal: _Journal):
        self._inner, self._j = inner, journal

    @property
    def source(self) -> str:
        return self._inner.source

    @property
    def data(self) -> Any:
        return self._inner.data

    @property
    def labels(self) -> torch.Tensor:
        return self._inner.labels

    @property
    def charged(self) -> bool:
        return self._inner.charged

    def tie_margin(self, score: float) -> float:
        return self._inner.tie_margin(score)

    def score_event(self, label: str = "") -> Any:
        return self._inner.score_event(label)

    def score(self, outputs: Any, label: str = "") -> tuple[float, list]:
        import dataclasses

        from privtune.accounting.events import event_from_dict, event_to_dict

        j = self._j
        index = j.n_score
        j.n_score += 1
        key = _plain_key({"label": label, "source": self._inner.source})
        e = j.next("score", key)
        if e is not None:
            events = [event_from_dict(d) for d in e["events"]]
            j.spent += events
            j.report_epsilon()
            return e["score"], events
        if outputs is _REPLAYED_OUTPUTS:
            raise PrivtuneError(f"`resume`: the run state holds trial {label!r} without its score; it cannot be "
                                "resumed exactly. Its ledger reservation stays charged; start a new run.")
        sel = dataclasses.replace(self._inner, seed=derive_seed(j.seed, "score", index))
        score, events = sel.score(outputs, label=label)
        j.spent += list(events)
        j.pending.append({"kind": "score", "key": key, "score": score,
                          "events": [event_to_dict(e) for e in events]})
        j.flush()
        j.report_epsilon()
        return score, events


def _journaled(obj: Any, kw: dict) -> Any:
    """Wrap a backend or selector in the run's journal (when there is one); a backend also gets the run's
    trial executor (``kw["executor"]``)."""
    if obj is not None and not isinstance(obj, Selector) and kw.get("executor") is not None:
        obj.executor = kw["executor"]  # where its independent trials run (hpo.executors.run_trials)
    j = kw.get("journal")
    if j is None or obj is None:
        return obj
    if isinstance(obj, Selector):
        return _JournalSelector(obj, j)
    return _JournalBackend(obj, j)


def _resume_hint(run_dir: Path | None, config_written: bool) -> str:
    if run_dir is None:
        return ("interrupted: the ledger reservation stays charged (the run may have read data); a run without "
                "files (write_files=False) cannot be resumed.")
    how = (f"privtune tune --resume --config {run_dir / 'config.yaml'}" if config_written
           else f"privtune tune --resume --output {run_dir} ... (the same options as before)")
    return (f"interrupted: the ledger reservation stays charged (the run may have read data). Continue this run "
            f"exactly, without a new charge, with:\n  {how}\n(Python: privtune.tune(..., output_dir={str(run_dir)!r}, "
            "resume=True)). Completed trials are replayed from RUN_DIR/" + STATE_FILE + ", not recomputed.")


def _resume_state(resume: bool, run_dir: Path | None, output_dir: Any, strategy: str, cfg: dict,
                  fingerprint: str) -> tuple[dict | None, list]:
    """Check ``resume`` against RUN_DIR before anything is charged; (header, completed calls) or (None, [])."""
    path = _state_path(run_dir)
    if not resume:
        if path is not None and path.exists():
            raise InvalidParameterError(
                f"`output` {str(run_dir)!r} holds an interrupted run ({STATE_FILE}). Pass resume=True (--resume) "
                f"with the same options to continue it (`privtune tune --resume --config {run_dir / 'config.yaml'}`), "
                "or a new directory.")
        return None, []
    if run_dir is None or output_dir is None:
        raise InvalidParameterError("`resume=True` needs `output_dir` (--output): the RUN_DIR of the interrupted run.")
    if get_strategy(strategy).not_private:
        raise InvalidParameterError(
            f"`resume` is not available for strategy={strategy!r}: it is NOT PRIVATE, reserves no budget and releases "
            "nothing, so there is nothing to continue. Rerun it in a new directory.")
    if not path.is_file():
        raise InvalidParameterError(
            f"`resume`: no interrupted run in {str(run_dir)!r} (no {STATE_FILE}; a finished run deletes it). Run "
            "without --resume to start a new run, or pass the --output of an interrupted one.")
    header, entries = _read_state(path)
    _check_resume_config(header, cfg, path)
    if header.get("fingerprint") != fingerprint:
        raise InvalidParameterError(
            f"`resume`: the training data differs from the interrupted run in {str(run_dir)!r} (its content "
            "fingerprint differs). Resume with the same data.")
    return header, entries


def _write_state_header(run_dir: Path | None, run_id: str, run_seed: int, fingerprint: str, cfg: dict) -> Path | None:
    """Create the private state file of a new run, before its ledger reservation: a run killed at any point
    after the reservation can then be resumed under it (and a refused reservation removes the file)."""
    path = _state_path(run_dir)
    if path is not None:
        _write_state_lines(path, [{"version": _STATE_VERSION, "run_id": run_id, "seed": int(run_seed),
                                   "fingerprint": fingerprint, "config": _compared(cfg),
                                   "note": "PRIVATE: noise seeds of an unfinished privtune tune run; deleted when "
                                           "the run finishes. Do not share."}], create=True)
    return path


def _open_journal(run_dir, header, entries, run_seed, run_id, cfg, unsaved, fingerprint, prog, delta, accountant,
                  base_events, reservation) -> _Journal:
    """After the reservation: create the private state file (first run, unless it exists) or load it (resume)."""
    path = _state_path(run_dir)
    if header is None and path is not None and not path.exists():
        _write_state_header(run_dir, run_id, run_seed, fingerprint, cfg)
    journal = _Journal(run_seed, path, entries, prog, delta, accountant, base_events)
    journal.reservation = reservation
    if path is not None:
        try:
            save_effective_config(cfg, run_dir, command="tune")
            journal.config_written = not unsaved
        except Exception as exc:  # informative; the run does not depend on it
            prog.log(f"warning: config.yaml not written ({type(exc).__name__}: {exc})")
    if header is not None:
        n = sum(1 for e in entries if e.get("kind") == "score")
        # random search may run under repeat-and-select, whose number of trials must not be published
        done = "the completed trials" if cfg.get("strategy") == "random-search" else f"{n} completed trial(s)"
        prog.log(f"resume: continuing ledger reservation {getattr(reservation, 'entry_id', '?')} "
                 f"({'resumed' if getattr(reservation, 'resumed', False) else 'NEW'}); {done} "
                 "will be replayed from the run state, the interrupted one recomputed with the same seeds")
        # a new reservation is right only when the interrupted run never got one (nothing completed under it)
        if not getattr(reservation, "resumed", True) and entries:  # pragma: no cover - checked before reserving
            raise PrivtuneError("internal error: a resumed run opened a new ledger reservation (it stays charged); "
                                "stopping before any data is read.")
    return journal


def _label_curves(final_run: dict, public: bool) -> None:
    """Say which split the accuracy curve is on (the PUBLIC validation split only) or why there is none."""
    if final_run.get("eval"):
        final_run["eval_split"] = "public validation split (declared public by the user; no privacy cost)"
    elif not public:
        final_run["eval_note"] = ("no accuracy curve: it needs a validation split declared public "
                                  "(--public-eval-data); evaluating private data would spend budget, and the "
                                  "reported split is never looked at before the model is final")
