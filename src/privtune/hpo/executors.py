"""Where the independent trials of a tuning strategy run: in this process, or as Ray tasks.

``tune(executor=...)`` / ``privtune tune --executor`` picks one of :data:`EXECUTORS`:

* ``"local"`` (default, :class:`InProcessExecutor`): every trial runs in this process, one after the other.
* ``"ray"`` (:class:`RayExecutor`): each trial is one Ray task with declared resources (``num_cpus``,
  ``num_gpus``), on a local Ray instance or the cluster at ``ray_address``.  Ray is an optional extra
  (``pip install "privtune[ray]"``).

What stays in the driver (the process that called :func:`privtune.tune`), whatever the executor: the
strategy's plan and the ledger reservation (both made before any trial starts), the draws of every trial's
hyperparameters and seeds, the scoring of each trial (its charged noise included), the private state
file that makes a run resumable, the ledger commit and everything written to RUN_DIR.  A Ray task gets a
copy of the backend (the private training features or data, which therefore travel to the cluster's
workers) and one trial's arguments, and returns the trained state and the trial's privacy events.  A task
never touches the ledger, the state file or RUN_DIR.

**A worker that dies.**  Ray re-runs a task whose worker died (``max_retries`` times) with the same
arguments, hence the same noise seeds: the retry releases exactly what the dead attempt would have
released, so it is covered by the trial's planned events, which the reservation already holds; nothing
new is reserved and the certificate lists the trial once.  The number of attempts is published nowhere
(not in log.txt, metrics or the certificate): a run on Ray publishes what the in-process run with the same
seed publishes.  When the retries are exhausted the run stops with one error; its reservation stays charged
and ``--resume`` continues it under the same reservation (docs/scaling-out.md).

Strategies call :func:`run_trials`; which executor it uses is the backend's ``executor`` attribute, which
:func:`privtune.hpo.tune` sets.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from privtune._validation import check_choice
from privtune.choices import EXECUTORS
from privtune.errors import InvalidParameterError, PrivtuneError

#: test seam: a file path; the first Ray trial task that creates it kills its own worker (os._exit), once
KILL_ONCE_ENV = "PRIVTUNE_TEST_RAY_KILL_WORKER_ONCE"
#: accepted shapes of ``ray_address`` besides "auto" and "local": HOST:PORT (the cluster's GCS) or
#: ray://HOST:PORT (Ray Client)
_ADDRESS = re.compile(r"^(?P<scheme>ray://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")


@dataclass
class TrialCall:
    """One trial as a strategy asks for it: ``backend.run(hp, **kwargs)`` (``kwargs`` holds its label)."""

    hp: dict
    kwargs: dict = field(default_factory=dict)
    #: what the strategy wants back with the result (e.g. the sampled r); never sent to the backend
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return str(self.kwargs.get("label", ""))


@dataclass
class TrialJob:
    """What one executor job runs: ``backend.run(hp, **kwargs)``, with torch's global generators seeded by
    ``torch_seed`` for the run when it is set (dropout, LoRA initialisation; see ``_resume``)."""

    hp: dict
    kwargs: dict
    torch_seed: int | None = None


class seeded_torch:
    """Seed torch's global generators (dropout, LoRA initialisation) for one run and restore them
    afterwards, so that a run is a function of its seeds alone (what an exact resume and an exact retry need)."""

    def __init__(self, seed: int):
        self.seed = int(seed)

    def __enter__(self):
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        self._fork = torch.random.fork_rng(devices=devices)
        self._fork.__enter__()
        torch.manual_seed(self.seed)
        return self

    def __exit__(self, *exc):
        return self._fork.__exit__(*exc)


def run_job(backend: Any, job: TrialJob, kill_marker: str | None = None) -> Any:
    """Run one job on ``backend`` (in this process, or inside a Ray task)."""
    if kill_marker:
        _kill_once(kill_marker)
    ctx = seeded_torch(job.torch_seed) if job.torch_seed is not None else contextlib.nullcontext()
    with ctx:
        return backend.run(job.hp, **job.kwargs)


def _kill_once(marker: str) -> None:
    """Test seam (:data:`KILL_ONCE_ENV`): the first task to create ``marker`` dies like a crashed worker."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    os._exit(1)  # no exception, no cleanup: the worker process is gone, as after an OOM kill


class Executor(abc.ABC):
    """Runs a batch of independent trial jobs on a backend and yields their results in job order."""

    #: the ``--executor`` value
    name: str = ""
    #: whether jobs run in the driver itself (per-step progress and Ctrl-C behave as without an executor)
    in_process: bool = False

    @abc.abstractmethod
    def map(self, backend: Any, jobs: Sequence[TrialJob]) -> Iterator[Any]:
        """Results of ``jobs`` (each a :class:`~privtune.hpo.backends.TrialRun`), in the order of ``jobs``."""


class InProcessExecutor(Executor):
    """The default: each job runs in this process when its result is asked for (lazily, in order), so a
    strategy's trials run exactly as its one-by-one loop ran them."""

    name = "local"
    in_process = True

    def map(self, backend: Any, jobs: Sequence[TrialJob]) -> Iterator[Any]:
        for job in jobs:
            yield run_job(backend, job)


class RayExecutor(Executor):
    """Each job is one Ray task with ``num_cpus`` CPUs and ``num_gpus`` GPUs.

    address : ``None`` (a Ray instance already initialised in this process, else Ray's own rule:
        ``$RAY_ADDRESS``, else an instance started on this machine with ``ray start``, else a new local one),
        ``"auto"`` (the running cluster this machine belongs to), ``"local"`` (a new local instance),
        ``"HOST:PORT"`` (the cluster's GCS) or ``"ray://HOST:PORT"`` (Ray Client).
    num_cpus, num_gpus : resources of each trial task (``num_gpus=None``: 1 when the trials train on CUDA,
        else 0).
    max_retries : how often Ray re-runs a task whose worker died (same arguments, same seeds).

    :meth:`connect` joins or starts Ray; :func:`privtune.tune` calls it before anything is reserved, so a bad
    address or a missing Ray costs no budget.  The Ray connection is left open for later runs in this process
    (``ray.shutdown()`` ends it; Ray ends it at exit).
    """

    name = "ray"

    def __init__(self, address: str | None = None, *, num_cpus: float = 1, num_gpus: float | None = None,
                 max_retries: int = 3):
        self.address = check_ray_address(address)
        self.num_cpus = _check_resource(num_cpus, "num_cpus")
        self.num_gpus = None if num_gpus is None else _check_resource(num_gpus, "num_gpus", low_inclusive=True)
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise InvalidParameterError(f"`max_retries` must be an integer ≥ 0. Got {max_retries!r}.")
        self.max_retries = max_retries
        self._ray = None

    def connect(self) -> None:
        """Import Ray and join/start it; one clear :class:`PrivtuneError` when that is not possible."""
        if self._ray is not None:
            return
        ray = import_ray()
        if self.address not in (None, "auto", "local"):
            _check_reachable(self.address)
        env = os.environ.get("RAY_ADDRESS", "").strip()
        if self.address in (None, "auto") and env not in ("", "auto", "local") and not ray.is_initialized():
            # Ray joins $RAY_ADDRESS then, and retries an unreachable one for many minutes: probe it first
            _check_reachable(check_ray_address(env, name="$RAY_ADDRESS"), name="$RAY_ADDRESS")
        if ray.is_initialized():
            if self.address is not None:
                raise InvalidParameterError(
                    f"`ray_address`={self.address!r}: Ray is already initialised in this process (ray.init was "
                    "called), and privtune uses that connection. Pass ray_address=None to use it, or call "
                    "ray.shutdown() first.")
        else:
            try:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError, OSError) as exc:
                raise PrivtuneError(
                    f"`ray_address`={self.address!r}: cannot connect to Ray ({_one_line(exc)}). Start the cluster "
                    "(`ray start --head`) and pass its address, e.g. --ray-address auto on one of its machines, or "
                    "leave --ray-address unset for a local Ray instance.") from None
        self._ray = ray

    def map(self, backend: Any, jobs: Sequence[TrialJob]) -> Iterator[Any]:
        if not jobs:
            return
        self.connect()
        ray = self._ray
        num_gpus = self.num_gpus
        if num_gpus is None:
            num_gpus = 1 if str(getattr(backend, "device", "") or "").startswith("cuda") else 0
        task = ray.remote(run_job).options(num_cpus=self.num_cpus, num_gpus=num_gpus, max_retries=self.max_retries,
                                           retry_exceptions=False)
        payload = copy.copy(backend)  # shallow: shares the tensors; the executor itself does not travel
        payload.__dict__.pop("executor", None)
        backend_ref = ray.put(payload)  # sent to the object store once per batch, not once per trial
        marker = os.environ.get(KILL_ONCE_ENV) or None
        refs = [task.remote(backend_ref, job, marker) for job in jobs]
        done = 0
        try:
            for job, ref in zip(jobs, refs):
                result = self._get(ref, job)
                done += 1
                if hasattr(backend, "runs"):  # the driver's count of runs, as an in-process run keeps it
                    backend.runs += 1
                yield result
        finally:
            for ref in refs[done:]:  # a failed or abandoned batch (error, Ctrl-C): stop what is still queued
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)

    def _get(self, ref: Any, job: TrialJob) -> Any:
        ray = self._ray
        label = job.kwargs.get("label") or "a trial"
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # the trial itself raised: the same error as in-process
            cause = getattr(exc, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from None
            raise
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.RaySystemError,
                ray.exceptions.OutOfMemoryError, ray.exceptions.TaskCancelledError) as exc:
            raise PrivtuneError(
                f"Ray: the task of trial {label!r} failed on every attempt ({type(exc).__name__}: a worker or node "
                f"died; {self.max_retries} retries). Every retry used the same seeds, so nothing beyond the trial's "
                "planned events was released; the ledger reservation stays charged. Fix the cluster, then "
                "`privtune tune --resume` continues this run under the same reservation.") from None


def import_ray():
    """The ``ray`` module, or one clear error saying how to install it."""
    try:
        import ray  # lazy: an optional extra, imported only when --executor ray is asked for
    except ImportError as exc:
        raise InvalidParameterError(
            f"`executor`='ray' needs Ray, which is not installed here ({_one_line(exc)}). Install it with "
            "`pip install \"privtune[ray]\"` (Ray ≥ 2.40), or use executor='local' (the default).") from None
    return ray


def check_ray_address(address: Any, name: str = "`ray_address`") -> str | None:
    """``address`` when it has one of the accepted shapes (see :class:`RayExecutor`), else one clear error
    naming where it came from (``name``)."""
    if address is None:
        return None
    text = str(address).strip() if isinstance(address, str) else None
    if text in ("auto", "local") or (text and _ADDRESS.match(text) and 0 < int(_ADDRESS.match(text)["port"]) < 65536):
        return text
    fix = ("Set it to the address of a running Ray cluster, or unset it (`unset RAY_ADDRESS`) for a local Ray "
           "instance." if name == "$RAY_ADDRESS" else "Pass e.g. --ray-address auto (the cluster this machine "
           "belongs to) or --ray-address ray://head-node:10001.")
    raise InvalidParameterError(
        f"{name} must be 'auto', 'local', HOST:PORT or ray://HOST:PORT. Got {address!r}. {fix}")


def _check_reachable(address: str, timeout: float = 5.0, name: str = "`ray_address`") -> None:
    """Fail at once when nothing listens at HOST:PORT (Ray itself retries an unreachable GCS for minutes);
    ``name`` says where the address came from (the argument or ``$RAY_ADDRESS``)."""
    m = _ADDRESS.match(address)
    host, port = m["host"].strip("[]"), int(m["port"])
    fix = ("Set $RAY_ADDRESS to the address of the Ray head node (`ray status` on it), or unset it "
           "(`unset RAY_ADDRESS`) for a local Ray instance." if name == "$RAY_ADDRESS" else
           "Check the address of the Ray head node (`ray status` on it), or leave --ray-address unset for a local "
           "Ray instance.")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise PrivtuneError(
            f"{name}={address!r}: nothing answers at {host}:{port} ({_one_line(exc)}). {fix}") from None


def _check_resource(value: Any, name: str, low_inclusive: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if low_inclusive else value > 0)
    if not ok:
        raise InvalidParameterError(f"`{name}` of each Ray trial task must be a number {'≥' if low_inclusive else '>'} "
                                    f"0. Got {value!r}.")
    return float(value)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:300] + "…") if len(text) > 300 else text or type(exc).__name__


def make_executor(executor: Any = "local", ray_address: Any = None) -> Executor:
    """The executor ``tune(executor=..., ray_address=...)`` asks for: a name from :data:`EXECUTORS` or an
    :class:`Executor` instance (e.g. ``RayExecutor("auto", num_cpus=4, num_gpus=1)``)."""
    if isinstance(executor, Executor):
        if ray_address is not None:
            raise InvalidParameterError("`ray_address` applies to executor='ray' given by name; an Executor instance "
                                        "carries its own address. Remove `ray_address`.")
        return executor
    check_choice(executor, "executor", EXECUTORS)
    if executor == "local":
        if ray_address is not None:
            raise InvalidParameterError(f"`ray_address`={ray_address!r} applies to executor='ray' only. Pass "
                                        "executor='ray' (--executor ray), or remove `ray_address`.")
        return InProcessExecutor()
    return RayExecutor(ray_address)


def run_trials(backend: Any, calls: Sequence[TrialCall],
               score: Callable[[Any, TrialCall], Any] | None = None) -> list[tuple[Any, Any]]:
    """Run independent trials through ``backend``'s executor; ``[(TrialRun, score(run, call))]`` in call order.

    ``score`` runs in this process, on each result in call order (the selection noise is drawn here, never
    in a task).  A backend wrapped by the run's journal (``_resume``) seeds, replays and records the trials
    itself; any other backend runs them on its ``executor`` (in-process when it has none).
    """
    calls = list(calls)
    batch = getattr(type(backend), "run_trials", None)
    if batch is not None:
        return batch(backend, calls, score)
    executor = getattr(backend, "executor", None) or InProcessExecutor()
    out = []
    for call, result in zip(calls, executor.map(backend, [TrialJob(c.hp, dict(c.kwargs)) for c in calls])):
        out.append((result, score(result, call) if score is not None else None))
    return out


def for_tune(executor: Any, ray_address: Any, strategy: Any) -> Executor:
    """The executor of a :func:`privtune.tune` run, checked against its strategy and connected (Ray), before
    any data is read or anything is reserved: every refusal here costs no budget."""
    ex = make_executor(executor, ray_address)
    if not ex.in_process and not getattr(strategy, "independent_trials", False):
        raise InvalidParameterError(
            f"`executor`={ex.name!r} does not apply to strategy={strategy.name!r}: it trains one run, so there are "
            "no independent trials to spread over workers. Use executor='local' (the default), or a strategy with "
            "trials (random-search, linear-scaling, grid-oracle); one training run spreads over several processes "
            "with torchrun (docs/scaling-out.md).")
    if isinstance(ex, RayExecutor):
        ex.connect()
    return ex
