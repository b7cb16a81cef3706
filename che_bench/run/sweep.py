"""Run a grid of RunConfigs in parallel, resumably, with one writer of the result store.

The scheduler (``run_sweep``) skips runs the store already has complete, groups the rest
into packs (runs of one table cell trained side by side, ``che_bench.run.packing``), keeps a
backend busy with the packs, and records every result as it arrives: the parent process is
the only writer of the store, each result is one atomic write, so a sweep killed at any
point (even with SIGKILL) and started again finishes the grid without losing or repeating
a completed run. Backends execute ``execute_runs`` elsewhere: ``LocalBackend`` in a pool of
worker processes, ``che_bench.run.ray_backend.RayBackend`` as Ray tasks. Interrupted runs resume
from their checkpoints (``checkpoint_dir_for(store)``); the grouping is deterministic, so a
restarted sweep forms the same packs, which resume together.
"""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from che_bench.config import RunConfig, RunResult
from che_bench.run.packing import AUTO, CPU_AUTO_WIDTH, group_into_packs
from che_bench.run.runner import execute_runs, software_versions

#: How often an idle-or-busy worker checks that the sweep process is still alive.
ORPHAN_POLL_S = 1.0
#: How long an orphaned worker may take to checkpoint its run before it exits anyway.
ORPHAN_GRACE_S = 60.0


class Backend(Protocol):
    """Where packs of runs execute. Handles are opaque hashable tokens for submitted packs."""

    #: Whether the runs execute on GPUs (``--pack auto`` then sends whole table cells).
    on_gpu: bool

    def capacity(self) -> int:
        """How many packs to keep in flight."""

    def submit(self, configs: list[RunConfig], width: int | str) -> Hashable:
        """Start the runs ``configs`` in packs of at most ``width`` members (or "auto");
        returns its handle."""

    def wait(
        self, handles: Sequence[Hashable]
    ) -> list[tuple[Hashable, list[RunResult] | BaseException]]:
        """Block until at least one of ``handles`` finishes; its results or the exception
        that prevented them (a crashed worker, say)."""

    def interrupt(self) -> None:
        """Stop the runs in flight (they checkpoint) and drop the rest."""

    def close(self) -> None:
        """Release processes / cluster connections."""


@dataclass
class SweepOutcome:
    """What one ``run_sweep`` call did."""

    run_ids: list[str]  # of the whole grid
    already_complete: int
    results: list[RunResult] = field(default_factory=list)
    not_started: int = 0

    @property
    def total(self) -> int:
        return len(self.run_ids)

    @property
    def failed(self) -> list[RunResult]:
        return [result for result in self.results if result.status != "complete"]


def checkpoint_dir_for(store) -> Path:
    """Per-run checkpoints live next to the store, in ``checkpoints/`` beside the file."""
    return Path(store.path).resolve().parent / "checkpoints"


def failed_result(config: RunConfig, error: BaseException | str) -> RunResult:
    """A failed RunResult for a run whose worker never returned one."""
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return RunResult(
        run_id=config.run_id(), config=config, status="failed",
        error=message.splitlines()[0] if message else "failed", versions=software_versions(config),
    )


def run_sweep(
    configs: Sequence[RunConfig],
    store,
    make_backend: Callable[[], Backend],
    *,
    pack: int | str = 1,
    max_runs: int | None = None,
    console: Console | None = None,
    live: bool = True,
) -> SweepOutcome:
    """Execute every config not yet complete in ``store``; record results as they finish.

    ``make_backend()`` is called only when there is something to run. Runs of one table
    cell are submitted together, in packs of at most ``pack`` members; with ``"auto"`` a
    GPU backend gets whole cells (the worker sizes packs to its GPU's memory) and a CPU one
    packs of ``CPU_AUTO_WIDTH``. At most ``max_runs`` runs are started. Each finished run is
    logged as one line on ``console``; with ``live`` (and a terminal) a progress bar shows
    done / running / failed / left and an ETA. Ctrl-C stops the runs in flight (they
    checkpoint), leaves them unrecorded and re-raises KeyboardInterrupt. The backend is
    closed on return.
    """
    console = console or Console()
    completed = store.completed_run_ids()
    run_ids = [config.run_id() for config in configs]
    todo = [config for config, run_id in zip(configs, run_ids) if run_id not in completed]
    outcome = SweepOutcome(run_ids=run_ids, already_complete=len(configs) - len(todo))
    if max_runs is not None:
        outcome.not_started = max(0, len(todo) - max_runs)
        todo = todo[:max_runs]
    if not todo:
        return outcome
    backend = make_backend()
    if pack == AUTO:
        group_width = None if backend.on_gpu else CPU_AUTO_WIDTH
    else:
        group_width = int(pack)
    queue = deque(group_into_packs(todo, group_width))
    in_flight: dict[Hashable, list[RunConfig]] = {}
    view = _GridView(len(todo), console, live)

    def running() -> int:
        return sum(len(members) for members in in_flight.values())

    try:
        with view:
            while queue or in_flight:
                while queue and len(in_flight) < backend.capacity():
                    members = queue.popleft()
                    for config in members:
                        store.mark_started(config)
                    in_flight[backend.submit(members, pack)] = members
                left = sum(len(members) for members in queue)
                view.update(running=running(), left=left)
                for handle, returned in backend.wait(list(in_flight)):
                    members = in_flight.pop(handle)
                    if isinstance(returned, BaseException):
                        returned = [failed_result(config, returned) for config in members]
                    for result in returned:
                        store.record(result)
                        outcome.results.append(result)
                        view.finished(result, running=running(), left=left)
    except KeyboardInterrupt:
        backend.interrupt()
        raise
    finally:
        backend.close()
    return outcome


def describe_run(config: RunConfig) -> str:
    """One-line label of a grid point: task(non-default params) pe kernel lr seed."""
    defaults = _default_task_params(config.task)
    params = ",".join(f"{key}={value}" for key, value in sorted(config.task_params.items())
                      if defaults.get(key) != value)
    task = f"{config.task}({params})" if params else config.task
    kernel = "-" if config.kernel is None else f"k{config.kernel}"
    return f"{task} {config.pe} {kernel} lr={config.lr:g} seed={config.seed}"


@functools.cache
def _default_task_params(task: str) -> dict:
    from che_bench.tasks import get_task

    return get_task(task).params()


class _GridView:
    """Grid progress: a live bar on a terminal, one log line per finished run everywhere."""

    def __init__(self, total: int, console: Console, live: bool) -> None:
        self.total, self.console = total, console
        self.done = self.failed = 0
        self.started = time.monotonic()
        self.progress = Progress(
            TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(),
            TextColumn("running {task.fields[running]} · failed {task.fields[failed]} · "
                       "left {task.fields[left]} · ETA {task.fields[eta]}"),
            TimeElapsedColumn(),
            console=console, disable=not (live and console.is_terminal),
        )
        self.task = self.progress.add_task("sweep", total=total, running=0, failed=0,
                                           left=total, eta="-")

    def __enter__(self) -> _GridView:
        self.progress.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.progress.stop()

    def update(self, *, running: int, left: int) -> None:
        self.progress.update(self.task, running=running, left=left, failed=self.failed,
                             eta=self._eta(running + left))

    def finished(self, result: RunResult, *, running: int, left: int) -> None:
        self.done += 1
        self.failed += result.status != "complete"
        seconds = result.timings.get("total_s")
        took = f" ({seconds:.1f}s)" if seconds is not None else ""
        if result.status == "complete":
            outcome = f"[green]complete[/] score {result.score:.3f}"
        else:
            outcome = f"[red]failed[/] {result.error}"
        self.console.print(
            f"[{self.done}/{self.total}] {describe_run(result.config)} [dim]{result.run_id}[/] "
            f"{outcome}{took}", highlight=False, markup=True, soft_wrap=True,
        )
        self.progress.advance(self.task)
        self.update(running=running, left=left)

    def _eta(self, remaining: int) -> str:
        if not self.done:
            return "-"
        seconds = (time.monotonic() - self.started) / self.done * remaining
        minutes, secs = divmod(int(seconds), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}:{minutes:02d}:{secs:02d}"


# --------------------------------------------------------------------------------------------
# Local backend: a pool of worker processes on this machine.

def default_threads_per_worker(workers: int) -> int:
    """Split this machine's cores evenly between the workers (at least one thread each)."""
    return max(1, available_cpus() // max(1, workers))


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class LocalBackend:
    """``workers`` spawned processes, each running one pack at a time (``execute_runs``) with
    ``threads`` torch threads; results travel back to the sweep process."""

    def __init__(self, workers: int, *, device: str = "auto", threads: int | None = None,
                 **run_options: Any) -> None:
        from che_bench.run.runner import resolve_device

        self.workers = workers
        self.device = device
        self.on_gpu = resolve_device(device).type == "cuda"
        #: ``execute_runs`` keywords: checkpoint_dir, models_dir and the runtime options
        #: (``commands.run.runtime_options_from_args``).
        self.run_options = run_options
        self.threads = threads or default_threads_per_worker(workers)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def capacity(self) -> int:
        return self.workers

    def submit(self, configs: list[RunConfig], width: int | str) -> concurrent.futures.Future:
        return self._executor().submit(_run_in_worker, configs, width, self.device,
                                       self.run_options)

    def wait(self, handles):
        done, _ = concurrent.futures.wait(handles, return_when=concurrent.futures.FIRST_COMPLETED)
        finished = []
        for future in done:
            try:
                finished.append((future, future.result()))
            except concurrent.futures.process.BrokenProcessPool as exc:
                self._discard_pool()  # a worker died (e.g. killed for memory); start a new pool
                finished.append((future, RuntimeError(f"worker process died: {exc}")))
            except Exception as exc:  # noqa: BLE001 - recorded as the run's failure
                finished.append((future, exc))
        return finished

    def interrupt(self) -> None:
        if self._pool is None:
            return
        for process in list(self._pool._processes.values()):  # noqa: SLF001 - no public accessor
            try:
                os.kill(process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: forking a process that already runs torch threads can deadlock.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(self.threads, os.getpid(), self.workers),
            )
        return self._pool

    def _discard_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


_run_active = threading.Event()


def _init_worker(threads: int, sweep_pid: int, workers: int) -> None:
    """Worker set-up: torch threads, the GPU's memory shared by the workers, Ctrl-C
    handling, and an orphan watchdog."""
    import torch

    from che_bench.device_memory import share_gpu_among

    torch.set_num_threads(threads)
    share_gpu_among(workers)
    # Own process group: a Ctrl-C in the terminal reaches the sweep only, which then asks each
    # worker once to stop (a second SIGINT would abort training mid-step, without checkpoint).
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # between runs there is nothing to stop
    threading.Thread(target=_watch_sweep, args=(sweep_pid,), daemon=True).start()


def _run_in_worker(configs: list[RunConfig], width: int | str, device: str,
                   run_options: dict[str, Any]) -> list[RunResult]:
    """Runs in a worker; SIGINT stops them (training finishes its step and checkpoints)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _run_active.set()
    try:
        return execute_runs(configs, pack=width, device=device, progress=False, **run_options)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _run_active.clear()


def _watch_sweep(sweep_pid: int) -> None:
    """Exit when the sweep process is gone (killed, even with SIGKILL): a run in progress is
    stopped first so it saves its checkpoint. Without this, orphaned workers would live on."""
    while os.getppid() == sweep_pid:
        time.sleep(ORPHAN_POLL_S)
    if _run_active.is_set():
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while _run_active.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(1)
