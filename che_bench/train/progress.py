"""How training and evaluation show their progress on standard error: a live bar on a
terminal; when standard error is not a terminal (redirected to a file or a pipe: a batch job,
``nohup``), one line every ``LINE_INTERVAL_S`` seconds of wall time, so that a slow run is
seen to move.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

#: Seconds of wall time between two progress lines when standard error is not a terminal.
LINE_INTERVAL_S = 60.0


class StepProgress(Protocol):
    """What the training loop tells its progress display after reading the device."""

    def update(self, step: int, loss: float, accuracy: float) -> None: ...


def duration_text(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min`` (``?`` when not finite)."""
    if not math.isfinite(seconds):
        return "?"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def clock_text(seconds: float) -> str:
    """``H:MM:SS``, as the live bars show times."""
    minutes, whole_seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{whole_seconds:02d}"


def say(text: str) -> None:
    """Write ``text`` on standard error. On a closed stream (a pipe whose reader is gone:
    ``tee`` stopped by the same Ctrl-C) the text is lost rather than raised as an error in the
    middle of the work it reports on, such as saving a checkpoint."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):  # a broken pipe; ValueError: the stream was closed
        pass


class ProgressLines:
    """A progress line on standard error at most every ``interval`` seconds (default
    ``LINE_INTERVAL_S``) of ``clock`` (default wall time, ``time.monotonic``; tests give
    another), the first one ``interval`` seconds after the start."""

    def __init__(
        self,
        label: str,
        steps: int,
        start: int,
        *,
        interval: float | None = None,
        clock: Callable[[], float] | None = None,
        unit: str = "step",
    ) -> None:
        self.label, self.steps, self.start_step, self.unit = label, steps, start, unit
        self.interval = LINE_INTERVAL_S if interval is None else interval
        self.clock = time.monotonic if clock is None else clock
        self.started = self.clock()
        self.next_line = self.started + self.interval

    def update(self, step: int, loss: float, accuracy: float) -> None:
        self.report(step, f"loss {loss:.4f}, acc {accuracy:.1%}")

    def report(self, step: int, detail: str, done_share: float | None = None) -> None:
        """A line (``step`` of ``steps`` done, ``detail``) if the interval has passed; the time
        left is estimated from ``done_share``, the share of this session's work done, when
        steps differ in cost (an evaluation's lengths), else from the steps."""
        now = self.clock()
        if now < self.next_line:
            return
        self.next_line = now + self.interval
        elapsed = now - self.started
        if done_share is None:
            done_share = (step - self.start_step) / max(self.steps - self.start_step, 1)
        left = elapsed * (1 - done_share) / done_share if done_share > 0 else math.inf
        say(
            f"che-bench: {self.label}: {self.unit} {step:,}/{self.steps:,} "
            f"({step / max(self.steps, 1):.0%}), {detail}, "
            f"{duration_text(elapsed)} elapsed, about {duration_text(left)} left\n"
        )


class AverageTimeRemaining(ProgressColumn):
    """The time left at the average speed since the start, in the task's units (weight them
    by cost where steps differ). Rich's ``TimeRemainingColumn`` averages the last 30 s only and
    shows -:--:-- once a single step takes longer: an evaluation's longest lengths."""

    def render(self, task: Task) -> Text:
        if not task.completed or task.total is None or task.elapsed is None:
            return Text("-:--:--", style="progress.remaining")
        left = task.elapsed / task.completed * (task.total - task.completed)
        return Text(clock_text(left), style="progress.remaining")


class _Bar:
    """The live bar on a terminal."""

    def __init__(self, bar: Progress) -> None:
        self.bar = bar

    def update(self, step: int, loss: float, accuracy: float) -> None:
        self.bar.update(self.bar.task_ids[0], completed=step, loss=loss, acc=accuracy)


@contextmanager
def progress_display(
    enabled: bool,
    lines: Callable[[], ProgressLines],
    columns: Sequence[ProgressColumn],
    description: str,
    total: float,
    completed: int = 0,
    **fields: Any,
) -> Iterator[Progress | ProgressLines | None]:
    """A live bar of ``columns`` (one task: ``description``, ``total``, ``completed``,
    ``fields``) on a terminal, ``lines()`` elsewhere, None when not ``enabled``."""
    console = Console(stderr=True)
    if not enabled:
        yield None
        return
    if not console.is_terminal:
        yield lines()
        return
    bar = Progress(*columns, console=console, transient=True)
    with bar:
        bar.add_task(description, total=total, completed=completed, **fields)
        yield bar


@contextmanager
def training_progress(
    enabled: bool,
    label: str,
    steps: int,
    start: int,
    *,
    interval: float | None = None,
    clock: Callable[[], float] | None = None,
) -> Iterator[StepProgress | None]:
    """The bar on a terminal, ``ProgressLines`` (``interval``, ``clock``) elsewhere, None when
    not ``enabled``."""
    columns = (
        TextColumn("train"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  acc {task.fields[acc]:.1%}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with progress_display(
        enabled,
        lambda: ProgressLines(label, steps, start, interval=interval, clock=clock),
        columns,
        "train",
        steps,
        start,
        loss=math.nan,
        acc=math.nan,
    ) as display:
        yield _Bar(display) if isinstance(display, Progress) else display
