"""The run pipeline: the one place where the stage order of a budget-spending command lives.

Every command that spends privacy budget (``privtune train``, ``privtune tune``, and the training run
of ``privtune audit`` on a user's data, which is a ``train``) is a :class:`Job` handed to
:func:`execute`, which runs the stages in this order::

    load → plan → prepare → reserve → run → certify → write → commit

* **load** (:func:`load`): the job's request, already validated, becomes its inputs: the splits with
  the declared label set, checked (overlaps, δ against n), and the dataset's fingerprint;
* **plan** (:func:`plan`): every event of the run, from public sizes only;
* **prepare** (:func:`prepare`): RUN_DIR checked and created, the state of an interrupted run read;
* **reserve** (:func:`reserve`): the one reservation path (:mod:`privtune.run.budget`): the ledger
  opened, a new dataset registered, a resumed run's committed entry found, the planned events
  reserved; a refusal removes what the run created.  Nothing before this stage computes on the data;
* **run** (:func:`run`): the job's training (and, for tune, its trials);
* **certify** (:func:`certify`): one certificate over the run's events, its metrics and history,
  split into what is released and the NOT PRIVATE figures;
* **write** (:func:`write`): the one RUN_DIR writer (:func:`privtune.run.release.write_release`);
* **commit** (:func:`commit`): the ledger commit, only once the release is in place, then the run's
  private files (noise seeds, checkpoints) are deleted.

What differs between jobs is what they plan and run and what they describe in the certificate; the
jobs (:class:`privtune.training.TrainJob`, :class:`privtune.hpo.tune.TuneJob`) supply those steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol, Sequence

from privtune import _release
from privtune.accounting.certificate import NEIGHBOURING
from privtune.errors import PrivtuneError
from privtune.run import budget as _budget
from privtune.run import release as _files

#: the stages, in the order :func:`execute` runs them
STAGES = ("load", "plan", "prepare", "reserve", "run", "certify", "write", "commit")


@dataclass(frozen=True)
class Budget:
    """The run's place in the ledger (:func:`reserve`)."""

    ledger: Any = None  # None: nothing reserved (a NOT PRIVATE job, or a rank of a data-parallel run but 0)
    ledger_url: str | None = None  # as published (a password masked)
    registered: bool = False  # this run registered the dataset
    reservation: Any = None  # the open reservation to commit; None: nothing to commit
    committed: Any = None  # a resumed run's committed ledger entry (its release is written again, uncharged)
    dataset_id: str | None = None  # the ledger's random id of the dataset (published, never a hash of the data)
    status: Any = None  # the dataset's ledger status before the reservation


@dataclass(frozen=True)
class Described:
    """What a job's certificate covers and says (:meth:`Job.describe`)."""

    events: list  # every event of the run, in the certificate's order
    delta: float
    accountant: str
    metadata: dict  # the certificate's metadata (never data)
    seed: int | None = None  # the user's explicit seed (the release is then marked seeded)
    #: the requested total ε: a certificate above it is an internal error and nothing is released
    epsilon_limit: float | None = None
    #: the neighbouring relation (privtune.accounting.certificate.neighbouring_relation): one example, or all
    #: rows of one privacy unit (user level)
    neighbouring: str = NEIGHBOURING


@dataclass(frozen=True)
class Released:
    """The outcome of :func:`certify`: the certificate and the release, NOT PRIVATE figures split off."""

    certificate: Any
    metrics: dict
    history: dict
    not_private: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ReleaseTarget:
    """Where and what :func:`write` and :func:`commit` release (:meth:`Job.release_target`)."""

    run_dir: Path | None  # None: nothing is written
    model: Any  # the released model (None: a NOT PRIVATE reference releases none)
    config: dict | None  # the effective options (config.yaml)
    log: Callable[[str], None]
    private_files: Sequence[Path] = ()  # deleted after the commit (noise seeds, checkpoints)
    published: Callable[[Any], Any] = lambda value: value  # plain JSON values for metrics and history


class Job(Protocol):
    """One budget-spending command, as :func:`execute` drives it.  What differs between commands lives
    here; the order of the stages, the ledger, the certificate and the files do not."""

    command: str  # "train", "tune": recorded in the ledger and config.yaml

    def load(self) -> Any:
        """The inputs: loaded and checked splits, label set, fingerprint (no budget, no computation)."""

    def plan(self, inputs: Any) -> Any:
        """Every event of the run, from public sizes only."""

    def prepare(self, inputs: Any, plan: Any) -> Any:
        """RUN_DIR checked and created, an interrupted run's state read; returns the run's files."""

    def budget_request(self, inputs: Any, plan: Any, files: Any) -> _budget.BudgetRequest | None:
        """What to reserve; None: a NOT PRIVATE job, which does not touch the ledger."""

    def open_ledger(self, inputs: Any, files: Any) -> tuple[Any, str]:
        """The ledger to charge and its published (masked) URL."""

    def before_reserving(self, inputs: Any, files: Any) -> Callable[[], None] | None:
        """Called after the ledger's checks, just before the reservation (tune writes its state file)."""

    def refused(self, files: Any) -> None:
        """The reservation was refused: remove what this run created."""

    def reserved(self, budget: Budget, inputs: Any, plan: Any, files: Any) -> None:
        """The reservation is in place (logging; a resumed, committed run checks it can be finished)."""

    def run(self, inputs: Any, plan: Any, files: Any, budget: Budget) -> Any:
        """Train (and tune); returns the outcome, whose ``events`` the certificate covers."""

    def describe(self, inputs: Any, plan: Any, files: Any, outcome: Any, budget: Budget) -> Described:
        """What the certificate covers and says."""

    def figures(self, inputs: Any, plan: Any, files: Any, outcome: Any, budget: Budget,
                certificate: Any) -> tuple[dict, dict]:
        """``(metrics, history)`` of the run (the NOT PRIVATE figures among them are split off)."""

    def release_target(self, inputs: Any, files: Any, outcome: Any) -> ReleaseTarget:
        """Where the release goes and what it holds."""

    def session(self, inputs: Any) -> ContextManager[Any]:
        """A context around the stages after load (progress display, interruption hints)."""

    def on_main(self, stage: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; in a data-parallel run on rank 0 only, its outcome shared with the other ranks."""

    def result(self, inputs: Any, plan: Any, files: Any, outcome: Any, released: Released) -> Any:
        """The command's return value."""


# ------------------------------------------------------------------------------ the stage order


def execute(job: Job) -> Any:
    """Run ``job`` through the stages, in :data:`STAGES` order; returns ``job.result(...)``."""
    inputs = load(job)
    with job.session(inputs):  # the job's result is made inside it (tune logs its last line there)
        the_plan = plan(job, inputs)
        files = prepare(job, inputs, the_plan)
        budget = job.on_main("reserve", lambda: reserve(job, inputs, the_plan, files))
        _release.fault_point("after-reserve")
        outcome = run(job, inputs, the_plan, files, budget)

        def release() -> Released:
            released = certify(job, inputs, the_plan, files, outcome, budget)
            target = job.release_target(inputs, files, outcome)
            write(job, target, released)
            commit(target, budget, outcome.events)
            return released

        released = job.on_main("release", release)
        return job.result(inputs, the_plan, files, outcome, released)


# ------------------------------------------------------------------------------ the stages


def load(job: Job) -> Any:
    """Stage 1: the job's inputs (no budget is spent; every error here costs nothing)."""
    return job.load()


def plan(job: Job, inputs: Any) -> Any:
    """Stage 2: the plan, from public sizes only."""
    return job.plan(inputs)


def prepare(job: Job, inputs: Any, plan: Any) -> Any:
    """Stage 3: RUN_DIR and the state of an interrupted run."""
    return job.on_main("prepare", lambda: job.prepare(inputs, plan))


def reserve(job: Job, inputs: Any, plan: Any, files: Any) -> Budget:
    """Stage 4, the one reservation path: open the ledger, register a new dataset, find a resumed run's
    committed entry, reserve the planned events (:func:`privtune.run.budget.reserve`).  A refusal
    removes what the run created before it is raised."""
    request = job.budget_request(inputs, plan, files)
    if request is None:
        budget = Budget()
        job.reserved(budget, inputs, plan, files)
    else:
        try:
            led, url = job.open_ledger(inputs, files)
            got = _budget.reserve(led, request, before_reserving=job.before_reserving(inputs, files))
            budget = Budget(ledger=led, ledger_url=url, registered=got.registered, reservation=got.reservation,
                            committed=got.committed, dataset_id=got.dataset_id, status=got.status)
            job.reserved(budget, inputs, plan, files)
        except PrivtuneError:
            job.refused(files)  # refused before anything was charged: leave no half-made RUN_DIR behind
            raise
    return budget


def run(job: Job, inputs: Any, plan: Any, files: Any, budget: Budget) -> Any:
    """Stage 5: the job's training, inside its reservation."""
    return job.run(inputs, plan, files, budget)


def certify(job: Job, inputs: Any, plan: Any, files: Any, outcome: Any, budget: Budget) -> Released:
    """Stage 6: one certificate over the run's events, the metrics and history, and the NOT PRIVATE
    figures split off the release (:func:`privtune.report.release.split_release`)."""
    from privtune.accounting import Certificate
    # the report package pulls in the plotting stack, which only a run that certifies needs
    from privtune.report.release import mark_seeded, split_release

    described = job.describe(inputs, plan, files, outcome, budget)
    cert = Certificate.from_events(described.events, described.delta, accountant=described.accountant,
                                   metadata=described.metadata, neighbouring=described.neighbouring)
    if described.epsilon_limit is not None and cert.epsilon > described.epsilon_limit * (1 + 1e-6):
        raise PrivtuneError(f"internal error: certificate ε = {cert.epsilon:.6g} exceeds the total "
                            f"{described.epsilon_limit:g}; nothing was released.")
    metrics, history = job.figures(inputs, plan, files, outcome, budget, cert)
    mark_seeded(cert, metrics, described.seed)
    metrics, history, not_private = split_release(metrics, history)
    return Released(certificate=cert, metrics=metrics, history=history, not_private=not_private)


def write(job: Job, target: ReleaseTarget, released: Released) -> None:
    """Stage 7: the release into RUN_DIR (:func:`privtune.run.release.write_release`: staged, certificate
    last, a copy inside ``model/``)."""
    if target.run_dir is not None:
        _files.write_release(target.run_dir, model=target.model, certificate=released.certificate,
                             metrics=target.published(released.metrics), history=target.published(released.history),
                             config=target.config, command=job.command, not_private=released.not_private,
                             log=target.log)


def commit(target: ReleaseTarget, budget: Budget, events: Sequence[Any]) -> None:
    """Stage 8: commit the run's ``events`` in the ledger (only now: a crash before leaves the reservation
    charged, never refunded, and ``--resume`` writes the release again), then delete the private files."""
    pending = budget.reservation
    if pending is not None and getattr(pending, "state", "reserved") != "reserved":
        pending = None
    _files.commit(pending, events, target.private_files)


__all__ = ["STAGES", "Budget", "Described", "Job", "ReleaseTarget", "Released", "certify", "commit", "execute",
           "load", "plan", "prepare", "reserve", "run", "write"]
