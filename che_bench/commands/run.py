"""``che-bench run``: train and evaluate one configuration and record it in the store."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

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
    add_tf32_argument(parser)
    add_deterministic_argument(parser)
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
    """The flags that override preset fields (``make_config`` keywords)."""
    group = parser.add_argument_group("overrides of the preset")
    group.add_argument("--steps", type=int)
    group.add_argument("--batch-size", type=int)
    group.add_argument("--lr", type=float)
    group.add_argument("--seed", type=int, help="model-initialisation seed (default 0)")
    group.add_argument("--data-seed", type=int, help="training-data seed (default: --seed)")
    group.add_argument("--length-seed", type=int,
                       help="seed of the training-length schedule (default: one run draws its "
                            "lengths from its data seed; --seeds/--lrs use 0, so that the runs "
                            "share one schedule and can train as a pack)")
    group.add_argument("--test-lengths", help="e.g. 41:500, 41:500:20,500 or 41,100,500")
    group.add_argument("--train-eval-lengths", help="in-distribution lengths, or 'auto'")
    group.add_argument("--eval-samples", type=int, help="test sequences per length")
    group.add_argument("--eval-batch-size", type=int, help="sequences per accuracy sub-batch")
    group.add_argument("--train-max-length", type=int)
    group.add_argument("--layers", type=int)
    group.add_argument("--dim", type=int)
    group.add_argument("--heads", type=int)
    group.add_argument("--ffn", type=int, help="FFN width (default 4 x dim)")
    group.add_argument("--dropout", type=float)
    group.add_argument("--dape-width", type=int)
    group.add_argument("--dape-variant", help="concat_residual, concat or add_residual")
    group.add_argument("--pe-option", action="append", default=[], metavar="KEY=VALUE",
                       help="encoding option (repeatable); VALUE parsed as JSON when possible")
    group.add_argument("--task-param", action="append", default=[], metavar="KEY=VALUE",
                       help="task parameter (repeatable); VALUE parsed as JSON when possible")
    group.add_argument("--dropout-at-eval", action="store_true", default=None,
                       help="keep dropout on during evaluation (as the reference code does)")
    group.add_argument("--score-from-42", action="store_true", default=None,
                       help="average the score over 42..500 like the reference scripts")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``make_config`` keywords from the override flags (None = keep the preset's value)."""
    names = ("steps", "batch_size", "lr", "seed", "data_seed", "length_seed", "test_lengths",
             "train_eval_lengths", "eval_samples", "eval_batch_size", "train_max_length",
             "layers", "dim", "heads", "ffn", "dropout", "dape_width", "dape_variant",
             "dropout_at_eval", "score_from_42")
    overrides = {name: getattr(args, name) for name in names}
    overrides["pe_options"] = parse_key_values(args.pe_option, "--pe-option") or None
    overrides["task_params"] = parse_key_values(args.task_param, "--task-param") or None
    return overrides


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


def add_tf32_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tf32", action="store_true",
                        help="on a GPU, let matrix products and convolutions use TF32 (faster, "
                             "~1e-3 relative error; off by default, recorded with the runs)")


def add_deterministic_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic algorithms only (cuDNN, cuBLAS, attention): on a GPU "
                             "the same seeds give the same numbers again, a little slower; "
                             "recorded with the runs")


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

    from che_bench import runner
    from che_bench.kept_models import models_dir_for
    from che_bench.packing import parse_pack_width
    from che_bench.reports import encoding_label, format_table, paper_table_or_none
    from che_bench.store import ResultStore

    configs = cell_configs(args)
    width = parse_pack_width(args.pack)
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
    label = f"{first.task} / {encoding_label(first.pe, first.kernel)}"
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
        models_dir=models_dir, tf32=args.tf32, deterministic=args.deterministic,
        progress=not args.no_progress,
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
    compare = "paper" if paper_table_or_none() is not None else "none"
    print(format_table(store, run_ids=run_ids, compare=compare), end="")
    return 1 if any(result.status != "complete" for result in results) else 0
