"""``che-bench table``, ``export``, ``plot``, ``report``, ``runs`` and ``evaluations``: read the
result store."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from che_bench.commands.common import (
    add_arch_filter_argument,
    add_store_argument,
    existing_store,
    runs_of_arch_filter,
    writable_output,
)
from che_bench.errors import CheBenchError
from che_bench.reports import COMPARISON_NAMES, FORMATS, METRICS


def register(subparsers: argparse._SubParsersAction) -> None:
    for register_command in (
        _register_table,
        _register_export,
        _register_plot,
        _register_report,
        _register_curves,
    ):
        register_command(subparsers)


def _register_table(subparsers: argparse._SubParsersAction) -> None:
    table = subparsers.add_parser("table", help="the CHE table of the store's complete runs")
    table.add_argument(
        "--compare",
        choices=["none", "paper", *COMPARISON_NAMES],
        default="none",
        help="paper: add the published DAPE V2 Table 6 value and the difference; grazzi (with "
        "--metric scaled): Grazzi et al.'s Table 3 (ICLR 2025) beside parity_check and both "
        "modular-arithmetic tasks; path, flip_flop (with --metric pooled): PaTH's Table 1 and "
        "Liu et al.'s flip-flop error rates; pd_ssm, slice, deltaproduct: PD-SSM's Table 3, "
        "SLiCE's Table 2, DeltaProduct's Figure 1 (results/reference/README.md)",
    )
    table.add_argument("--format", dest="fmt", choices=FORMATS, default="text")
    selection = table.add_mutually_exclusive_group()
    selection.add_argument(
        "--suite",
        help="only the runs of this suite file (or name in tasks/); its best_over applies "
        "unless --best-over is given",
    )
    _add_task_argument(selection, "only this task (repeatable)")
    _add_score_arguments(table)
    table.add_argument(
        "--best-over",
        action="append",
        metavar="OPTION[,OPTION]",
        help="architecture options whose values a cell takes the best over too: runs that "
        "differ only in them share a column '(best of K)', each cell naming its best "
        "configuration (the CHE paper's Tape-RNN: --best-over computation_steps_mult,n_tapes)",
    )
    table.add_argument(
        "--min-depth",
        action="store_true",
        help="Merrill et al.'s table instead: over runs that differ in their number of layers, "
        "the fewest layers reaching 90%% sequence accuracy at each test length k (text only)",
    )
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
    rows.add_argument(
        "--prefix",
        action="store_true",
        help="DeltaProduct's cumulative sequence accuracy: one row per run and output "
        "position t, the share of sequences with every scored position 0..t right (at the "
        "longest test length)",
    )
    export.add_argument("--out", help="output file (default or '-': standard output)")
    _add_score_arguments(export)
    add_store_argument(export)
    export.set_defaults(handler=export_command)


def _register_plot(subparsers: argparse._SubParsersAction) -> None:
    plot = subparsers.add_parser("plot", help="accuracy against length, one line per configuration")
    _add_task_argument(plot, "only this task (repeatable; default every task in the store)")
    plot.add_argument("--out", required=True, help="image file, e.g. accuracy.png")
    plot.add_argument(
        "--prefix",
        action="store_true",
        help="DeltaProduct's cumulative sequence accuracy against prefix length instead (at "
        "the longest test length; --metric does not apply)",
    )
    _add_score_arguments(plot)
    add_store_argument(plot)
    plot.set_defaults(handler=plot_command)


def _register_report(subparsers: argparse._SubParsersAction) -> None:
    report = subparsers.add_parser(
        "report", help="one self-contained HTML page: table, figures, what ran, how to reproduce"
    )
    selection = report.add_mutually_exclusive_group()
    selection.add_argument("--suite", help="the runs of this suite file (or name in tasks/)")
    _add_task_argument(selection, "the runs of this task (repeatable)")
    selection.add_argument(
        "--run",
        action="extend",
        nargs="+",
        dest="run_ids",
        metavar="RUN_ID",
        help="these runs (ids or unique id prefixes; default: every run in the store)",
    )
    report.add_argument("--out", required=True, help="HTML file, e.g. report.html")
    _add_score_arguments(report)
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


def _add_task_argument(parser: argparse._ActionsContainer, help: str) -> None:
    parser.add_argument("--task", action="append", dest="tasks", metavar="TASK", help=help)


def _add_score_arguments(parser: argparse.ArgumentParser) -> None:
    """Whose scores a table, export, plot or report shows: ``--arch`` (which runs),
    ``--evaluation`` and ``--metric``."""
    add_arch_filter_argument(parser)
    parser.add_argument(
        "--evaluation",
        default="original",
        metavar="ID|original",
        help="whose scores: each run's original evaluation (default) or the "
        "re-evaluations with this id (see `che-bench evaluations`)",
    )
    parser.add_argument(
        "--metric",
        choices=METRICS,
        default="token",
        help="token: per-token accuracy (default, as in the paper); exact (or sequence, "
        "its name in the word-problem papers): the share of sequences with every scored token "
        "right; scaled: (accuracy - chance) / (1 - chance), Grazzi et al.'s scaled accuracy; "
        "pooled: correct / scored tokens of all test sequences together (100 - it: "
        "flip-flop's read error)",
    )


def _write_text(text: str, out: str | None) -> Path | None:
    """``text`` to file ``out`` (returned), or to standard output when ``out`` is None or
    "-" (None returned)."""
    if out is None or out == "-":
        sys.stdout.write(text)
        return None
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    except OSError as exc:
        raise CheBenchError(f"cannot write {out}: {exc.strerror or exc}") from None
    return Path(out)


def table_command(args: argparse.Namespace) -> int:
    from che_bench.reports.best_of import parse_best_over
    from che_bench.reports.selection import select_runs, suite_best_over
    from che_bench.reports.tables import format_table

    store = existing_store(args.store)
    if args.min_depth:
        sys.stdout.write(_min_depth_text(store, args))
        return 0
    run_ids = runs_of_arch_filter(store, args.archs)
    best_over = parse_best_over(args.best_over)
    if args.suite is not None:
        runs, _ = select_runs(store, suite=args.suite, archs=args.archs)
        run_ids = list(runs["run_id"])
        best_over = best_over or suite_best_over(args.suite)
    sys.stdout.write(
        format_table(
            store,
            tasks=args.tasks,
            run_ids=run_ids,
            compare=args.compare,
            fmt=args.fmt,
            evaluation=args.evaluation,
            metric=args.metric,
            best_over=best_over,
        )
    )
    return 0


def _min_depth_text(store, args: argparse.Namespace) -> str:
    """``table --min-depth``: the options of the CHE table that do not apply are refused."""
    from che_bench.reports.min_depth import format_min_depth

    if args.compare != "none" or args.fmt != "text" or args.metric != "token" or args.best_over:
        raise CheBenchError(
            "--min-depth is a text table of sequence accuracy: --compare, --format, --metric "
            "and --best-over do not apply"
        )
    return format_min_depth(
        store,
        tasks=args.tasks,
        run_ids=runs_of_arch_filter(store, args.archs),
        evaluation=args.evaluation,
    )


def export_command(args: argparse.Namespace) -> int:
    from che_bench.reports.export import curves_frame, export_frame
    from che_bench.reports.prefix import prefix_frame

    if args.curves and (args.metric != "token" or args.evaluation != "original"):
        raise CheBenchError(
            "--curves exports training histories: --metric and --evaluation do not apply"
        )
    if args.prefix and args.metric != "token":
        raise CheBenchError("--prefix exports the prefix curves: --metric does not apply")
    if args.out not in (None, "-"):
        writable_output(args.out, "")
    store = existing_store(args.store)
    run_ids = runs_of_arch_filter(store, args.archs)
    if args.curves:
        frame = curves_frame(store, run_ids)
    elif args.prefix:
        frame = prefix_frame(store, run_ids, args.evaluation)
    else:
        frame = export_frame(
            store,
            per_length=args.per_length,
            run_ids=run_ids,
            evaluation=args.evaluation,
            metric=args.metric,
        )
    written = _write_text(frame.to_csv(index=False), args.out)
    if written is not None:
        print(f"wrote {written} ({len(frame)} rows)")
    return 0


def plot_command(args: argparse.Namespace) -> int:
    from che_bench.reports.plots import plot_accuracy
    from che_bench.reports.prefix import plot_prefix

    if args.prefix and args.metric != "token":
        raise CheBenchError("--prefix plots the prefix curves: --metric does not apply")
    writable_output(args.out, "plot")
    store = existing_store(args.store)
    if args.prefix:
        path = plot_prefix(
            store,
            args.out,
            tasks=args.tasks,
            run_ids=runs_of_arch_filter(store, args.archs),
            evaluation=args.evaluation,
        )
        print(f"wrote {path}")
        return 0
    path = plot_accuracy(
        store,
        args.out,
        tasks=args.tasks,
        run_ids=runs_of_arch_filter(store, args.archs),
        evaluation=args.evaluation,
        metric=args.metric,
    )
    print(f"wrote {path}")
    return 0


def curves_command(args: argparse.Namespace) -> int:
    from che_bench.reports.plots import plot_curves
    from che_bench.store import resolve_run_ids

    writable_output(args.out, "plot")
    store = existing_store(args.store)
    path = plot_curves(store, resolve_run_ids(store, args.run_ids), args.out)
    print(f"wrote {path}")
    return 0


def report_command(args: argparse.Namespace) -> int:
    from che_bench.commands.command_lines import run_command_line
    from che_bench.reports.html import write_report
    from che_bench.store import resolve_run_ids

    writable_output(args.out, "report")
    store = existing_store(args.store)
    run_ids = None if args.run_ids is None else resolve_run_ids(store, args.run_ids)
    path = write_report(
        store,
        args.out,
        command_line=run_command_line,
        suite=args.suite,
        tasks=args.tasks,
        run_ids=run_ids,
        archs=args.archs,
        evaluation=args.evaluation,
        metric=args.metric,
    )
    print(f"wrote {path}")
    return 0
