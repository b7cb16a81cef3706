"""``che-bench selftest``: check a device against the CPU before trusting its results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from che_bench.commands import portable_reference
from che_bench.commands.common import (
    add_runtime_arguments,
    runtime_options_from_args,
    use_threads,
)
from che_bench.errors import CheBenchError

if TYPE_CHECKING:  # imported when the command runs: torch loads only then
    from rich.table import Table

    from che_bench.checks.selftest import SelftestReport


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "selftest",
        help="check that a device (a new GPU box) computes what the CPU does",
        description="(a) logits and gradients on the device vs the CPU for every encoding x "
        "DAPE kernel none/1/3 and DAPE V2 k = 5, 7 and causal, (b) packs vs their members "
        "alone for every built-in architecture, (c) a 100-step loss curve vs the CPU's, (d) "
        "step times of the paper-size model and estimated run and table-cell times, (e) "
        "--deterministic twice, (f) a few training steps of every built-in architecture on "
        "the device's own code path (a one-member LSTM: cuDNN's kernel) vs the CPU's batched "
        "loop, (g) evaluation at n = 500 on the device vs the CPU (the transformer's row "
        "chunks with DAPE, cuDNN's LSTM inference, greedy decoding, the state-tracking "
        "models' chunked forms), (h) a pack stopped after a checkpoint and resumed on the "
        "device vs the uninterrupted pack, (i) word problems and flip-flop: training losses, "
        "scored positions and scores (sequence, pooled, prefix) on the device vs the CPU. "
        "Exit 1 if any check disagrees.",
    )
    add_runtime_arguments(parser, ("device", "threads"))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small models, short lengths and fewer cases (about a minute on a CPU)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="write the full report here (to attach to a bug report)",
    )
    portable_reference.add_argument(parser)
    parser.set_defaults(handler=selftest_command)


def selftest_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from che_bench.checks.selftest import run_selftest
    from che_bench.run.device import resolve_device

    if args.portable_reference:
        return portable_reference.portable_reference_command(args)
    options = runtime_options_from_args(args)
    device = resolve_device(options.device)
    use_threads(options)
    if args.json is not None and args.json.parent and not args.json.parent.is_dir():
        raise CheBenchError(f"cannot write {args.json}: no directory {args.json.parent}")
    console = Console()
    if options.device == "auto" and device.type == "cpu":
        console.print(
            "no GPU found (--device auto): this is the CPU self-test, which checks "
            "che-bench's code paths against the CPU itself, not a GPU"
        )
    report = run_selftest(
        device, args.quick, on_check=lambda title: console.print(f"[dim]{title} ...[/]")
    )

    console.print(_cases_table(report))
    console.print(_speed_table(report))
    failed = [case for case in report.cases if not case.passed]
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        console.print(f"report written to {args.json}")
    verdict = (
        f"[bold red]{len(failed)} of {len(report.cases)} cases DIFFER[/]"
        if failed
        else f"[green]all {len(report.cases)} cases agree[/]"
    )
    console.print(f"{verdict} ({report.seconds:.0f} s)")
    return 1 if failed else 0


def _cases_table(report: SelftestReport) -> Table:
    """One row per check and subject, its quantities side by side: ``measured (<= tolerance)``."""
    from rich.table import Table

    table = Table(
        title=f"che-bench selftest on {report.device}{' (quick)' if report.quick else ''}"
    )
    for column in ("check", "subject", "measured (<= tolerance)", "result"):
        table.add_column(column)
    rows: dict[tuple[str, str], list] = {}
    for case in report.cases:
        rows.setdefault((case.check, case.subject), []).append(case)
    for (check, subject), cases in rows.items():
        measured = ", ".join(
            f"{case.quantity} {case.measured:.1e} (<= {case.tolerance:.0e})" for case in cases
        )
        errors = dict.fromkeys(case.error for case in cases if case.error)
        if errors:  # nothing measured: what failed instead
            measured = "error: " + "; ".join(errors)
        passed = all(case.passed for case in cases)
        table.add_row(
            check, subject, measured, "[green]ok[/]" if passed else "[bold red]DIFFERS[/]"
        )
    legends = dict.fromkeys(f"({case.check}) {case.what}" for case in report.cases)
    table.caption = "; ".join(legends)
    return table


def _speed_table(report: SelftestReport) -> Table:
    """(d): measured figures and labelled estimates."""
    from rich.table import Table

    table = Table(title="(d) speed on this device")
    for column in ("figure", "value", "kind", "note"):
        table.add_column(column)
    for figure in report.measurements:
        value = f"{figure.value:,.0f}" if figure.value >= 100 else f"{figure.value:.3g}"
        kind = "[bold]ESTIMATE[/]" if figure.kind == "estimate" else figure.kind
        table.add_row(figure.name, f"{value} {figure.unit}", kind, figure.note)
    return table
