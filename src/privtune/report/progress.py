"""Progress display and plain log file for long runs (``privtune train`` / ``privtune tune``).

Two small pieces:

* :class:`RunLog`: appends timestamped plain-text lines to a file (``RUN_DIR/log.txt``).
* :class:`Progress`: a `rich` progress display with the current **phase** (e.g.
  ``"feature caching"``, ``"trial 3/6"``, ``"final run"``), a bar, examples/s, the last
  (privatised) loss, the ε spent so far and the time left (for the phase and, from the plan, for
  the whole run).  When the output is not a terminal it prints the log's plain lines instead, as
  they come.  ``quiet=True`` shows nothing on the terminal; the log file is written either way.

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

__all__ = ["BATCH_LOSS_LABEL", "Progress", "RunLog"]

#: what the display calls a loss computed from the sampled batch without noise (DP-SGD's own batch loss): shown
#: to the person running the job, never written to log.txt or anything else the run releases
BATCH_LOSS_LABEL = "batch loss (not private, not in the release)"


class RunLog:
    """Append-only plain log: one ``YYYY-MM-DD HH:MM:SS  message`` line per call (``message`` alone when
    :attr:`timestamps` is off).

    Args:
        path: the log file (e.g. ``RUN_DIR/log.txt``); parent folders are created.  ``None``
            makes every call a no-op, so callers need no ``if``.
    """

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path is not None else None
        self._fh: TextIO | None = None
        #: lines carry the wall-clock time
        self.timestamps = True
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def format(self, message: str, when: _dt.datetime | None = None) -> str:
        """The line :meth:`write` appends for ``message`` (without the final newline); ``when``: its time
        (default now)."""
        stamp = (when or _dt.datetime.now()).strftime("%Y-%m-%d %H:%M:%S") + "  " if self.timestamps else ""
        return stamp + str(message).replace("\n", "\n" + " " * len(stamp))

    def write(self, message: str, when: _dt.datetime | None = None) -> None:
        """Append one line (newlines inside ``message`` are indented continuation lines)."""
        if self._fh is None:
            return
        try:
            self._fh.write(self.format(message, when) + "\n")
            self._fh.flush()
        except OSError:
            # best effort: a full disk must not turn the one clear error of a failing run (whose handler logs
            # it here) into a traceback; the ledger, not this log, holds what was spent
            pass

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


#: seconds per example of each kind of work relative to a forward pass through the model (feature caching),
#: used for a kind only until this run has measured it.  Measured on the CPU with MiniLM (the embedded demo, three
#: runs at different loads): a DP-BiTFiT or LoRA pilot step ≈ 3.3× a forward pass per example, predicting (scores,
#: the reported split) 1.3–2×; DP full fine-tuning ≈ 1.7× DP-BiTFiT (bench/results/sst2_full); a step of a head
#: on cached features ≈ nothing.  ``"release"`` counts releases, not examples: writing the model, the report and
#: its plots takes about as long as 200 forward passes.
RELATIVE_COST = {"forward": 1.0, "predict": 1.8, "features": 0.001,
                 "model:bitfit": 3.3, "model:lora": 3.3, "model:full": 5.5, "release": 200.0}
_DEFAULT_MODEL_COST = 3.3  # a model mode not listed above


def relative_cost(kind: str) -> float:
    """Seconds per example of ``kind`` of work relative to a forward pass (:data:`RELATIVE_COST`)."""
    return _relative_cost(kind)


def format_duration(seconds: float) -> str:
    """``1h05m``, ``12m30s`` or ``45s``."""
    return _fmt_duration(seconds)


def _relative_cost(kind: str) -> float:
    return RELATIVE_COST.get(kind, _DEFAULT_MODEL_COST if kind.startswith("model:") else 1.0)


class Progress:
    """Terminal progress (rich on a terminal, plain lines otherwise) plus the plain log file.

    Args:
        quiet: no terminal output at all (for scripts); the log file is still written.
        log_path: path of the plain log (``RUN_DIR/log.txt``) or ``None`` for none.
        total_epsilon: the run's total ε budget, shown as "ε spent/total" when given.
        log_interval: seconds between progress lines written to the log file (and, when the output is not a
            terminal, printed) during a phase; phase starts/ends and :meth:`log` messages are always written.
            After :meth:`hide_timing` a line every 10 % of a phase instead.
        console: a ``rich.console.Console`` to draw on (default: stderr).  When it is not a terminal (output
            redirected to a file or a pipe) the lines of the log file are printed on it instead of a live
            display, so that a redirected run shows its progress as it goes.
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
        self.total_epsilon = total_epsilon
        self.log_interval = float(log_interval)
        self.runlog = RunLog(log_path)
        self.phase: str | None = None
        self.epsilon: float | None = None
        self.loss: float | None = None
        self._log_timing = True
        self._examples = 0
        self._done = 0.0
        self._total: float | None = None
        self._unit = "steps"
        self._counted = True
        self._t0 = time.monotonic()
        self._last_log = self._t0
        self._last_tenth = 0
        self._ending = False
        self._loss_label = "loss"
        self._task = None
        self._rich = None
        self._plain: TextIO | None = None  # the stream of plain progress lines when the output is no terminal
        self._held: list | None = None  # lines held back by hold_lines(): (text, time, printed by rich?)
        # time-left estimate, from the plan: the work still ahead after the current phase as (kind, expected
        # examples) items (public: from the plan), the kind and planned examples of the current phase, and the
        # seconds and examples each kind of work took in this run's finished phases
        self._ahead: list[list] | None = None
        self._phase_kind: str | None = None
        self._phase_work: float | None = None
        self._cost: dict[str, list[float]] = {}
        self._work_done = 0.0
        if not self.quiet:
            # Lazy: rich only when progress is shown.
            from rich.console import Console

            console = console or Console(file=sys.stderr)
            if not console.is_terminal:
                self._plain = console.file
            else:
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
                    console=console,
                    transient=False,
                )
                self._rich.start()

    # ----------------------------------------------------------------- timing
    @property
    def log_timing(self) -> bool:
        """Whether anything written or printed carries time: timestamps, durations, time left, examples/s."""
        return self._log_timing

    @log_timing.setter
    def log_timing(self, value: bool) -> None:
        if not value:
            self.hide_timing()

    def hide_timing(self) -> None:
        """From now on nothing written or printed carries time, nor do the lines held by :meth:`hold_lines`:
        for runs whose durations grow with something they keep secret (the random number of trials under
        repeat-and-select).  Progress lines then come every 10 % of a phase, never every so many seconds
        (their number would measure the time).  Releases the held lines."""
        self._log_timing = False
        self.runlog.timestamps = False
        if self._rich is not None:
            from rich.progress import TimeElapsedColumn

            self._rich.columns = tuple(c for c in self._rich.columns if not isinstance(c, TimeElapsedColumn))
        self.release_lines()

    def hold_lines(self) -> None:
        """Hold every line back (log file and printed) until :meth:`release_lines` or :meth:`hide_timing`:
        ``tune`` writes its first lines before its plan says whether the run's timing may be shown."""
        if self._held is None:
            self._held = []

    def release_lines(self) -> None:
        """Write and print the lines held since :meth:`hold_lines` (with the time they were made, unless
        timing is hidden), and every later line at once."""
        held, self._held = self._held, None
        for text, when, rich in held or ():
            self._emit(text, when, rich)

    # ----------------------------------------------------------------- phases
    @property
    def examples_per_second(self) -> float:
        """Examples processed per second in the current phase (0 before any)."""
        dt = time.monotonic() - self._t0
        return self._examples / dt if dt > 0 else 0.0

    def plan_ahead(self, items) -> None:
        """Declare the work still ahead of the current phase, as ``(kind, expected examples)`` pairs in the order
        it will run (public: from the plan), so that the display also shows the time left for the whole run.

        Kinds: ``"forward"`` (forward passes: feature caching), ``"predict"`` (scores, evaluation),
        ``"features"`` (steps of a head on cached features), ``"model:<mode>"`` (DP steps of that mode),
        ``"release"`` (writing the released files; counted in releases, not examples).  Each
        kind's seconds per example are measured in this run as its phases finish (until then scaled from the
        kind measured last by :data:`RELATIVE_COST`).  A phase started with ``work=`` and ``kind=`` takes its
        work off the first items of its kind, so does :meth:`record_work`; calling this again replaces the
        whole list."""
        self._ahead = [[str(k), float(w)] for k, w in items if w and w > 0]

    def plan_work(self, total: float) -> None:
        """Declare the planned work of the whole run in expected training examples of one kind (``"run"``):
        the work still ahead is ``total`` less the phases finished so far.  See :meth:`plan_ahead`."""
        self.plan_ahead([("run", max(0.0, float(total) - self._work_done))])

    def _take_off(self, kind: str, work: float) -> None:
        """Remove ``work`` examples of ``kind`` from the first planned items of that kind."""
        if not self._ahead:
            return
        for item in self._ahead:
            if item[0] == kind and work > 0:
                take = min(item[1], work)
                item[1] -= take
                work -= take
        self._ahead = [item for item in self._ahead if item[1] > 0]

    def record_work(self, kind: str, work: float, seconds: float) -> None:
        """Planned work done outside any phase (e.g. the forward passes of a score): taken off the plan, and its
        ``seconds`` counted in the rate of ``kind``.  Writes nothing."""
        self._take_off(kind, float(work))
        cost = self._cost.pop(kind, [0.0, 0.0])  # re-inserted: the kind measured last
        self._cost[kind] = [cost[0] + float(seconds), cost[1] + float(work)]

    @property
    def work_done(self) -> float:
        """Planned work (expected training examples) of the phases finished so far."""
        return self._work_done

    def _measured(self) -> dict[str, tuple[float, float]]:
        """(seconds, examples) of each kind of work measured so far, the current phase's part included, the
        kind measured last at the end."""
        out = {k: (s, e) for k, (s, e) in self._cost.items()}
        if self.phase is not None and self._phase_kind and self._phase_work and self._total and self._done:
            s, e = out.pop(self._phase_kind, (0.0, 0.0))
            out[self._phase_kind] = (s + time.monotonic() - self._t0,
                                     e + self._phase_work * min(1.0, self._done / self._total))
        return out

    def seconds_per_example(self, kind: str) -> float | None:
        """Seconds per example of ``kind`` of work: measured in this run, else scaled by :data:`RELATIVE_COST`
        from the kind measured last (the machine's load changes during a run: the latest rate is the best guess
        of the next one); ``None`` before anything is measured."""
        measured = {k: s / e for k, (s, e) in self._measured().items() if e > 0}
        if kind in measured:
            return measured[kind]
        # a head on cached features only when nothing else ran: it takes too little time to scale from
        refs = [k for k in measured if k != "features"] or list(measured)
        if not refs:
            return None
        return measured[refs[-1]] / _relative_cost(refs[-1]) * _relative_cost(kind)

    def time_left(self) -> tuple[float | None, float | None]:
        """(seconds left in the current phase, seconds left in the whole run), or None where unknown.

        Estimated from the plan and the wall clock only: the phase's elapsed time per unit done times the
        units left (before its first unit: its planned examples at its kind's rate), and for the whole run the
        planned examples still ahead of each kind at that kind's measured seconds per example.  Nothing here
        depends on the data beyond the time its steps took."""
        if self.phase is None:
            return None, None
        elapsed = time.monotonic() - self._t0
        phase_left = None
        if self._ending:
            phase_left = 0.0
        elif self._done and self._total is not None:
            phase_left = elapsed / self._done * max(0.0, self._total - self._done)
        elif self._phase_kind and self._phase_work:
            rate = self.seconds_per_example(self._phase_kind)
            if rate is not None:
                phase_left = max(0.0, self._phase_work * rate - elapsed)
        run_left = None
        if self._ahead is not None:
            rates = [self.seconds_per_example(k) for k, _ in self._ahead]
            if None not in rates and (phase_left is not None or self._total is None):
                run_left = (phase_left or 0.0) + sum(w * r for (_, w), r in zip(self._ahead, rates))
        return phase_left, run_left

    def _left_text(self) -> str:
        if not self._log_timing:
            return ""
        phase_left, run_left = self.time_left()
        parts = []
        if phase_left is not None:
            parts.append(f"{_fmt_duration(phase_left)} left")
        if run_left is not None:
            parts.append(f"run {_fmt_duration(run_left)} left")
        return ", ".join(parts)

    def start_phase(self, name: str, total: float | None = None, unit: str = "steps",
                    work: float | None = None, kind: str | None = None, loss_label: str = "loss",
                    counted: bool = True) -> None:
        """End the current phase (if any) and start ``name`` with ``total`` units of work; ``work`` is its
        planned work in expected examples and ``kind`` the kind of that work (see :meth:`plan_ahead`; default
        ``"run"``, the kind of :meth:`plan_work`).  ``loss_label`` names the loss the display shows
        (e.g. :data:`BATCH_LOSS_LABEL`, ``"privatised loss"``).  ``counted=False``: no line or display shows how
        many units were done (a phase over private rows whose number is private, e.g. at the unit level)."""
        if self.phase is not None:
            # an open-ended phase with nothing done yet is an umbrella (e.g. "hyperfree (bitfit)") whose own
            # steps start as phases of their own: closing it silently avoids a "done …: 0 runs" line before
            # any of its work
            self.end_phase(silent=self._total is None and self._done == 0)
        self._phase_work = None if work is None else float(work)
        self._phase_kind = None if work is None else (kind or "run")
        if self._phase_work:
            self._take_off(self._phase_kind, self._phase_work)  # this phase's work is no longer ahead
        self.phase = name
        self._examples = 0
        self._done = 0.0
        self._total = total
        self._unit = unit
        self._counted = counted
        self.loss = None
        self._loss_label = loss_label
        self._last_tenth = 0
        self._t0 = self._last_log = time.monotonic()
        self._write(f"start {name}" + (f" ({total:g} {unit})" if total is not None and counted else ""))
        if self._rich is not None:
            self._task = self._rich.add_task(name, total=total, unit=unit, counted=counted and total is not None,
                                             rate="", loss="",
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
                rate=f"{self.examples_per_second:,.0f} ex/s" if self._examples and self._log_timing else "",
                loss=f"{self._loss_label} {self.loss:.4g}" if self.loss is not None else "",
                eps=_fmt_eps(self.epsilon, self.total_epsilon),
                left=self._left_text(),
            )
        if self.phase is None:  # between phases: no line
            return
        if self._log_timing:
            now = time.monotonic()
            if now - self._last_log >= self.log_interval:
                self._last_log = now
                self._write(self._status_line())
        elif self._total:  # no clock: a line at every tenth of the phase, a function of the plan only
            tenth = int(10 * min(1.0, self._done / self._total))
            if tenth > self._last_tenth and tenth < 10:  # the last tenth is the "done" line
                self._last_tenth = tenth
                self._write(self._status_line())

    def set_epsilon(self, epsilon: float) -> None:
        """Update the cumulative ε spent so far (e.g. after a trial)."""
        self.advance(0, epsilon=epsilon)

    def _status_line(self) -> str:
        """The line written to log.txt: no loss and no example rate, which callers compute from private data
        without noise (the batch loss, the sampled batch sizes); log.txt stays shareable.  The terminal
        display shows both, for the person running the job."""
        parts = [f"{self.phase}: {self._done:g}" + (f"/{self._total:g}" if self._total is not None else "")
                 + f" {self._unit}" if self._counted else f"{self.phase}"]
        if self.epsilon is not None:
            parts.append(_fmt_eps(self.epsilon, self.total_epsilon))
        left = self._left_text()
        if left:
            parts.append(left)
        return ", ".join(parts)

    def _write(self, line: str, *, rich: bool | None = False) -> None:
        """A line for the log file, also printed when the output is not a terminal (no live display there)
        and, with ``rich``, above the live display."""
        if self._held is not None:
            self._held.append((line, _dt.datetime.now(), rich))
        else:
            self._emit(line, None, rich)

    def _emit(self, line: str, when: _dt.datetime | None, rich: bool | None) -> None:
        self.runlog.write(line, when)
        if rich is None:  # the log file alone (log_to_file)
            return
        if self._plain is not None:
            print(self.runlog.format(line, when), file=self._plain, flush=True)
        elif rich and self._rich is not None:
            self._rich.console.print(line, markup=False, highlight=False)

    def end_phase(self, *, silent: bool = False) -> None:
        """Finish the current phase and write its summary to the log (``silent``: no summary line)."""
        if self.phase is None:
            return
        took = f" in {time.monotonic() - self._t0:.1f} s" if self._log_timing else ""
        if not silent:
            self._ending = True  # the phase is over: nothing left of it, whatever its plan said
            self._write("done " + self._status_line() + took)
            self._ending = False
        if self._phase_work is not None:
            self._work_done += self._phase_work
            cost = self._cost.pop(self._phase_kind or "run", [0.0, 0.0])  # re-inserted: the kind measured last
            cost[0] += time.monotonic() - self._t0
            cost[1] += self._phase_work
            self._cost[self._phase_kind or "run"] = cost
            self._phase_work = self._phase_kind = None
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
        self._write(message, rich=True)

    def log_to_file(self, message: str) -> None:
        """Write ``message`` to the log file alone (held and timed like every line), never printed: for what is
        shown another way, e.g. a Python warning, which the command line prints as one ``warning:`` line."""
        self._write(message, rich=None)

    # ----------------------------------------------------------------- lifetime
    def close(self, interrupted: bool = False) -> None:
        """End the current phase, stop the display, close the log file."""
        self.release_lines()
        if interrupted and self.phase is not None:
            self._write("interrupted during " + self._status_line())
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
            self._write(what)
        self.close(interrupted=exc_type is not None)
