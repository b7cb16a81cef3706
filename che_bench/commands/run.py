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
        help="train and evaluate one task/encoding/kernel and record the result",
        description="Train on lengths <= train-max-length, evaluate on the test lengths, record "
        "the run in the store and print its table row. Re-running an interrupted command "
        "resumes from its checkpoint.",
    )
    parser.add_argument("--task", required=True, help="task name (see `che-bench tasks`)")
    parser.add_argument("--pe", default="none", help="positional encoding (see `che-bench encodings`)")
    parser.add_argument("--kernel", type=int, help="DAPE kernel: 1 = DAPE, odd >= 3 = DAPE V2")
    parser.add_argument("--preset", default="quick", choices=list(PRESETS),
                        help="paper: published protocol (GPU); quick: CPU minutes; smoke: seconds")
    add_override_arguments(parser)
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
    names = ("steps", "batch_size", "lr", "seed", "data_seed", "test_lengths",
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


def run_command(args: argparse.Namespace) -> int:
    import torch

    from che_bench.reports import encoding_label, format_table, paper_table_or_none
    from che_bench.config import make_config
    from che_bench.runner import execute_run, resolve_device
    from che_bench.store import ResultStore

    config = make_config(args.task, args.pe, args.kernel, args.preset, **overrides_from_args(args))
    resolve_device(args.device)  # a bad device fails before anything is written
    if args.threads < 1:
        raise CheBenchError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    store = ResultStore(args.store)
    checkpoint_dir = writable_directory(
        Path(args.checkpoint_dir) if args.checkpoint_dir else store.path.parent / "checkpoints",
        "checkpoint directory",
    )
    run_id = config.run_id()
    label = f"{config.task} / {encoding_label(config.pe, config.kernel)}"
    if run_id in store.completed_run_ids():
        print(f"run {run_id} ({label}) is already complete in {store.path}:")
    else:
        store.mark_started(config)
        print(
            f"run {run_id}: {label}, preset {config.preset}, {config.steps} steps, "
            f"lr {config.lr:g}, seed {config.seed}, test lengths {format_lengths(config.test_lengths)}",
            file=sys.stderr,
        )
        result = execute_run(
            config, device=args.device, checkpoint_dir=checkpoint_dir, progress=not args.no_progress
        )
        store.record(result)
        if result.status != "complete":
            print(f"che-bench: run {run_id} failed: {result.error}", file=sys.stderr)
            return 1
        timings = result.timings
        print(
            f"run {run_id} complete on {result.device}: score {result.score:.2%} "
            f"(test lengths {format_lengths(config.score_lengths)}), in-distribution "
            f"{result.train_accuracy:.2%}; train {timings['train_s']:.0f} s, "
            f"eval {timings['eval_s']:.0f} s"
        )
    compare = "paper" if paper_table_or_none() is not None else "none"
    print(format_table(store, run_ids=[run_id], compare=compare), end="")
    return 0
