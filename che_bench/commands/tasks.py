"""``che-bench tasks`` (list the tasks) and ``che-bench sample`` (print samples of one task)."""

from __future__ import annotations

import argparse
import json

import numpy as np

from che_bench.commands.key_values import add_key_values_argument, parse_key_values
from che_bench.errors import CheBenchError
from che_bench.reports.text_tables import Column, fit_table, output_width, print_wrapped, wrap
from che_bench.tasks import TASKS, get_task, list_tasks
from che_bench.tasks.base import MASKED

#: The columns of ``che-bench tasks``.
TASK_COLUMNS = ("task", "level", "in size", "out size", "out length", "chance", "perm-inv", "min n")


def register(subparsers: argparse._SubParsersAction) -> None:
    listing = subparsers.add_parser(
        "tasks", help="list the tasks with their sizes and chance levels"
    )
    listing.set_defaults(handler=list_handler)

    sample = subparsers.add_parser("sample", help="print samples of one task")
    sample.add_argument("--task", required=True, help="task name (aliases and paper labels work)")
    sample.add_argument("--length", required=True, type=int, help="requested length n")
    sample.add_argument("--count", type=int, default=4, help="number of samples (default 4)")
    sample.add_argument("--seed", type=int, default=0, help="numpy seed (default 0)")
    sample.add_argument("--format", choices=("text", "jsonl"), default="text")
    add_key_values_argument(
        sample,
        "--param",
        "task parameter, e.g. --param value_mode=iid (repeatable; also --task-param, as `run`)",
        aliases=("--task-param",),
    )
    sample.set_defaults(handler=sample_handler)


def list_handler(args: argparse.Namespace) -> int:
    # A task named with several parameters wraps, its continuation indented under its name.
    columns = [
        Column(name, right=name not in ("task", "level", "out length"), key=name == "task")
        for name in TASK_COLUMNS[1:]
    ]
    columns.insert(0, Column(TASK_COLUMNS[0], key=True, wrap=True, indent="  "))
    rows = [
        (
            " ".join([name, *(f"{key}={value}" for key, value in listed.items())]),
            task.level,
            task.input_size,
            task.output_size,
            task.output_length_formula,
            f"{task.chance:.2%}",
            "yes" if task.permutation_invariant else "no",
            task.min_length,
        )
        for name in list_tasks()
        for listed in ({}, *TASKS.get(name).listed_params)
        for task in (get_task(name, **listed),)
    ]
    title = wrap(
        "che-bench tasks (reference parameters; a parametrised task also with its published "
        "settings, named by the parameters that differ, KEY=VALUE as --task-param takes them)"
    )
    print("\n".join([*title, "", *fit_table(columns, rows)]))
    return 0


def sample_handler(args: argparse.Namespace) -> int:
    if args.count < 1:
        raise CheBenchError(f"--count must be at least 1, got {args.count}")
    task = get_task(args.task, **parse_key_values(args.param, "--param"))
    batch = task.sample(args.length, args.count, np.random.default_rng(args.seed))
    if args.format == "jsonl":
        for inputs, targets, mask in zip(batch.inputs, batch.targets, batch.mask, strict=True):
            record = {
                "task": task.name,
                "length": args.length,
                "input": inputs.tolist(),
                "target": targets.tolist(),
                "mask": mask.astype(int).tolist(),
            }
            print(json.dumps(record))
        return 0
    symbols = task.input_symbols
    width = output_width()
    print_wrapped(
        f"{task!r}: n={args.length}, input tokens={task.input_length(args.length)}, "
        f"output positions={task.output_length(args.length)} ({MASKED} = not scored)"
    )
    for index, (inputs, targets, mask) in enumerate(
        zip(batch.inputs, batch.targets, batch.mask, strict=True)
    ):
        shown = [
            str(t) if keep else MASKED
            for t, keep in zip(targets.tolist(), mask.tolist(), strict=True)
        ]
        # Long samples wrap between tokens, each line of tokens indented past its label.
        print("\n".join(wrap(f"[{index}] {' '.join(symbols[t] for t in inputs)}", indent="    ")))
        print("\n".join("  " + line for line in wrap(f"-> {' '.join(shown)}", width - 2, "   ")))
    return 0
