"""``che-bench runs`` and ``che-bench evaluations``: what the result store holds."""

from __future__ import annotations

import argparse
import json

from che_bench.commands.common import (
    add_arch_filter_argument,
    add_store_argument,
    existing_store,
    runs_of_arch_filter,
)

#: The columns of ``che-bench runs``.
RUN_COLUMNS = (
    "run id",
    "task",
    "model",
    "params",
    "seed",
    "lr",
    "steps",
    "preset",
    "changed from preset",
    "status",
    "score %",
    "in-dist. %",
    "learned",
    "kept model",
    "finished / error",
)
#: The columns of ``che-bench evaluations``.
EVALUATION_COLUMNS = (
    "evaluation",
    "run id",
    "task",
    "model",
    "seed",
    "kind",
    "score %",
    "in-dist. %",
    "device",
    "evaluated",
    "protocol",
)
NUMERIC_COLUMNS = {"params", "seed", "lr", "steps", "score %", "in-dist. %"}
#: Columns of free text, wrapped at spaces where the terminal is narrow.
WRAPPED_COLUMNS = {
    "model",
    "changed from preset",
    "status",
    "finished / error",
    "protocol",
    "device",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """``runs`` and ``evaluations``: what the store holds."""
    runs = subparsers.add_parser("runs", help="list the store's runs and their status")
    add_arch_filter_argument(runs)
    add_store_argument(runs)
    runs.set_defaults(handler=runs_command)

    evaluations = subparsers.add_parser(
        "evaluations",
        help="list the store's evaluations (original and re-evaluations) and their ids",
    )
    evaluations.add_argument(
        "--run",
        action="extend",
        nargs="+",
        dest="run_ids",
        metavar="RUN_ID",
        help="only these runs' evaluations (ids or unique id prefixes)",
    )
    add_store_argument(evaluations)
    evaluations.set_defaults(handler=evaluations_command)


def runs_command(args: argparse.Namespace) -> int:
    from che_bench.reports.labels import run_model_label, run_parameters, run_task_label
    from che_bench.reports.stuck import STUCK_TEXT, stuck_runs
    from che_bench.store.files import MODELS, run_file

    store = existing_store(args.store)
    runs = store.runs(runs_of_arch_filter(store, args.archs))
    learning = stuck_runs(store).set_index("run_id")["stuck"]
    stuck = set(learning[learning].index)
    details = store.run_details(runs["run_id"])
    stale = _stale(store, runs)
    rows = [
        (
            run.run_id,
            run_task_label(run.config),
            run_model_label(run.config),
            _count(run_parameters(details[run.run_id])),
            run.seed,
            f"{run.lr:g}",
            run.steps,
            run.preset,
            _changed_from_preset(run.config),
            _status(run, store.path, stale),
            _percent(run.score),
            _percent(run.train_accuracy),
            _learned(learning.get(run.run_id)),
            "kept" if run_file(store.path, MODELS, run.run_id).is_file() else "-",
            _text(run.error if run.status == "failed" else run.finished_at),
        )
        for run in runs.itertuples(index=False)
    ]
    counts = runs["status"].value_counts().to_dict()
    _print(
        f"runs in {store.path}",
        [_column(name) for name in RUN_COLUMNS],
        rows,
        [", ".join(f"{counts.get(s, 0)} {s}" for s in ("complete", "failed", "started"))]
        + ([f"{len(stuck)} stuck: {STUCK_TEXT}"] if stuck else [])
        + ([f"{len(stale)} {STALE_TEXT}"] if stale else []),
    )
    return 0


#: The footer's note on stale runs (``che_bench.run.stale``).
STALE_TEXT = (
    "stale: made with another version or source of their plugin than the one installed here "
    "(che-bench run / sweep --rerun-stale reruns them)"
)


def _stale(store, runs) -> set[str]:
    """The complete runs among ``runs`` whose plugin changed since (``che_bench.run.stale``)."""
    from che_bench.run.stale import stale_runs

    used = store.run_plugins(runs.loc[runs["status"] == "complete", "run_id"])
    with_plugins = store.run_configs(run_id for run_id, plugins in used.items() if plugins)
    return set(stale_runs(with_plugins, store))


def _changed_from_preset(config: str) -> str:
    """The settings a run changed from its preset as a suite spells them (``name=value, ...``),
    besides those with a column of their own (seed, lr, steps)."""
    from che_bench.reports.preset_changes import stored_changes

    return ", ".join(f"{name}={value}" for name, value in stored_changes(config) if name != "steps")


def _status(run, store_path, stale: set[str]) -> str:
    """A run's status cell: a started run's checkpoint, a complete run's staleness."""
    if run.status == "started":
        return _started(run, store_path)
    return "complete, stale" if run.run_id in stale else run.status


def _started(run, store_path) -> str:
    """A started run's status: the step its checkpoint reached (``evaluate --checkpoint``
    evaluates it there), or that it has none."""
    from che_bench.config import RunConfig
    from che_bench.errors import CheBenchError
    from che_bench.store.files import CHECKPOINTS, run_file
    from che_bench.train.checkpoints import checkpoint_step

    config = RunConfig.from_dict(json.loads(run.config))
    try:
        step = checkpoint_step(run_file(store_path, CHECKPOINTS, run.run_id), config)
    except CheBenchError:
        return "started (checkpoint unreadable)"
    return f"started (checkpoint at step {step:,})" if step else "started (incomplete)"


def evaluations_command(args: argparse.Namespace) -> int:
    from che_bench.reports.labels import run_model_label
    from che_bench.store import resolve_run_ids

    store = existing_store(args.store)
    runs = store.runs().set_index("run_id")
    run_ids = None if args.run_ids is None else resolve_run_ids(store, args.run_ids)
    evaluations = store.evaluations(run_ids)
    rows = []
    for evaluation in evaluations.itertuples(index=False):
        run = runs.loc[evaluation.run_id]
        rows.append(
            (
                evaluation.evaluation,
                evaluation.run_id,
                run.task,
                run_model_label(run.config),
                run.seed,
                "original" if evaluation.original else "re-evaluation",
                _percent(evaluation.score),
                _percent(evaluation.train_accuracy),
                _text(evaluation.device),
                evaluation.created_at,
                evaluation.protocol,
            )
        )
    reevaluated = evaluations[~evaluations["original"]]
    summary = (
        f"{_counted(len(evaluations), 'evaluation')} of "
        f"{_counted(evaluations['run_id'].nunique(), 'run')}: "
        f"{_counted(len(reevaluated), 're-evaluation')} under "
        f"{_counted(reevaluated['evaluation'].nunique(), 'protocol')} "
        "(select one with --evaluation ID)"
    )
    _print(
        f"evaluations in {store.path}",
        [_column(name, key=name == "evaluation") for name in EVALUATION_COLUMNS],
        rows,
        [summary],
    )
    return 0


def _column(name: str, key: bool = False):
    """A column of ``runs`` or ``evaluations``: the run id (and ``key``) repeated in every
    column group, numbers right-aligned, free text wrapped at spaces."""
    from che_bench.reports.text_tables import Column

    return Column(
        name,
        right=name in NUMERIC_COLUMNS,
        key=key or name == "run id",
        wrap=name in WRAPPED_COLUMNS,
    )


def _print(title: str, columns: list, rows: list[tuple], footer: list[str]) -> None:
    """A listing fitted to the terminal's width (``che_bench.reports.text_tables``)."""
    from che_bench.reports.text_tables import fit_table, wrap

    lines = [*wrap(title), "", *fit_table(columns, rows), ""]
    for text in footer:
        lines += wrap(text, indent="  ")
    print("\n".join(lines))


def _learned(stuck: bool | None) -> str:
    """The ``learned`` cell of a run: whether its loss fell below the class-frequency
    baseline; "-" where no training history was kept."""
    if stuck is None:
        return "-"
    return "stuck" if stuck else "yes"


def _count(count: int | None) -> str:
    """A count with thousands separators, "-" where none was recorded."""
    return "-" if count is None else f"{count:,}"


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _text(value: str | float | None) -> str:
    """A stored text, or "" for NULL (None, or NaN in a pandas column)."""
    return "" if value is None or value != value else str(value)


def _percent(value: float | None) -> str:
    return "" if value is None or value != value else f"{100 * value:.2f}"
