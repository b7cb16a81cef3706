"""``che-bench table``, ``export``, ``plot``, ``report``, ``runs`` and ``evaluations``: read the
result store."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from che_bench.commands.common import add_store_argument
from che_bench.errors import CheBenchError
from che_bench.reports.tables import FORMATS, METRICS
from che_bench.store.run_prefixes import resolve_run_ids


def register(subparsers: argparse._SubParsersAction) -> None:
    for register_command in (
        _register_table,
        _register_export,
        _register_plot,
        _register_report,
        _register_curves,
        _register_listings,
    ):
        register_command(subparsers)


def _register_table(subparsers: argparse._SubParsersAction) -> None:
    table = subparsers.add_parser("table", help="the CHE table of the store's complete runs")
    table.add_argument(
        "--compare",
        choices=["none", "paper"],
        default="none",
        help="paper: add the published DAPE V2 Table 6 value and the difference",
    )
    table.add_argument("--format", dest="fmt", choices=FORMATS, default="text")
    table.add_argument(
        "--task", action="append", dest="tasks", metavar="TASK", help="only this task (repeatable)"
    )
    _add_evaluation_argument(table)
    _add_metric_argument(table)
    add_store_argument(table)
    table.set_defaults(handler=table_command)


def _register_export(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export", help="runs (or per-length accuracies, or training curves) as CSV"
    )
    export.add_argument("--format", choices=["csv"], default="csv")
    rows = export.add_mutually_exclusive_group()
    rows.add_argument(
        "--per-length", action="store_true", help="one row per run, split (test/train) and length"
    )
    rows.add_argument(
        "--curves",
        action="store_true",
        help="the training histories: one row per run and logged step (loss, "
        "training accuracy, gradient norm, lr, elapsed seconds)",
    )
    export.add_argument("--out", help="output file (default or '-': standard output)")
    _add_evaluation_argument(export)
    _add_metric_argument(export)
    add_store_argument(export)
    export.set_defaults(handler=export_command)


def _register_plot(subparsers: argparse._SubParsersAction) -> None:
    plot = subparsers.add_parser("plot", help="accuracy against length, one line per configuration")
    plot.add_argument(
        "--task",
        action="append",
        dest="tasks",
        metavar="TASK",
        help="only this task (repeatable; default every task in the store)",
    )
    plot.add_argument("--out", required=True, help="image file, e.g. accuracy.png")
    _add_evaluation_argument(plot)
    _add_metric_argument(plot)
    add_store_argument(plot)
    plot.set_defaults(handler=plot_command)


def _register_report(subparsers: argparse._SubParsersAction) -> None:
    report = subparsers.add_parser(
        "report", help="one self-contained HTML page: table, figures, what ran, how to reproduce"
    )
    selection = report.add_mutually_exclusive_group()
    selection.add_argument("--suite", help="the runs of this suite file (or name in tasks/)")
    selection.add_argument(
        "--task",
        action="append",
        dest="tasks",
        metavar="TASK",
        help="the runs of this task (repeatable)",
    )
    selection.add_argument(
        "--run",
        action="extend",
        nargs="+",
        dest="run_ids",
        metavar="RUN_ID",
        help="these runs (ids or unique id prefixes; default: every run in the store)",
    )
    report.add_argument("--out", required=True, help="HTML file, e.g. report.html")
    _add_evaluation_argument(report)
    _add_metric_argument(report)
    add_store_argument(report)
    report.set_defaults(handler=report_command)


def _register_curves(subparsers: argparse._SubParsersAction) -> None:
    curves = subparsers.add_parser(
        "curves", help="training loss and accuracy against step, several runs overlaid"
    )
    curves.add_argument(
        "run_ids",
        nargs="+",
        metavar="RUN_ID",
        help="runs to overlay (e.g. the seeds of one table cell); ids or unique id prefixes",
    )
    curves.add_argument("--out", default="curves.png", help="image file (default curves.png)")
    add_store_argument(curves)
    curves.set_defaults(handler=curves_command)


def _register_listings(subparsers: argparse._SubParsersAction) -> None:
    """``runs`` and ``evaluations``: what the store holds."""
    runs = subparsers.add_parser("runs", help="list the store's runs and their status")
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


def _add_evaluation_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--evaluation",
        default="original",
        metavar="ID|original",
        help="whose scores: each run's original evaluation (default) or the "
        "re-evaluations with this id (see `che-bench evaluations`)",
    )


def _add_metric_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metric",
        choices=METRICS,
        default="token",
        help="token: per-token accuracy (default, as in the paper); exact: "
        "exact match, the share of sequences with every scored token right",
    )


def existing_store(path: str | None, *, for_writing: bool = False):
    """Open an existing store, read-only unless ``for_writing`` (reading never modifies it);
    a missing file is an error rather than a new empty store."""
    from che_bench.store.result_store import ResultStore, default_store_path

    resolved = Path(path) if path else default_store_path()
    if not resolved.exists():
        raise CheBenchError(
            f"no result store at {resolved} (run `che-bench run` first or pass --store)"
        )
    return ResultStore(resolved, read_only=not for_writing)


def _write_text(text: str, out: str | None) -> Path | None:
    """``text`` to file ``out`` (returned), or to standard output when ``out`` is None or
    "-" (None returned)."""
    if out is None or out == "-":
        sys.stdout.write(text)
        return None
    try:
        Path(out).write_text(text)
    except OSError as exc:
        raise CheBenchError(f"cannot write {out}: {exc.strerror or exc}") from None
    return Path(out)


def table_command(args: argparse.Namespace) -> int:
    from che_bench.reports.tables import format_table

    store = existing_store(args.store)
    sys.stdout.write(
        format_table(
            store,
            tasks=args.tasks,
            compare=args.compare,
            fmt=args.fmt,
            evaluation=args.evaluation,
            metric=args.metric,
        )
    )
    return 0


def export_command(args: argparse.Namespace) -> int:
    from che_bench.reports.export import curves_frame, export_frame

    if args.curves and (args.metric != "token" or args.evaluation != "original"):
        raise CheBenchError(
            "--curves exports training histories: --metric and --evaluation do not apply"
        )
    store = existing_store(args.store)
    if args.curves:
        frame = curves_frame(store)
    else:
        frame = export_frame(
            store, per_length=args.per_length, evaluation=args.evaluation, metric=args.metric
        )
    written = _write_text(frame.to_csv(index=False), args.out)
    if written is not None:
        print(f"wrote {written} ({len(frame)} rows)")
    return 0


def plot_command(args: argparse.Namespace) -> int:
    from che_bench.reports.plots import plot_accuracy

    store = existing_store(args.store)
    path = plot_accuracy(
        store, args.out, tasks=args.tasks, evaluation=args.evaluation, metric=args.metric
    )
    print(f"wrote {path}")
    return 0


def curves_command(args: argparse.Namespace) -> int:
    from che_bench.reports.plots import plot_curves

    store = existing_store(args.store)
    path = plot_curves(store, resolve_run_ids(store, args.run_ids), args.out)
    print(f"wrote {path}")
    return 0


def report_command(args: argparse.Namespace) -> int:
    from che_bench.commands.command_lines import run_command_line
    from che_bench.reports.html import write_report

    store = existing_store(args.store)
    run_ids = None if args.run_ids is None else resolve_run_ids(store, args.run_ids)
    path = write_report(
        store,
        args.out,
        command_line=run_command_line,
        suite=args.suite,
        tasks=args.tasks,
        run_ids=run_ids,
        evaluation=args.evaluation,
        metric=args.metric,
    )
    print(f"wrote {path}")
    return 0


def runs_command(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from che_bench.reports.labels import run_encoding_label
    from che_bench.reports.stuck import STUCK_TEXT, stuck_runs
    from che_bench.run.kept_models import model_path, models_dir_for

    store = existing_store(args.store)
    runs = store.runs()
    learning = stuck_runs(store).set_index("run_id")["stuck"]
    stuck = set(learning[learning].index)
    models_dir = models_dir_for(store.path)
    table = Table(title=f"runs in {store.path}")
    numeric = {"seed", "lr", "steps", "score %", "in-dist. %"}
    for column in (
        "run id",
        "task",
        "encoding",
        "seed",
        "lr",
        "steps",
        "preset",
        "status",
        "score %",
        "in-dist. %",
        "learned",
        "model",
        "finished / error",
    ):
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
