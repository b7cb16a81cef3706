"""What a sweep shows while it runs: the ``SweepView`` protocol ``run_sweep`` reports to, and
``GridView``, the sweep's own (a live progress bar, one line per finished run, and a progress
line every minute when standard error is not a terminal, as ``che-bench run`` prints)."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from che_bench.config import RunConfig
from che_bench.outcomes import RunResult
from che_bench.train.progress import LINE_INTERVAL_S, ProgressLines, clock_text


class SweepView(Protocol):
    """Reports of ``run_sweep``; a context manager around the execution (a live display)."""

    def start(self, already_complete: Sequence[str], todo: Sequence[RunConfig]) -> None:
        """The grid split, before anything runs: the run ids complete in the store already
        (in grid order) and the runs to do now (maybe none)."""

    def stale(self, notices: Sequence[str]) -> None:
        """One line for each complete run whose plugin changed since (maybe none), before
        ``start``."""

    def __enter__(self) -> SweepView: ...

    def __exit__(self, *exc_info) -> None: ...

    def update(self, *, running: int, left: int) -> None:
        """Runs in flight and runs waiting, after packs were submitted."""

    def finished(self, result: RunResult, *, running: int, left: int) -> None:
        """``result`` arrived (and was recorded)."""


def describe_run(config: RunConfig) -> str:
    """One-line label of a grid point: task(non-default params) pe(its options) kernel,
    ``alibi(alibi_mode=two_slopes) k3`` (or the architecture with its non-default options,
    ``mamba(neg_eigen=true)``, for one other than the transformer) lr seed."""
    from che_bench.model.option_text import changed_options, options_text

    defaults = _default_task_params(config.task)
    params = ",".join(
        f"{key}={value}"
        for key, value in sorted(config.task_params.items())
        if defaults.get(key) != value
    )
    task = f"{config.task}({params})" if params else config.task
    kernel = "-" if config.kernel is None else f"k{config.kernel}"
    if config.is_transformer:
        options = options_text(config.pe_options, ",")
        model = f"{config.pe}({options}) {kernel}" if options else f"{config.pe} {kernel}"
    else:
        options = options_text(changed_options(config.arch, config.arch_options), ",")
        model = f"{config.arch}({options})" if options else config.arch
    return f"{task} {model} lr={config.lr:g} seed={config.seed}"


@functools.cache
def _default_task_params(task: str) -> dict:
    from che_bench.tasks import get_task

    return get_task(task).params()


class GridView:
    """Grid progress: a live bar on a terminal, one log line per finished run everywhere; with
    ``live`` and standard error not a terminal (or no bar), a progress line on it every
    ``interval`` seconds (default ``LINE_INTERVAL_S``), so that a sweep whose runs take long
    is seen to move."""

    def __init__(self, console: Console, live: bool, interval: float | None = None) -> None:
        self.console = console
        self.total = self.done = self.failed = self.running = 0
        self.started = time.monotonic()
        self.interval = LINE_INTERVAL_S if interval is None else interval
        shows_bar = live and console.is_terminal
        self.prints_lines = live and not (shows_bar and sys.stderr.isatty())
        self._stop_lines = threading.Event()
        self.progress = Progress(
            TextColumn("[bold]sweep"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "running {task.fields[running]} · failed {task.fields[failed]} · "
                "left {task.fields[left]} · ETA {task.fields[eta]}"
            ),
            TimeElapsedColumn(),
            console=console,
            disable=not shows_bar,
            # Standard error goes above the bar only when it is a terminal too: `2> file`
            # keeps the workers' messages and the progress lines in the file.
            redirect_stderr=sys.stderr.isatty(),
        )
        self.task: TaskID | None = None

    def stale(self, notices: Sequence[str]) -> None:
        for notice in notices:
            self.console.print(notice, highlight=False, markup=False)

    def start(self, already_complete: Sequence[str], todo: Sequence[RunConfig]) -> None:
        self.total = len(todo)
        self.task = self.progress.add_task(
            "sweep", total=self.total, running=0, failed=0, left=self.total, eta="-"
        )

    def __enter__(self) -> GridView:
        self.progress.start()
        if self.prints_lines:
            lines = ProgressLines("sweep", self.total, 0, interval=0.0, unit="runs done")
            threading.Thread(target=self._print_lines, args=(lines,), daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop_lines.set()
        self.progress.stop()

    def _print_lines(self, lines: ProgressLines) -> None:
        while not self._stop_lines.wait(self.interval):
            lines.report(self.done, f"{self.running} running, {self.failed} failed")

    def update(self, *, running: int, left: int) -> None:
        self.running = running
        if self.task is None:  # not started
            return
        self.progress.update(
            self.task, running=running, left=left, failed=self.failed, eta=self._eta(running + left)
        )

    def finished(self, result: RunResult, *, running: int, left: int) -> None:
        self.done += 1
        self.failed += result.status != "complete"
        seconds = result.timings.get("total_s")
        took = f" ({seconds:.1f}s)" if seconds is not None else ""
        if result.status == "complete":
            outcome = f"[green]complete[/] score {result.score:.2%}"
        else:
            outcome = f"[red]failed[/] {result.error}"
        self.console.print(
            f"[{self.done}/{self.total}] {describe_run(result.config)} [dim]{result.run_id}[/] "
            f"{outcome}{took}",
            highlight=False,
            markup=True,
        )
        if self.task is not None:
            self.progress.advance(self.task)
        self.update(running=running, left=left)

    def _eta(self, remaining: int) -> str:
        if not self.done:
            return "-"
        return clock_text((time.monotonic() - self.started) / self.done * remaining)
