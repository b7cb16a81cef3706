"""``che-bench runs`` and ``che-bench evaluations``: what the result store holds."""

from __future__ import annotations

import argparse
import os
import sys

from che_bench.commands.common import (
    add_arch_filter_argument,
    add_store_argument,
    existing_store,
    runs_of_arch_filter,
)
from che_bench.store import resolve_run_ids

#: The columns of ``che-bench runs``.
RUN_COLUMNS = (
    "run id",
    "task",
    "model",
    "seed",
    "lr",
    "steps",
    "preset",
    "status",
    "score %",
    "in-dist. %",
    "learned",
    "kept model",
    "finished / error",
)


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
    from rich.markup import escape
    from rich.table import Table

    from che_bench.reports.labels import run_encoding_label
    from che_bench.reports.stuck import STUCK_TEXT, stuck_runs
    from che_bench.run.kept_models import model_path, models_dir_for

    store = existing_store(args.store)
    runs = store.runs(runs_of_arch_filter(store, args.archs))
    learning = stuck_runs(store).set_index("run_id")["stuck"]
    stuck = set(learning[learning].index)
    models_dir = models_dir_for(store.path)
    table = Table(title=f"runs in {store.path}")
    numeric = {"seed", "lr", "steps", "score %", "in-dist. %"}
    for column in RUN_COLUMNS:
        table.add_column(
            column,
            justify="right" if column in numeric else "left",
            no_wrap=True,
            min_width=_id_width(runs["run_id"]) if column == "run id" else None,
        )
    styles = {"complete": "green", "failed": "red", "started": "yellow"}
    for run in runs.itertuples(index=False):
        status = "started (incomplete)" if run.status == "started" else run.status
        table.add_row(
            escape(run.run_id),
            escape(run.task),
            escape(run_encoding_label(run.config)),
            str(run.seed),
            f"{run.lr:g}",
            str(run.steps),
            escape(run.preset),
            f"[{styles[run.status]}]{status}[/]",
            _percent(run.score),
            _percent(run.train_accuracy),
            _learned(learning.get(run.run_id)),
            "kept" if model_path(models_dir, run.run_id).is_file() else "-",
            escape(_text(run.error if run.status == "failed" else run.finished_at)),
        )
    console = _console()
    console.print(table)
    counts = runs["status"].value_counts().to_dict()
    console.print(", ".join(f"{counts.get(s, 0)} {s}" for s in ("complete", "failed", "started")))
    if stuck:
        console.print(f"{len(stuck)} stuck: {STUCK_TEXT}")
    return 0


def evaluations_command(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from che_bench.reports.labels import run_encoding_label

    store = existing_store(args.store)
    runs = store.runs().set_index("run_id")
    run_ids = None if args.run_ids is None else resolve_run_ids(store, args.run_ids)
    evaluations = store.evaluations(run_ids)
    table = Table(title=f"evaluations in {store.path}")
    whole = {
        "evaluation": _id_width(evaluations["evaluation"]),
        "run id": _id_width(evaluations["run_id"]),
    }
    for column in (
        "evaluation",
        "run id",
        "task",
        "encoding",
        "seed",
        "kind",
        "protocol",
        "score %",
        "in-dist. %",
        "device",
        "evaluated",
    ):
        table.add_column(
            column,
            justify="right" if column.endswith("%") or column == "seed" else "left",
            no_wrap=column != "protocol",
            min_width=whole.get(column),
        )
    for evaluation in evaluations.itertuples(index=False):
        run = runs.loc[evaluation.run_id]
        table.add_row(
            evaluation.evaluation,
            escape(evaluation.run_id),
            escape(run.task),
            escape(run_encoding_label(run.config)),
            str(run.seed),
            "original" if evaluation.original else "re-evaluation",
            escape(evaluation.protocol),
            _percent(evaluation.score),
            _percent(evaluation.train_accuracy),
            escape(_text(evaluation.device)),
            escape(evaluation.created_at),
        )
    console = _console()
    console.print(table)
    reevaluated = evaluations[~evaluations["original"]]
    console.print(
        f"{_counted(len(evaluations), 'evaluation')} of "
        f"{_counted(evaluations['run_id'].nunique(), 'run')}: "
        f"{_counted(len(reevaluated), 're-evaluation')} under "
        f"{_counted(reevaluated['evaluation'].nunique(), 'protocol')} "
        "(select one with --evaluation ID)"
    )
    return 0


def _console():
    """A console as wide as the terminal (or $COLUMNS); 240 columns into a pipe or file."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 240)


def _id_width(ids) -> int:
    """The width that shows every id of ``ids`` whole, however narrow the terminal."""
    return max((len(text) for text in ids), default=0)


def _learned(stuck: bool | None) -> str:
    """The ``learned`` cell of a run: whether its loss fell below the class-frequency
    baseline; "-" where no training history was kept."""
    if stuck is None:
        return "-"
    return "[red]stuck[/]" if stuck else "yes"


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _text(value: str | float | None) -> str:
    """A stored text, or "" for NULL (None, or NaN in a pandas column)."""
    return "" if value is None or value != value else str(value)


def _percent(value: float | None) -> str:
    return "" if value is None or value != value else f"{100 * value:.2f}"
