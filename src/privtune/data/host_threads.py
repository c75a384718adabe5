"""Per-row host work (decoding and resizing images) on several threads of this process.

Pillow releases the GIL while it decodes and resamples, so threads run that work in parallel without copying
images between processes.  On an accelerator the host prepares every micro-batch between the device's kernels, and
one core's preprocessing was much of a step's wait (docs/engine.md); on a CPU it is a small share of a step, run on
the cores the step itself then uses.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

#: at most this many threads, whatever the machine: the work is short and a pool of them stays alive
MAX_HOST_THREADS = 8
#: at least this many rows per thread: below it handing rows to a thread costs more than reading them here
MIN_ROWS_PER_THREAD = 16
#: images of fewer pixels are read on one thread: decoding and resizing a 28 × 28 or 32 × 32 image is mostly
#: Python, which threads only take turns at (0.75–1.0× on two threads, slower for small PNG files), while from
#: 64 × 64 pixels two threads read 1.05–1.8× faster (bench/image_preprocessing.py --threads)
MIN_PIXELS_FOR_THREADS = 64 * 64

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def host_threads() -> int:
    """Threads :func:`map_rows` uses: torch's intra-op thread count (``torch.set_num_threads``, or
    ``OMP_NUM_THREADS``), at most :data:`MAX_HOST_THREADS`, so one setting bounds all of a run's CPU use."""
    import torch

    return max(1, min(MAX_HOST_THREADS, torch.get_num_threads()))


def _executor(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != size:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(size, thread_name_prefix="privtune-host"), size
        return _pool


def _forget_pool() -> None:
    """A forked child has none of its parent's threads: it starts its own pool when it needs one."""
    global _pool, _pool_size
    _pool, _pool_size = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def map_rows(fn: Callable[[int], T], rows: Sequence[int]) -> list[T]:
    """``[fn(r) for r in rows]``, in that order, split into contiguous runs of rows over :func:`host_threads`
    threads.  ``fn`` must not depend on which thread runs it or on the order of the calls.  An exception of any
    call is raised here, as the loop would raise it."""
    rows = list(rows)
    available = host_threads()
    threads = min(available, len(rows) // MIN_ROWS_PER_THREAD)
    if threads <= 1:
        return [fn(r) for r in rows]
    bounds = [len(rows) * k // threads for k in range(threads + 1)]
    parts = _executor(available).map(lambda k: [fn(r) for r in rows[bounds[k]:bounds[k + 1]]], range(threads))
    return [x for part in parts for x in part]
