"""``che-bench sweep SUITE``: run a suite's grid in parallel (local processes or Ray)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from che_bench.commands.common import (
    add_keep_model_argument,
    add_no_progress_argument,
    add_rerun_stale_argument,
    add_runtime_arguments,
    add_store_argument,
    run_directories,
    runtime_options_from_args,
)
from che_bench.errors import CheBenchError

#: What a numeric flag reads (`_number_at_least`).
Number = TypeVar("Number", int, float)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="run a suite of runs (tasks x encodings x kernels x seeds x lrs) in parallel",
        description="Expand a suite file into runs, skip those already complete in the store, "
        "run the rest in parallel and print the suite's table. Safe to kill and "
        "restart at any point: the grid finishes with no completed run repeated.",
    )
    parser.add_argument(
        "suite",
        metavar="SUITE",
        help="suite file (TOML), or the name of one in tasks/ (e.g. smoke)",
    )
    parser.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="local: a pool of worker processes (default); ray: Ray tasks",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="local: worker processes (default 1); "
        "ray: runs in flight at once (default: what fits the cluster)",
    )
    parser.add_argument(
        "--pack",
        default="1",
        metavar="N|auto",
        help="train up to N runs of a table cell (seeds x learning rates) side "
        "by side in one process; auto: as many as fit on a GPU, 1 on a "
        "CPU (default 1; runs need a length_seed to pack)",
    )
    add_keep_model_argument(parser)
    add_rerun_stale_argument(parser)
    add_runtime_arguments(parser)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the grid (count and runs, with their status) and run nothing",
    )
    add_store_argument(parser)
    _add_part_arguments(parser)
    _add_ray_arguments(parser)
    add_no_progress_argument(parser)
    parser.set_defaults(handler=run_sweep_command)


def _add_part_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that run a part of the grid: its first runs, or one shard of it."""
    parser.add_argument(
        "--max-runs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="start at most N of the runs still to do",
    )
    parser.add_argument(
        "--shard",
        metavar="K/N",
        help="run part K of N (from 0) of the grid, whole table cells dealt out in turn: one "
        "job of a SLURM array or of several clusters, each with its own --store, merged "
        "afterwards with `che-bench merge`",
    )


def _add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """The Ray backend's flags: the cluster and each task's resources."""
    parser.add_argument(
        "--address",
        default=None,
        metavar="auto|ray://HOST:PORT",
        help="ray: cluster to join (default: start a local Ray instance)",
    )
    parser.add_argument(
        "--num-cpus",
        type=_non_negative_float,
        default=None,
        metavar="X",
        help="ray: CPUs per run (default: suite [resources], else 1)",
    )
    parser.add_argument(
        "--num-gpus",
        type=_non_negative_float,
        default=None,
        metavar="X",
        help="ray: GPUs per task (a run, or a pack with --pack), fractions "
        "allowed (default on a cluster with GPUs: a run the suite's "
        "[resources] or 0.25, a pack 1; else 0)",
    )


def run_sweep_command(args: argparse.Namespace) -> int:
    from che_bench.run.packing import parse_pack_width
    from che_bench.run.shards import parse_shard, shard
    from che_bench.run.suites import load_suite

    _check_backend_flags(args)
    pack = parse_pack_width(args.pack)
    part = None if args.shard is None else parse_shard(args.shard)
    from che_bench.reports.text_tables import output_width

    console = Console(highlight=False, width=output_width())
    suite = load_suite(args.suite)
    configs = suite.configs()  # validates the whole grid before anything runs
    if part is not None:
        configs = shard(configs, *part)
    if args.dry_run:
        _print_grid(console, suite, configs, _store_if_any(args.store))
        return 0
    return _run_grid(args, suite, configs, pack, runtime_options_from_args(args), console)


def _run_grid(
    args: argparse.Namespace, suite, configs, pack: int | str, options, console: Console
) -> int:
    """The suite's runs through ``run_sweep`` (the one execution path), then its table."""
    from che_bench.config import unpackable
    from che_bench.reports.tables import format_table
    from che_bench.run.sweep import run_sweep
    from che_bench.store import ResultStore

    store = ResultStore(args.store)
    options = options.with_changes(**run_directories(store, keep_models=not args.no_keep_model))
    if args.backend == "local":
        make_backend = partial(_local_backend, args, options)
    else:
        make_backend = partial(_ray_backend, args, suite, options, pack != 1)
    console.print(
        f"suite [bold]{suite.name}[/]: {len(configs)} runs, {_preset_text(suite)}, "
        f"store {store.path}",
    )
    alone = unpackable(configs) if pack != 1 else 0
    if alone:
        console.print(
            f"note: {alone} runs have no length_seed and train alone; set "
            "length_seed in the suite's [overrides] to pack them"
        )
    outcome = run_sweep(
        configs,
        store,
        make_backend,
        pack=pack,
        max_runs=args.max_runs,
        console=console,
        live=options.progress,
        rerun_stale=args.rerun_stale,
    )
    complete = sum(result.status == "complete" for result in outcome.results)
    kept_stale = 0 if args.rerun_stale else len(outcome.stale)
    console.print(
        f"{outcome.total} runs: {outcome.already_complete} already complete"
        + (f" ({kept_stale} of them stale, kept: --rerun-stale reruns them)" if kept_stale else "")
        + f", {complete} completed now, {len(outcome.failed)} failed"
        + (f", {outcome.not_started} not started (--max-runs)" if outcome.not_started else "")
    )
    table = format_table(store, run_ids=outcome.run_ids, best_over=suite.best_over)
    console.print(table, markup=False, soft_wrap=True)
    for result in outcome.failed:
        console.print(f"[red]failed[/] {result.run_id}: {result.error}")
    return 1 if outcome.failed else 0


def _store_if_any(path: str | None):
    """The store at ``path`` (default location) if it exists: a dry run creates none."""
    from che_bench.store import ResultStore, default_store_path

    store_path = path or default_store_path()
    return ResultStore(store_path, read_only=True) if Path(store_path).is_file() else None


def _check_backend_flags(args: argparse.Namespace) -> None:
    if args.backend == "local" and (
        args.address or args.num_cpus is not None or args.num_gpus is not None
    ):
        raise CheBenchError("--address, --num-cpus and --num-gpus apply to --backend ray only")
    if args.backend == "ray" and args.threads is not None:
        raise CheBenchError("--threads applies to --backend local; Ray runs get --num-cpus threads")


def _local_backend(args: argparse.Namespace, options):
    from che_bench.run.sweep import LocalBackend

    # A bad or unavailable device fails here, not in every worker.
    return LocalBackend(args.workers or 1, options)


def _ray_backend(args: argparse.Namespace, suite, options, packed: bool):
    from che_bench.run.ray_backend import RayBackend

    num_cpus = args.num_cpus if args.num_cpus is not None else suite.resources.num_cpus
    # A suite's GPU share is per run; a pack sizes itself to a whole GPU unless told otherwise.
    suite_gpus = None if packed else suite.resources.num_gpus
    num_gpus = args.num_gpus if args.num_gpus is not None else suite_gpus
    return RayBackend(
        address=args.address,
        run_cpus=num_cpus,
        run_gpus=num_gpus,
        max_in_flight=args.workers,
        packed=packed,
        options=options,
    )


def _print_grid(console: Console, suite, configs, store) -> None:
    from che_bench.reports.text_tables import Column, fit_table
    from che_bench.run.stale import stale_runs
    from che_bench.run.sweep_views import describe_run

    run_ids = [config.run_id() for config in configs]
    statuses = {}
    if store is not None:
        runs = store.runs(run_ids)
        statuses = dict(zip(runs["run_id"], runs["status"], strict=False))
        complete = {
            run_id: config
            for run_id, config in zip(run_ids, configs, strict=True)
            if statuses.get(run_id) == "complete"
        }
        for run_id in stale_runs(complete, store):
            statuses[run_id] = "complete, stale (plugin changed)"
    console.print(
        f"suite {suite.name} ({suite.path}): {len(configs)} runs, {_preset_text(suite)}",
        markup=False,
    )
    columns = [
        Column("#", right=True, key=True),
        Column("run id", key=True),
        Column("status"),
        Column("run", wrap=True),
    ]
    rows = [
        (index, run_id, statuses.get(run_id, "to do"), describe_run(config))
        for index, (run_id, config) in enumerate(zip(run_ids, configs, strict=False), start=1)
    ]
    for line in fit_table(columns, rows, console.width):
        console.print(line, markup=False)
    done = sum(status.startswith("complete") for status in statuses.values())
    console.print(
        f"{len(configs)} runs: {done} complete in the store, {len(configs) - done} "
        "to run (dry run: nothing ran)"
    )


def _preset_text(suite) -> str:
    """The suite's preset and the settings its ``[overrides]`` change, as the file spells
    them (``preset quick with steps = 400``)."""
    changes = ", ".join(f"{name} = {json.dumps(value)}" for name, value in suite.overrides.items())
    return f"preset {suite.preset}" + (f" with {changes}" if changes else "")


def _number_at_least(
    kind: Callable[[str], Number], minimum: Number, what: str
) -> Callable[[str], Number]:
    """An argparse type: the text read as ``kind``, refused (``expected {what}``) when it is
    not one or is below ``minimum``."""

    def parse(text: str) -> Number:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _number_at_least(int, 1, "a positive integer")
_non_negative_float = _number_at_least(float, 0.0, "a number >= 0")
