"""Run a grid of RunConfigs in parallel, resumably, with one writer of the result store.

The scheduler (``run_sweep``) skips runs the store already has complete, groups the rest
into packs (runs of one table cell trained side by side, ``che_bench.run.packing``), keeps a
backend busy with the packs, and records every result as it arrives: the parent process is
the only writer of the store, each result is one atomic write, so a sweep killed at any
point (even with SIGKILL) and started again finishes the grid without losing or repeating
a completed run. Backends execute ``execute_runs``: ``InProcessBackend`` here (``che-bench
run``), ``LocalBackend`` in a pool of worker processes, ``che_bench.run.ray_backend.RayBackend``
as Ray tasks; all of them with one ``RuntimeOptions``. Interrupted runs resume
from their checkpoints (``checkpoint_dir_for(store)``); the grouping is deterministic, so a
restarted sweep forms the same packs, which resume together.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rich.console import Console

from che_bench import plugins
from che_bench.config import RunConfig, group_into_packs
from che_bench.outcomes import RunResult
from che_bench.run.local_backend import LocalBackend as LocalBackend  # the sweep's backends
from che_bench.run.options import RuntimeOptions
from che_bench.run.packing import AUTO, CPU_AUTO_WIDTH
from che_bench.run.provenance import plugin_origins, software_versions
from che_bench.run.runner import execute_runs
from che_bench.run.stale import stale_notice, stale_runs
from che_bench.run.sweep_views import GridView, SweepView
from che_bench.store.files import CHECKPOINTS, files_dir


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
    #: The run ids of the grid complete in the store before this call.
    complete_before: set[str] = field(default_factory=set)
    results: list[RunResult] = field(default_factory=list)
    not_started: int = 0
    #: Run id -> how its plugins changed, of the grid's complete runs whose plugin changed
    #: since (``che_bench.run.stale``): kept, or rerun with ``rerun_stale``.
    stale: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.run_ids)

    @property
    def failed(self) -> list[RunResult]:
        return [result for result in self.results if result.status != "complete"]


def checkpoint_dir_for(store) -> Path:
    """Where a store's runs checkpoint: ``NAME.checkpoints/`` beside the store file."""
    return files_dir(store.path, CHECKPOINTS)


def failed_result(config: RunConfig, error: BaseException | str) -> RunResult:
    """A failed RunResult for a run whose worker never returned one."""
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return RunResult(
        run_id=config.run_id(),
        config=config,
        status="failed",
        error=message.splitlines()[0] if message else "failed",
        versions=software_versions(config),
        plugins=plugins.provenance_of(*plugin_origins(config)),
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
    view: SweepView | None = None,
    rerun_stale: bool = False,
) -> SweepOutcome:
    """Execute every config not yet complete in ``store``; record results as they finish.
    The one execution path of ``che-bench sweep`` and ``che-bench run`` (the latter on an
    ``InProcessBackend``).

    ``make_backend()`` is called only when there is something to run. Runs of one table
    cell are submitted together, in packs of at most ``pack`` members; with ``"auto"`` a
    GPU backend gets whole cells (the worker sizes packs to its GPU's memory) and a CPU one
    packs of ``CPU_AUTO_WIDTH``. At most ``max_runs`` runs are started. ``view`` hears of it
    all (default ``GridView``: each finished run logged as one line on ``console``; with
    ``live`` and a terminal, a progress bar of done / running / failed / left and an ETA).
    Ctrl-C stops the runs in flight (they checkpoint), leaves them unrecorded and re-raises
    KeyboardInterrupt; so does any other error here (a failed write to a closed output, say),
    which is re-raised once they have stopped. The backend is closed on return. A complete run
    whose plugin changed since (``che_bench.run.stale``) is named to ``view`` in one line and
    kept, or, with ``rerun_stale``, run again (its stored result replaced when the new one is
    recorded).
    """
    view = view or GridView(console or Console(), live)
    outcome, todo = _split_grid(configs, store, max_runs, rerun_stale)
    view.stale([stale_notice(run_id, text, rerun_stale) for run_id, text in outcome.stale.items()])
    view.start([run_id for run_id in outcome.run_ids if run_id in outcome.complete_before], todo)
    if not todo:
        return outcome
    backend = make_backend()
    try:
        with view:
            _execute_packs(backend, _packs(todo, pack, backend), pack, store, outcome, view)
    except BaseException:
        # Also when the view's own exit failed (its output closed by the same Ctrl-C, as a
        # `tee` is): the runs must still be told to stop and checkpoint.
        backend.interrupt()
        raise
    finally:
        backend.close()
    return outcome


def _split_grid(
    configs: Sequence[RunConfig], store, max_runs: int | None, rerun_stale: bool
) -> tuple[SweepOutcome, list[RunConfig]]:
    """The outcome so far (runs complete in the store already, their stale ones among them
    unless ``rerun_stale``) and the runs to do now."""
    run_ids = [config.run_id() for config in configs]
    completed = store.completed_run_ids() & set(run_ids)
    by_id = dict(zip(run_ids, configs, strict=True))
    stale = stale_runs({run_id: by_id[run_id] for run_id in completed}, store)
    if rerun_stale:
        completed -= set(stale)
    todo = [
        config for config, run_id in zip(configs, run_ids, strict=False) if run_id not in completed
    ]
    outcome = SweepOutcome(
        run_ids=run_ids,
        already_complete=len(configs) - len(todo),
        complete_before=completed,
        stale=stale,
    )
    if max_runs is not None:
        outcome.not_started = max(0, len(todo) - max_runs)
        todo = todo[:max_runs]
    return outcome, todo


def _packs(todo: list[RunConfig], pack: int | str, backend: Backend) -> deque[list[RunConfig]]:
    """The runs to do, grouped into the packs submitted to ``backend``."""
    group_width = (None if backend.on_gpu else CPU_AUTO_WIDTH) if pack == AUTO else int(pack)
    return deque(group_into_packs(todo, group_width))


def _execute_packs(
    backend: Backend,
    queue: deque[list[RunConfig]],
    pack: int | str,
    store,
    outcome: SweepOutcome,
    view: SweepView,
) -> None:
    """Keep ``backend`` busy with the packs of ``queue``: mark each pack's runs started as it
    is submitted, record every result as it arrives."""
    in_flight: dict[Hashable, list[RunConfig]] = {}

    def running() -> int:
        return sum(len(members) for members in in_flight.values())

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


class InProcessBackend:
    """Runs each pack here, in this process, when ``wait`` asks for it (``che-bench run``:
    progress bars and Ctrl-C as in any Python call of ``execute_runs``)."""

    def __init__(self, options: RuntimeOptions) -> None:
        from che_bench.run.device import resolve_device

        self.options = options
        self.on_gpu = resolve_device(options.device).type == "cuda"
        self._submitted: dict[int, tuple[list[RunConfig], int | str]] = {}

    def capacity(self) -> int:
        return 1

    def submit(self, configs: list[RunConfig], width: int | str) -> int:
        handle = len(self._submitted)
        self._submitted[handle] = (configs, width)
        return handle

    def wait(self, handles):
        configs, width = self._submitted.pop(handles[0])
        return [(handles[0], execute_runs(configs, self.options, pack=width))]

    def interrupt(self) -> None:
        """Nothing runs in the background: the interrupted pack has checkpointed already."""

    def close(self) -> None:
        self._submitted.clear()
