"""``che-bench run``: train and evaluate one configuration and record it in the store."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from che_bench import settings
from che_bench.commands.key_values import parse_key_values
from che_bench.errors import CheBenchError
from che_bench.protocol import PRESETS, format_lengths


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
    parser.add_argument("--pe", default="none", help="positional encoding (see `che-bench encodings`)")
    parser.add_argument("--kernel", type=int, help="DAPE kernel: 1 = DAPE, odd >= 3 = DAPE V2")
    parser.add_argument("--preset", default="quick", choices=list(PRESETS),
                        help="paper: published protocol (GPU); quick: CPU minutes; smoke: seconds")
    add_override_arguments(parser)
    cell = parser.add_argument_group("a table cell: several runs")
    cell.add_argument("--seeds", metavar="START:STOP|S,S,...",
                      help="initialisation seeds, e.g. 0:10 (seeds 0..9, STOP excluded) or 0,3,7; "
                           "each run's data seed is its seed")
    cell.add_argument("--lrs", metavar="LR,LR,...", help="learning rates, e.g. 1e-4,3e-4,5e-4")
    cell.add_argument("--pack", default="auto", metavar="N|auto",
                      help="runs trained side by side in one process (default auto: on a GPU as "
                           "many as fit in its memory, on a CPU 1)")
    add_keep_model_argument(parser)
    add_runtime_arguments(parser)
    add_samples_arguments(parser, "after the runs, write each completed run's predictions on "
                                  "the first test sequences of every test length (needs the "
                                  "kept model)")
    parser.add_argument("--store", help="result store (default $CHE_BENCH_STORE or "
                        "results/che-bench.sqlite)")
    parser.add_argument("--checkpoint-dir",
                        help="checkpoint directory (default: checkpoints/ next to the store)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: these models are small, and extra "
                             "threads slowed steps 50x on a busy 2-core machine)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run_command)


def add_override_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that override preset fields (``make_config`` keywords), one per run setting
    of ``che_bench.settings`` that has a flag."""
    group = parser.add_argument_group("overrides of the preset")
    for setting in settings.run_settings():
        if setting.flag is not None:
            add_setting_argument(group, setting)


def add_samples_arguments(parser: argparse.ArgumentParser, help: str) -> None:
    """``--samples FILE`` (``che_bench.eval.predictions``) and how many sequences per length."""
    parser.add_argument("--samples", metavar="FILE.jsonl", help=help)
    parser.add_argument("--samples-per-length", type=int, default=8, metavar="N",
                        help="sequences per length with --samples (default 8)")


def check_samples_arguments(args: argparse.Namespace) -> None:
    """A bad ``--samples-per-length`` is refused before anything runs."""
    if args.samples is not None:
        from che_bench.eval.predictions import check_samples_per_length

        check_samples_per_length(args.samples_per_length)


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the runtime options of ``che_bench.settings`` (how runs execute)."""
    for setting in settings.settings_where(settings.RUNTIME):
        add_setting_argument(parser, setting)


def add_setting_argument(parser, setting: settings.Setting) -> None:
    """The command-line flag of one declared setting."""
    if setting.kind == settings.SWITCH and setting.where == settings.RUNTIME:
        parser.add_argument(setting.flag, dest=setting.name, action="store_true",
                            default=False, help=setting.help)
    elif setting.kind == settings.SWITCH:
        # --X / --no-X; None when neither is given, so that a preset's, a suite's or the
        # task's value is kept.
        parser.add_argument(setting.flag, dest=setting.name,
                            action=argparse.BooleanOptionalAction, default=None,
                            help=setting.help)
    elif setting.kind == settings.KEY_VALUES:
        parser.add_argument(setting.flag, dest=setting.name, action="append", default=[],
                            metavar=setting.metavar, help=setting.help)
    else:
        # Runtime options have no preset: their flag's default is the declared one.
        parser.add_argument(setting.flag, dest=setting.name, type=setting.kind,
                            default=setting.default if setting.where == settings.RUNTIME else None,
                            metavar=setting.metavar, help=setting.help)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``make_config`` keywords from the override flags (None = keep the preset's value)."""
    overrides = {}
    for setting in settings.run_settings():
        if setting.flag is None:
            continue
        value = getattr(args, setting.name)
        if setting.kind == settings.KEY_VALUES:
            value = parse_key_values(value, setting.flag) or None
        overrides[setting.name] = value
    return overrides


def runtime_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``execute_runs`` keywords from the runtime flags, checked: the tracker flags become one
    ``TrackerOptions`` (a missing tracker extra is a one-line error before anything runs)."""
    from che_bench.train.history import check_log_every
    from che_bench.run.trackers import TrackerOptions

    options = {setting.name: getattr(args, setting.name)
               for setting in settings.settings_where(settings.RUNTIME)}
    tensorboard, wandb = options.pop("tensorboard"), options.pop("wandb")
    options["trackers"] = None
    if tensorboard is not None or wandb is not None:
        options["trackers"] = TrackerOptions(tensorboard=tensorboard, wandb=wandb)
        options["trackers"].check()
    options["log_every"] = check_log_every(options["log_every"])
    return options


def writable_directory(path: Path, what: str) -> Path:
    """Create ``path`` if needed and check it is writable, or raise a one-line error."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheBenchError(f"cannot create {what} {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheBenchError(f"{what} {path} is not writable")
    return path


def add_keep_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-keep-model", action="store_true",
                        help="do not keep the trained weights (default: models/<run id>.pt beside "
                             "the store, for `che-bench evaluate` and `attention`)")


def cell_configs(args: argparse.Namespace) -> list:
    """The run's config, or one per seed x learning rate with ``--seeds`` / ``--lrs``."""
    from che_bench.config import make_config

    if args.seeds is not None and args.seed is not None:
        raise CheBenchError("give either --seed or --seeds, not both")
    if args.lrs is not None and args.lr is not None:
        raise CheBenchError("give either --lr or --lrs, not both")
    seeds = parse_seeds(args.seeds) if args.seeds is not None else [args.seed]
    lrs = parse_learning_rates(args.lrs) if args.lrs is not None else [args.lr]
    overrides = overrides_from_args(args)
    if len(seeds) * len(lrs) > 1:
        if args.data_seed is not None:
            raise CheBenchError("--data-seed applies to one run; with --seeds each run's data "
                                "seed is its seed")
        if overrides["length_seed"] is None:
            overrides["length_seed"] = 0
    return [
        make_config(args.task, args.pe, args.kernel, args.preset,
                    **{**overrides, "seed": seed, "lr": lr})
        for seed in seeds for lr in lrs
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
        raise CheBenchError(f"--seeds takes START:STOP (e.g. 0:10) or distinct seeds S,S,...; "
                            f"got {text!r}")
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
    import torch

    from che_bench.run import runner
    from che_bench.run.kept_models import models_dir_for
    from che_bench.run.packing import parse_pack_width
    from che_bench.reports.tables import format_table, paper_table_or_none, run_encoding_label
    from che_bench.store.result_store import ResultStore

    configs = cell_configs(args)
    width = parse_pack_width(args.pack)
    runtime_options = runtime_options_from_args(args)
    check_samples_arguments(args)
    if args.samples is not None and args.no_keep_model:
        raise CheBenchError("--samples reads the kept models: leave out --no-keep-model")
    runner.resolve_device(args.device)  # a bad device fails before anything is written
    if args.threads < 1:
        raise CheBenchError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    store = ResultStore(args.store)
    checkpoint_dir = writable_directory(
        Path(args.checkpoint_dir) if args.checkpoint_dir else store.path.parent / "checkpoints",
        "checkpoint directory",
    )
    models_dir = None if args.no_keep_model else models_dir_for(store.path)
    run_ids = [config.run_id() for config in configs]
    first = configs[0]
    label = f"{first.task} / {run_encoding_label(first.to_dict())}"
    complete = store.completed_run_ids()
    todo = [config for config in configs if config.run_id() not in complete]
    if len(todo) < len(configs):
        done = ", ".join(run_id for run_id in run_ids if run_id in complete)
        print(f"already complete in {store.path}: {done} ({label})")
    for config in todo:
        store.mark_started(config)
    if todo:
        several = f"{len(todo)} runs (seeds x learning rates), " if len(todo) > 1 else ""
        print(
            f"run {', '.join(c.run_id() for c in todo)}: {label}, preset {first.preset}, "
            f"{several}{first.steps} steps, lr {', '.join(sorted({f'{c.lr:g}' for c in todo}))}, "
            f"seed {', '.join(sorted({str(c.seed) for c in todo}, key=int))}, "
            f"test lengths {format_lengths(first.test_lengths)}",
            file=sys.stderr,
        )
    results = runner.execute_runs(
        todo, pack=width, device=args.device, checkpoint_dir=checkpoint_dir,
        models_dir=models_dir, progress=not args.no_progress, **runtime_options,
    ) if todo else []
    for result in results:
        store.record(result)
        if result.status != "complete":
            print(f"che-bench: run {result.run_id} failed: {result.error}", file=sys.stderr)
            continue
        timings = result.timings
        members = int(timings.get("pack_members", 1))
        packed = f" (in a pack of {members})" if members > 1 else ""
        print(
            f"run {result.run_id} complete on {result.device}: score {result.score:.2%} "
            f"(test lengths {format_lengths(result.config.score_lengths)}), in-distribution "
            f"{result.train_accuracy:.2%}; train {timings['train_s']:.0f} s{packed}, "
            f"eval {timings['eval_s']:.0f} s"
        )
    if args.samples is not None:
        _write_run_samples(args, store, run_ids)
    compare = "paper" if paper_table_or_none() is not None else "none"
    print(format_table(store, run_ids=run_ids, compare=compare), end="")
    return 1 if any(result.status != "complete" for result in results) else 0


def _write_run_samples(args: argparse.Namespace, store, run_ids: list[str]) -> None:
    """``--samples``: the predictions of the cell's completed runs, from their kept models."""
    from che_bench.run.kept_models import load_model, models_dir_for
    from che_bench.run.runner import resolve_device
    from che_bench.eval.predictions import write_samples

    complete = store.completed_run_ids()
    done = [run_id for run_id in run_ids if run_id in complete]
    kept = [load_model(models_dir_for(store.path), run_id) for run_id in done]
    written = write_samples(args.samples, done, [model for _, model in kept],
                            [config for config, _ in kept], resolve_device(args.device),
                            args.samples_per_length)
    print(f"wrote {written} sample predictions to {args.samples}")
