"""Progress display and plain log file for long runs (``privtune train`` / ``privtune tune``).

Two small pieces:

* :class:`RunLog`: appends timestamped plain-text lines to a file (``RUN_DIR/log.txt``).
* :class:`Progress`: a `rich` progress display with the current **phase** (e.g.
  ``"feature caching"``, ``"trial 3/6"``, ``"final run"``), a bar, examples/s, the last
  (privatised) loss and the ε spent so far.  ``quiet=True`` shows nothing on the terminal;
  the log file is written either way.

Example::

    from privtune.report.progress import Progress

    with Progress(quiet=False, log_path=run_dir / "log.txt", total_epsilon=1.0) as progress:
        progress.start_phase("feature caching", total=len(dataset), unit="examples")
        for batch in batches:
            ...
            progress.advance(len(batch), examples=len(batch))
        progress.start_phase("trial 1/6", total=steps)
        for step in range(steps):
            ...
            progress.advance(1, examples=batch_size, loss=noisy_loss, epsilon=eps_spent_so_far)
        progress.log("trial 1/6 done: score 0.81 (public validation)")
    # leaving the block ends the last phase; an exception (Ctrl-C) is logged as "interrupted"

``epsilon`` is the cumulative ε spent so far *as the accountant composes it* (pass what
:func:`privtune.accounting.compute_epsilon` gives for the events so far; never a sum).
The loss shown is whatever the caller passes; pass only privatised quantities when the
display may be shared (the loss of a DP run computed without noise is not private).
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Progress", "RunLog"]


class RunLog:
    """Append-only plain log: one ``YYYY-MM-DD HH:MM:SS  message`` line per call.

    Args:
        path: the log file (e.g. ``RUN_DIR/log.txt``); parent folders are created.  ``None``
            makes every call a no-op, so callers need no ``if``.
    """

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path is not None else None
        self._fh: TextIO | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, message: str) -> None:
        """Append one line (newlines inside ``message`` are indented continuation lines)."""
        if self._fh is None:
            return
        stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        text = str(message).replace("\n", "\n" + " " * (len(stamp) + 2))
        self._fh.write(f"{stamp}  {text}\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _fmt_eps(eps: float | None, total: float | None) -> str:
    if eps is None:
        return ""
    return f"ε {eps:.3g}" + (f"/{total:.3g}" if total is not None else "")


def _fmt_duration(seconds: float) -> str:
    """``1h05m``, ``12m30s`` or ``45s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _count_column():
    """A rich column: ``done/total unit`` for phases with a known amount of work, nothing for
    open-ended ones (rich's own M/N column would print a made-up ``0/0``)."""
    # Lazy: rich only when a progress bar is shown.
    from rich.progress import ProgressColumn
    from rich.text import Text

    class CountColumn(ProgressColumn):
        def render(self, task):  # noqa: D102
            if not task.fields.get("counted", True) or task.total is None:
                return Text("")
            return Text(f"{task.completed:g}/{task.total:g} {task.fields.get('unit', '')}")

    return CountColumn()


class Progress:
    """Terminal progress (rich) plus the plain log file.

    Args:
        quiet: no terminal output at all (for scripts); the log file is still written.
        log_path: path of the plain log (``RUN_DIR/log.txt``) or ``None`` for none.
        total_epsilon: the run's total ε budget, shown as "ε spent/total" when given.
        log_interval: seconds between progress lines written to the log file during a
            phase (phase starts/ends and :meth:`log` messages are always written).
        console: a ``rich.console.Console`` to draw on (default: stderr).
    """

    def __init__(
        self,
        *,
        quiet: bool = False,
        log_path: str | os.PathLike | None = None,
        total_epsilon: float | None = None,
        log_interval: float = 30.0,
        console: Any = None,
    ) -> None:
        self.quiet = bool(quiet)
        #: write phase durations to the log; off when the durations grow with something the run keeps
        #: secret (the random number of trials under repeat-and-select)
        self.log_timing = True
        self.total_epsilon = total_epsilon
        self.log_interval = float(log_interval)
        self.runlog = RunLog(log_path)
        self.phase: str | None = None
        self.epsilon: float | None = None
        self.loss: float | None = None
        self._examples = 0
        self._done = 0.0
        self._total: float | None = None
        self._unit = "steps"
        self._t0 = time.monotonic()
        self._last_log = self._t0
        self._task = None
        self._rich = None
        # time-left estimate: planned work (expected training examples, from the plan: public) of the whole
        # run, of the finished phases and of the current one, and the wall time those phases took
        self._work_total: float | None = None
        self._work_done = 0.0
        self._work_seconds = 0.0
        self._phase_work: float | None = None
        if not self.quiet:
            # Lazy: rich only when a progress bar is shown.
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=28),
                _count_column(),
                TextColumn("[cyan]{task.fields[rate]}"),
                TextColumn("{task.fields[loss]}"),
                TextColumn("[magenta]{task.fields[eps]}"),
                TimeElapsedColumn(),
                TextColumn("[green]{task.fields[left]}"),
                console=console or Console(file=sys.stderr),
                transient=False,
            )
            self._rich.start()

    # ----------------------------------------------------------------- phases
    @property
    def examples_per_second(self) -> float:
        """Examples processed per second in the current phase (0 before any)."""
        dt = time.monotonic() - self._t0
        return self._examples / dt if dt > 0 else 0.0

    def plan_work(self, total: float) -> None:
        """Declare the planned work of the whole run, in expected training examples (Σ q·n·T of its planned
        steps: public, from the plan), so that the display also shows the time left for the whole run.
        Phases count towards it through ``start_phase(..., work=...)``."""
        self._work_total = float(total)

    @property
    def work_done(self) -> float:
        """Planned work (expected training examples) of the phases finished so far."""
        return self._work_done

    def time_left(self) -> tuple[float | None, float | None]:
        """(seconds left in the current phase, seconds left in the whole run), or None where unknown.

        Estimated from the plan and the wall clock only: the phase's elapsed time per unit done times the
        units left, and the seconds per planned example measured over this run's phases so far times the
        planned examples left.  Nothing here depends on the data beyond the time its steps took."""
        if self.phase is None or not self._done:
            return None, None
        elapsed = time.monotonic() - self._t0
        phase_left = (elapsed / self._done * max(0.0, self._total - self._done)
                      if self._total is not None else None)
        run_left = None
        if self._work_total is not None and self._phase_work is not None and self._total:
            done_now = self._phase_work * min(1.0, self._done / self._total)
            per_example = (self._work_seconds + elapsed) / max(self._work_done + done_now, 1e-9)
            run_left = max(0.0, self._work_total - self._work_done - done_now) * per_example
            if phase_left is not None:
                run_left = max(run_left, phase_left)
        return phase_left, run_left

    def _left_text(self) -> str:
        phase_left, run_left = self.time_left()
        parts = []
        if phase_left is not None:
            parts.append(f"{_fmt_duration(phase_left)} left")
        if run_left is not None:
            parts.append(f"run {_fmt_duration(run_left)} left")
        return ", ".join(parts)

    def start_phase(self, name: str, total: float | None = None, unit: str = "steps",
                    work: float | None = None) -> None:
        """End the current phase (if any) and start ``name`` with ``total`` units of work; ``work`` is its
        planned work in expected training examples (see :meth:`plan_work`)."""
        if self.phase is not None:
            # an open-ended phase with nothing done yet is an umbrella (e.g. "hyperfree (bitfit)") whose own
            # steps start as phases of their own: closing it silently avoids a "done …: 0 runs" line before
            # any of its work
            self.end_phase(silent=self._total is None and self._done == 0)
        self._phase_work = None if work is None else float(work)
        self.phase = name
        self._examples = 0
        self._done = 0.0
        self._total = total
        self._unit = unit
        self.loss = None
        self._t0 = self._last_log = time.monotonic()
        self.runlog.write(f"start {name}" + (f" ({total:g} {unit})" if total is not None else ""))
        if self._rich is not None:
            self._task = self._rich.add_task(name, total=total, unit=unit, counted=total is not None, rate="", loss="",
                                             eps=_fmt_eps(self.epsilon, self.total_epsilon), left="")

    def advance(
        self,
        n: float = 1,
        *,
        examples: int | None = None,
        loss: float | None = None,
        epsilon: float | None = None,
    ) -> None:
        """Record ``n`` units of progress.

        Args:
            n: units done (steps, or examples when the phase's unit is examples).
            examples: examples processed in these units (for examples/s).
            loss: latest (privatised) training loss.
            epsilon: cumulative ε spent so far (composed by the accountant).
        """
        self._done += n
        if examples is not None:
            self._examples += int(examples)
        if loss is not None:
            self.loss = float(loss)
        if epsilon is not None:
            self.epsilon = float(epsilon)
        if self._rich is not None and self._task is not None:
            self._rich.update(
                self._task,
                advance=n,
                rate=f"{self.examples_per_second:,.0f} ex/s" if self._examples else "",
                loss=f"loss {self.loss:.4g}" if self.loss is not None else "",
                eps=_fmt_eps(self.epsilon, self.total_epsilon),
                left=self._left_text() if self.log_timing else "",
            )
        now = time.monotonic()
        if self.phase is not None and now - self._last_log >= self.log_interval:  # between phases: no line
            self._last_log = now
            self.runlog.write(self._status_line())

    def set_epsilon(self, epsilon: float) -> None:
        """Update the cumulative ε spent so far (e.g. after a trial)."""
        self.advance(0, epsilon=epsilon)

    def _status_line(self) -> str:
        """The line written to log.txt: no loss and no example rate, which callers compute from private data
        without noise (the batch loss, the sampled batch sizes); log.txt stays shareable.  The terminal
        display shows both, for the person running the job."""
        parts = [f"{self.phase}: {self._done:g}" + (f"/{self._total:g}" if self._total is not None else "")
                 + f" {self._unit}"]
        if self.epsilon is not None:
            parts.append(_fmt_eps(self.epsilon, self.total_epsilon))
        left = self._left_text() if self.log_timing else ""
        if left:
            parts.append(left)
        return ", ".join(parts)

    def end_phase(self, *, silent: bool = False) -> None:
        """Finish the current phase and write its summary to the log (``silent``: no summary line)."""
        if self.phase is None:
            return
        took = f" in {time.monotonic() - self._t0:.1f} s" if self.log_timing else ""
        if not silent:
            self.runlog.write("done " + self._status_line() + took)
        if self._phase_work is not None:
            self._work_done += self._phase_work
            self._work_seconds += time.monotonic() - self._t0
            self._phase_work = None
        if self._rich is not None and self._task is not None:
            task = self._rich.tasks[-1]
            if task.total is None:  # an open-ended phase: show the bar full, without a made-up count
                done = max(self._done, 1)
                self._rich.update(self._task, total=done, completed=done)
            self._rich.stop_task(self._task)
        self.phase = None
        self._task = None

    def log(self, message: str) -> None:
        """Write ``message`` to the log file and (unless quiet) print it above the bar."""
        self.runlog.write(message)
        if self._rich is not None:
            self._rich.console.print(message, markup=False, highlight=False)

    # ----------------------------------------------------------------- lifetime
    def close(self, interrupted: bool = False) -> None:
        """End the current phase, stop the display, close the log file."""
        if interrupted and self.phase is not None:
            self.runlog.write("interrupted during " + self._status_line())
            self.phase = None
        self.end_phase()
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        self.runlog.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            what = "interrupted (Ctrl-C)" if exc_type is KeyboardInterrupt else f"failed: {exc_type.__name__}: {exc}"
            self.runlog.write(what)
        self.close(interrupted=exc_type is not None)
