"""Which runs a report or a table shows: those of a suite file, of some tasks, with some run
ids, or the whole store, narrowed to some architectures (``--suite``, ``--task``, ``--run``,
``--arch``)."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from che_bench.errors import CheBenchError
from che_bench.reports.labels import runs_of_architectures
from che_bench.reports.unregistered import task_names
from che_bench.store import ResultStore


def select_runs(
    store: ResultStore,
    *,
    suite: str | None = None,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    archs: Iterable[str] | None = None,
) -> tuple[pd.DataFrame, str]:
    """The runs (``store.runs()`` rows, every status) of a suite file, of some tasks, with
    some run ids, or (none given) the whole store, and a title for them; with ``archs``, only
    those of these architectures. Selecting nothing is a CheBenchError."""
    if sum(choice is not None for choice in (suite, tasks, run_ids)) > 1:
        raise CheBenchError("select runs by one of --suite, --task or --run")
    runs = store.runs()
    if suite is not None:
        from che_bench.run.suites import load_suite

        loaded = load_suite(suite)
        wanted = [config.run_id() for config in loaded.configs()]
        runs = runs[runs["run_id"].isin(wanted)]
        title, missing = f"suite {loaded.name}", f"of suite {loaded.path} ({len(wanted)} runs)"
    elif tasks is not None:
        names = sorted(task_names(tasks, runs["task"]))
        runs = runs[runs["task"].isin(names)]
        title = missing = f"task{'s' if len(names) > 1 else ''} {', '.join(names)}"
    elif run_ids is not None:
        run_ids = list(dict.fromkeys(run_ids))
        unknown = sorted(set(run_ids) - set(runs["run_id"]))
        if unknown:
            raise CheBenchError(f"no run {', '.join(unknown)} in {store.path}")
        runs = runs[runs["run_id"].isin(run_ids)]
        title = missing = f"run{'s' if len(run_ids) > 1 else ''} {', '.join(run_ids)}"
    else:
        title, missing = f"all runs in {store.path.name}", "at all"
    if archs is not None:
        runs = runs[runs["run_id"].isin(runs_of_architectures(runs, archs))]
        title = f"{title}, architecture{'s' if len(list(archs)) > 1 else ''} {', '.join(archs)}"
        missing = title
    if runs.empty:
        raise CheBenchError(f"no runs {missing} in {store.path}")
    return runs.reset_index(drop=True), title


def suite_best_over(suite: str | None) -> tuple[str, ...]:
    """The options a suite's table takes the best over (its ``best_over``)."""
    from che_bench.run.suites import load_suite

    return () if suite is None else load_suite(suite).best_over
