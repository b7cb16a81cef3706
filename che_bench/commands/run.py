"""``che-bench run``: train and evaluate one configuration and record it in the store."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from che_bench.commands.common import (
    add_keep_model_argument,
    add_no_progress_argument,
    add_override_arguments,
    add_rerun_stale_argument,
    add_runtime_arguments,
    add_samples_arguments,
    add_store_argument,
    check_samples_arguments,
    overrides_from_args,
    run_directories,
    runtime_options_from_args,
    use_threads,
)
from che_bench.config import RunConfig, make_config
from che_bench.errors import CheBenchError
from che_bench.protocol import PRESETS, format_lengths
from che_bench.reports.text_tables import print_wrapped

if TYPE_CHECKING:  # imported when the command runs: torch loads only then
    from che_bench.run.options import RuntimeOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="train and evaluate one task/encoding/kernel (one run, or a table cell of seeds x "
        "learning rates) and record the result",
        description="Train on lengths <= train-max-length, evaluate on the test lengths, record "
        "the runs in the store and print their table row. With --seeds and/or --lrs the runs of "
        "one table cell train side by side as packs. Re-running an interrupted command "
        "resumes from its checkpoints.",
    )
    parser.add_argument("--task", required=True, help="task name (see `che-bench tasks`)")
    parser.add_argument(
        "--pe", default="none", help="positional encoding (see `che-bench encodings`)"
    )
    parser.add_argument("--kernel", type=int, help="DAPE kernel: 1 = DAPE, odd >= 3 = DAPE V2")
    parser.add_argument(
        "--preset",
        default="quick",
        choices=list(PRESETS),
        help="paper: published protocol (GPU); quick: CPU minutes; smoke: seconds; "
        "state_tracking: the xLSTM harness's; state_tracking_harness: with its batches, "
        "bf16 and read-out; deltaproduct, flip_flop, flip_flop_length, "
        "merrill: published state-tracking protocols (GPU; docs/protocol.md) "
        "(default: %(default)s)",
    )
    add_override_arguments(parser)
    cell = parser.add_argument_group("a table cell: several runs")
    cell.add_argument(
        "--seeds",
        metavar="START:STOP|S,S,...",
        help="initialisation seeds, e.g. 0:10 (seeds 0..9, STOP excluded) or 0,3,7; "
        "each run's data seed is its seed",
    )
    cell.add_argument("--lrs", metavar="LR,LR,...", help="learning rates, e.g. 1e-4,3e-4,5e-4")
    cell.add_argument(
        "--pack",
        default="auto",
        metavar="N|auto",
        help="runs trained side by side in one process (default auto: on a GPU as "
        "many as fit in its memory, on a CPU 1)",
    )
    add_keep_model_argument(parser)
    add_rerun_stale_argument(parser)
    add_runtime_arguments(parser)
    add_samples_arguments(
        parser,
        "after the runs, write each completed run's predictions on "
        "the first test sequences of every test length (needs the "
        "kept model)",
    )
    add_store_argument(parser)
    parser.add_argument(
        "--checkpoint-dir",
        help="checkpoint directory (default: NAME.checkpoints/ beside the store NAME.sqlite)",
    )
    add_no_progress_argument(parser)
    parser.set_defaults(handler=run_command)


def cell_configs(args: argparse.Namespace) -> list[RunConfig]:
    """The run's config, or one per seed x learning rate with ``--seeds`` / ``--lrs``."""
    if args.seeds is not None and args.seed is not None:
        raise CheBenchError("give either --seed or --seeds, not both")
    if args.lrs is not None and args.lr is not None:
        raise CheBenchError("give either --lr or --lrs, not both")
    seeds = parse_seeds(args.seeds) if args.seeds is not None else [args.seed]
    lrs = parse_learning_rates(args.lrs) if args.lrs is not None else [args.lr]
    overrides = overrides_from_args(args)
    if len(seeds) * len(lrs) > 1:
        if args.data_seed is not None:
            raise CheBenchError(
                "--data-seed applies to one run; with --seeds each run's data seed is its seed"
            )
        if overrides["length_seed"] is None:
            overrides["length_seed"] = 0
    return [
        make_config(
            args.task, args.pe, args.kernel, args.preset, **{**overrides, "seed": seed, "lr": lr}
        )
        for seed in seeds
        for lr in lrs
    ]


def parse_seeds(text: str) -> list[int]:
    """``START:STOP`` (STOP excluded) or a comma list of non-negative integers."""
    try:
        if ":" in text:
            start, stop = (int(part) for part in text.split(":"))
            seeds = list(range(start, stop))
        else:
            seeds = [int(part) for part in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise CheBenchError(
            f"--seeds takes START:STOP (e.g. 0:10) or distinct seeds S,S,...; got {text!r}"
        )
    return seeds


def parse_learning_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        rates = []
    if not rates or min(rates) <= 0 or len(set(rates)) != len(rates):
        raise CheBenchError(f"--lrs takes distinct positive learning rates LR,LR,...; got {text!r}")
    return rates


def run_command(args: argparse.Namespace) -> int:
    """The cell's runs as a sweep on the in-process backend (``che_bench.run.sweep.run_sweep``,
    the one execution path), reported as a run: what is done, each result, the table row."""
    from che_bench.run.packing import parse_pack_width

    # The arguments are checked before torch is imported (``che_bench.run.device``).
    width = parse_pack_width(args.pack)
    check_samples_arguments(args)
    if args.samples is not None and args.no_keep_model:
        raise CheBenchError("--samples reads the kept models: leave out --no-keep-model")
    configs = cell_configs(args)
    options = runtime_options_from_args(args)

    from che_bench.run.device import resolve_device
    from che_bench.run.sweep import InProcessBackend, run_sweep
    from che_bench.store import ResultStore

    resolve_device(options.device)  # a bad device fails before anything is written
    use_threads(options)
    store = ResultStore(args.store)
    options = options.with_changes(
        **run_directories(
            store,
            keep_models=not args.no_keep_model,
            checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        )
    )
    outcome = run_sweep(
        configs,
        store,
        partial(InProcessBackend, options),
        pack=width,
        view=RunView(store.path, configs[0], expect=partial(print_estimate, options, width)),
        rerun_stale=args.rerun_stale,
    )
    if args.samples is not None:
        _write_run_samples(args, store, outcome.run_ids)
    _print_table(store, outcome.run_ids)
    return 1 if outcome.failed else 0


def print_estimate(options: RuntimeOptions, width: int | str, todo: Sequence[RunConfig]) -> None:
    """The expected time of the runs ``todo`` (``che_bench.checks.run_estimate``), timed under
    the numerics they will run with, on standard error."""
    from che_bench.checks.run_estimate import estimate_runs
    from che_bench.run.device import (
        check_portable_device,
        configure_numerics,
        prepare_deterministic_cublas,
        resolve_device,
    )
    from che_bench.run.packing import packs_on

    device = resolve_device(options.device)
    check_portable_device(device, options.portable_cpu)
    if options.deterministic:
        prepare_deterministic_cublas()  # before the timing starts cuBLAS
    configure_numerics(options.tf32, options.deterministic, options.portable_cpu)
    try:
        line = estimate_runs(packs_on(todo, width, device), device, options.checkpoint_dir).line()
    except Exception as exc:  # the estimate is advice: the run goes on, and says why
        line = f"expected: not estimated ({type(exc).__name__}: {exc})"
    print_wrapped(line, file=sys.stderr)


def _print_table(store, run_ids: list[str]) -> None:
    from che_bench.reports.paper import paper_table_or_none
    from che_bench.reports.tables import format_table

    compare = "paper" if paper_table_or_none() is not None else "none"
    print(format_table(store, run_ids=run_ids, compare=compare), end="")


def _other_changes(config: RunConfig) -> str:
    """`` with NAME = VALUE, ...``: the settings the run changes from its preset besides
    those the header names anyway (steps, lengths), e.g. ``batch_lengths = "mixed"``."""
    from che_bench.reports.preset_changes import changes_from_preset

    shown = {"steps", "test_lengths", "train_eval_lengths"}
    changes = [(name, value) for name, value in changes_from_preset(config) if name not in shown]
    return " with " + ", ".join(f"{name} = {value}" for name, value in changes) if changes else ""


def _evaluated_lengths(config: RunConfig) -> str:
    """The lengths the evaluation goes through (its bar counts them all): the test lengths
    and the in-distribution ones."""
    lengths = set(config.test_lengths) | set(config.train_eval_lengths)
    return (
        f"evaluated at {len(lengths)} lengths: test {format_lengths(config.test_lengths)}, "
        f"in-distribution {format_lengths(config.train_eval_lengths)}"
    )


class RunView:
    """How ``che-bench run`` reports its sweep (``che_bench.run.sweep_views.SweepView``): the runs
    already complete, the runs starting and what they are expected to take (on standard
    error), then one line per result."""

    def __init__(
        self,
        store_path: Path,
        cell: RunConfig,
        expect: Callable[[Sequence[RunConfig]], None] | None = None,
    ) -> None:
        from che_bench.model.check import parameter_count
        from che_bench.reports.labels import run_model_label

        self.store_path = store_path
        self.label = f"{cell.task} / {run_model_label(cell.to_dict())}"
        self.parameters = parameter_count(
            cell.task, cell.task_params, cell.arch, cell.model_arguments()
        )
        #: Says, once the runs are announced, what they are expected to take.
        self.expect = expect

    def stale(self, notices: Sequence[str]) -> None:
        for notice in notices:
            print_wrapped(f"che-bench: {notice}", sys.stderr)

    def start(self, already_complete: Sequence[str], todo: Sequence[RunConfig]) -> None:
        if already_complete:
            print_wrapped(
                f"already complete in {self.store_path}: {', '.join(already_complete)} "
                f"({self.label})"
            )
        if not todo:
            return
        first = todo[0]
        several = f"{len(todo)} runs (seeds x learning rates), " if len(todo) > 1 else ""
        print_wrapped(
            f"run {', '.join(c.run_id() for c in todo)}: {self.label}, preset {first.preset}"
            f"{_other_changes(first)}, "
            f"{several}{first.steps} steps, lr {', '.join(sorted({f'{c.lr:g}' for c in todo}))}, "
            f"seed {', '.join(sorted({str(c.seed) for c in todo}, key=int))}, "
            f"{_evaluated_lengths(first)}, {self.parameters:,} parameters",
            file=sys.stderr,
        )
        if self.expect is not None:
            self.expect(todo)

    def __enter__(self) -> RunView:
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def update(self, *, running: int, left: int) -> None:
        pass

    def finished(self, result, *, running: int, left: int) -> None:
        if result.status != "complete":
            print_wrapped(f"che-bench: run {result.run_id} failed: {result.error}", sys.stderr)
            return
        timings = result.timings
        members = int(timings.get("pack_members", 1))
        packed = f" (in a pack of {members})" if members > 1 else ""
        print_wrapped(
            f"run {result.run_id} complete on {result.device}: score {result.score:.2%} "
            f"(test lengths {format_lengths(result.config.score_lengths)}), in-distribution "
            f"{result.train_accuracy:.2%}; train {timings['train_s']:.0f} s{packed}, "
            f"eval {timings['eval_s']:.0f} s"
        )


def _write_run_samples(args: argparse.Namespace, store, run_ids: list[str]) -> None:
    """``--samples``: the predictions of the cell's completed runs, from their kept models."""
    from che_bench.eval.predictions import write_samples
    from che_bench.run.device import resolve_device
    from che_bench.run.kept_models import load_model

    complete = store.completed_run_ids()
    done = [run_id for run_id in run_ids if run_id in complete]
    kept = [load_model(store.path, run_id) for run_id in done]
    written = write_samples(
        args.samples,
        done,
        [model for _, model in kept],
        [config for config, _ in kept],
        resolve_device(args.device),
        args.samples_per_length,
    )
    print(f"wrote {written} sample predictions to {args.samples}")
