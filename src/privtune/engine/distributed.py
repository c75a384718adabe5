"""Data-parallel DP training over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

:func:`current` describes the process group a run is part of (``None`` for one process); the one training
loop (:class:`privtune.training._Loop`) uses it in three places and nowhere else:

* **Sampling.** Every rank holds the same sampler (same seed: rank 0 draws a secret one and broadcasts it
  when the run has no explicit seed), so every rank draws the same *global* Poisson batch of the whole
  data set at the global rate q; rank r owns the examples i with i mod W = r and trains on the ones of
  the batch it owns (:meth:`ProcessGroup.partition`).  The union over ranks is exactly that global batch,
  so the batches are exactly Poisson samples of the whole set, as the accounting assumes, and the same as
  a one-process run's with the same seed.  Drawing N uniforms per step costs every rank as much as it costs
  one process (negligible next to a forward pass) and needs no communication.  Because a rank only ever
  sees its own examples, last-layer training caches the features of those only (:meth:`owned`).
* **Noise.** Each rank clips its own examples; the clipped sums are all-reduced (SUM) and Gaussian noise
  N(0, σ²C²) is added exactly once per logical batch, by rank 0 before the reduction, in
  :func:`privtune.engine.mechanisms.privatise_sum` (still the only place noise reaches a gradient);
  the divisor is the global expected batch size q·N.  Per-example norms never leave their rank.
* **State.** Parameters start from rank 0's (:meth:`ProcessGroup.broadcast_module_`); every rank then
  applies the same released gradient, so the replicas stay equal.

:func:`privtune.train` additionally lets only rank 0 touch ``RUN_DIR``, the ledger and the certificate
(:meth:`ProcessGroup.on_main` shares rank 0's outcome, or its error, with every rank).  Accounting is that
of one process: the events depend only on (σ, q, T).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from privtune.errors import PrivtuneError

if dist.is_available():
    # torch.distributed.nn.functional binds ``group.WORLD`` as the default argument of its collectives when it
    # is imported.  Imported after a process group exists (transformers' model loading imports it through
    # torch.distributed._shard), those defaults pin the default group: destroy_process_group() can then not
    # free it, and its gloo backend is torn down during interpreter exit instead, racing the other ranks'
    # exit (seen as an occasional SIGABRT of a rank after a successful `torchrun ... privtune train`).
    # Imported here, before any group exists, the defaults are None.
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:  # a torch build without it: nothing binds the group
        pass

__all__ = ["ProcessGroup", "current", "is_main_process", "launched_by_torchrun", "shutdown", "DistributedError"]

#: what torchrun (torch.distributed.run) sets in every worker's environment
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(PrivtuneError):
    """The processes of a data-parallel run disagree (different data or plan) or cannot form a group."""


def launched_by_torchrun() -> bool:
    """True when the environment names a process group of more than one process (torchrun sets
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``)."""
    if not all(os.environ.get(k) for k in TORCHRUN_ENV):
        return False
    try:
        return int(os.environ["WORLD_SIZE"]) > 1
    except ValueError:
        return False


@dataclass(frozen=True)
class ProcessGroup:
    """This process's place in a data-parallel run (the default ``torch.distributed`` group).

    Attributes:
        rank: 0 ≤ rank < world_size; rank 0 adds the noise and writes every file.
        world_size: number of processes W ≥ 2.
        local_rank: index of this process on its machine (selects ``cuda:local_rank`` under NCCL).
        backend: ``"gloo"`` or ``"nccl"`` (what the group was initialised with).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that adds noise and writes files."""
        return self.rank == 0

    @property
    def adds_noise(self) -> bool:
        """True on the one rank that adds N(0, σ²C²) to the all-reduced clipped sum."""
        return self.rank == 0

    def local_device(self, device: torch.device) -> torch.device:
        """``device`` for this rank: a CUDA device without an index becomes ``cuda:local_rank``."""
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", self.local_rank)
        return device

    # ------------------------------------------------------------------ collectives
    def partition(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's share of a global batch of example indices: those it owns (i mod W = rank)."""
        return batch[batch % self.world_size == self.rank]

    def owned(self, num_examples: int) -> torch.Tensor:
        """The indices of the examples this rank owns: rank, rank + W, rank + 2W, ... below ``num_examples``."""
        return torch.arange(self.rank, int(num_examples), self.world_size)

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum ``tensors`` over all ranks, in place, with one all-reduce per (dtype, device)."""
        groups: dict = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for (_, device), same in groups.items():
            flat = torch.cat([t.reshape(-1) for t in same])
            if self.backend == "nccl" and device.type == "cpu":  # NCCL reduces CUDA tensors only
                flat = flat.to(torch.device("cuda", self.local_rank))
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; for small control data and checkpoint states)."""
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    @torch.no_grad()
    def broadcast_module_(self, module: torch.nn.Module) -> None:
        """Copy rank 0's parameters and buffers into ``module`` on every rank (in place)."""
        for t in list(module.parameters()) + list(module.buffers()):
            if t.device.type == "cpu" or self.backend == "nccl":
                dist.broadcast(t.data, src=0)
            else:  # gloo without CUDA support: go through the CPU
                host = t.data.cpu()
                dist.broadcast(host, src=0)
                t.data.copy_(host)

    def agree(self, what: str, value: Any, describe: Callable[[Any], str] = repr) -> None:
        """Raise the same :class:`DistributedError` on every rank unless every rank passed an equal ``value``.

        ``describe`` turns a value into the text of the error (it must not print private data)."""
        values = self.all_gather(value)
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            mine, theirs = describe(values[0]), describe(values[differ[0]])
            how = (f"rank 0 has {mine}, rank {differ[0]} has {theirs}" if mine != theirs else
                   f"rank 0 and rank {differ[0]} both have {mine} but differ in what is not shown (the data's rows)")
            raise DistributedError(
                f"The processes of this data-parallel run disagree on {what}: {how}. Start every process with the "
                "same arguments and the same data files (torchrun passes the same command line to every process)."
            )

    def on_main(self, fn: Callable[[], Any], share: Callable[[Any], Any] = lambda result: result) -> Any:
        """Run ``fn`` on rank 0 only; return its result there and ``share(result)`` on the other ranks.

        An error in ``fn`` is raised on every rank, with rank 0's message, so no rank waits for a rank that
        failed (only :class:`PrivtuneError` keeps its type; anything else becomes a DistributedError)."""
        if self.is_main:
            try:
                result = fn()
            except PrivtuneError as exc:
                self.broadcast(("error", type(exc), str(exc)))
                raise
            except BaseException as exc:
                self.broadcast(("error", DistributedError,
                                f"rank 0 failed ({type(exc).__name__}: {exc}); see its output"))
                raise
            self.broadcast(("ok", share(result)))
            return result
        outcome = self.broadcast(None)
        if outcome[0] == "error":
            _, kind, message = outcome
            raise (kind if isinstance(kind, type) and issubclass(kind, PrivtuneError) else DistributedError)(message)
        return outcome[1]


#: True once :func:`current` initialised the default group itself (then :func:`shutdown` destroys it)
_INITIALISED_HERE: list = []


def current(device: Any = None) -> ProcessGroup | None:
    """The data-parallel group this process belongs to, or ``None`` for a one-process run.

    Inside an initialised ``torch.distributed`` process group of two or more processes, that group.
    Under ``torchrun`` with more than one process (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR`` set)
    and no group yet, initialise the default group from those variables: NCCL when CUDA is available and
    ``device`` is not the CPU, gloo otherwise.  A group of one process is ``None`` (nothing to distribute).
    """
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if not launched_by_torchrun():
            return None
        wants_cpu = device is not None and torch.device(device).type == "cpu"
        backend = "nccl" if torch.cuda.is_available() and not wants_cpu else "gloo"
        try:
            dist.init_process_group(backend=backend)
        except Exception as exc:  # noqa: BLE001 - any rendezvous failure is one clear error
            raise DistributedError(
                f"Could not join the torchrun process group ({type(exc).__name__}: {exc}). Check MASTER_ADDR/"
                "MASTER_PORT and that every process was started by the same torchrun command."
            ) from exc
        if backend == "nccl":  # one GPU per process: NCCL's own collectives (and ours) use this device
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        _INITIALISED_HERE.append(True)
    world = dist.get_world_size()
    if world < 2:
        return None
    return ProcessGroup(rank=dist.get_rank(), world_size=world,
                        local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                        backend=str(dist.get_backend()))


def data_parallel_world_size() -> int:
    """How many processes this one runs beside (itself included), WITHOUT joining a group: the size of an
    initialised ``torch.distributed`` group, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def is_main_process() -> bool:
    """True outside a data-parallel run and on its rank 0 (the rank that shows progress and writes files)."""
    group = current()
    return group is None or group.is_main


def shutdown() -> None:
    """Destroy the default process group if :func:`current` created it (end of a torchrun command)."""
    if _INITIALISED_HERE and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _INITIALISED_HERE.clear()
