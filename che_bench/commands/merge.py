"""``che-bench merge OUT IN...``: the runs of stores written by separate jobs in one store."""

from __future__ import annotations

import argparse
from pathlib import Path

from che_bench.commands.common import existing_store
from che_bench.errors import CheBenchError
from che_bench.reports.text_tables import print_wrapped


def register(subparsers: argparse._SubParsersAction) -> None:
    merge = subparsers.add_parser(
        "merge",
        help="merge result stores written by separate jobs (SLURM arrays, clusters) into one",
        description="Copy every run of the IN stores (only read) into OUT (created when new), "
        "with their kept models and checkpoints. A run in several stores is kept once: the "
        "complete copy over a started or failed one; two complete copies with different "
        "results are a conflict, listed, and OUT keeps its own (exit status 1).",
    )
    merge.add_argument("out", metavar="OUT.sqlite", help="the store to merge into")
    merge.add_argument("inputs", nargs="+", metavar="IN.sqlite", help="stores to merge from")
    merge.set_defaults(handler=merge_command)


def merge_command(args: argparse.Namespace) -> int:
    from che_bench.store import ResultStore
    from che_bench.store.merge import merge_stores

    inputs = [existing_store(path) for path in args.inputs]
    if Path(args.out).is_dir():
        raise CheBenchError(f"{args.out} is a directory: give the output store's file")
    out = ResultStore(args.out)
    report = merge_stores(out, inputs)
    print_wrapped(
        f"merged {len(inputs)} store{'s' if len(inputs) > 1 else ''} into {out.path}: "
        f"{len(report.added)} runs added, {len(report.identical)} already there with the "
        f"same results, {len(report.replaced)} started or failed runs replaced by complete "
        f"ones, {len(report.kept)} started or failed copies left out (the store's run kept), "
        f"{len(report.conflicts)} conflicts; {report.files} kept models and checkpoints copied"
    )
    for line in report.conflicts:
        print_wrapped(f"conflict: {line}")
    return 1 if report.conflicts else 0
