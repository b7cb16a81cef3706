"""``che-bench check-encoding NAME``, ``check-task NAME`` and ``check-model NAME``: the
conformance checks of ``che_bench.checks.conformance`` and ``che_bench.checks.model_checks``
for any registered encoding, task or architecture (plugins included)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from che_bench.commands.common import add_runtime_arguments, runtime_options_from_args
from che_bench.commands.key_values import add_key_values_argument, parse_key_values
from che_bench.errors import one_line
from che_bench.reports.text_tables import print_wrapped
from che_bench.run.options import DEFAULT_THREADS


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_check_encoding(subparsers)
    _register_check_task(subparsers)
    _register_check_model(subparsers)


def _register_check_encoding(subparsers: argparse._SubParsersAction) -> None:
    encoding = subparsers.add_parser(
        "check-encoding",
        help="check that an encoding works as che-bench needs (exit 1 if not)",
        description="Shapes and finite outputs at training lengths and test lengths up to 500, "
        "every hook returns float32 for float32 inputs, the bias shape [M or 1, 1, H, R, T] "
        "(and None without carries_bias), the bias equal to the hook's reference_bias where "
        "it declares one, translation invariance of a relative encoding's logits and "
        "embeddings, a pack of 3 equals its members alone, row-chunked evaluation equals "
        "unchunked, state_dict round trip, options recorded, every option takes effect, a "
        "training step alone and with DAPE kernels 1 and 3, the memory budget at n = 500, "
        "random draws reproducible per seed; with --causal all of them in a causal model, "
        "and its logits causal. One line per failure, then the measured step time.",
    )
    encoding.add_argument("name", help="encoding name (see `che-bench encodings`)")
    add_key_values_argument(encoding, "--pe-option", "encoding option to check with (repeatable)")
    encoding.add_argument(
        "--causal",
        action="store_true",
        help="check the encoding in a causal (decoder-style) model, and that its logits at "
        "position t do not depend on what follows t",
    )
    add_runtime_arguments(encoding, ("threads",))
    encoding.set_defaults(handler=check_encoding_command)


def _register_check_task(subparsers: argparse._SubParsersAction) -> None:
    task = subparsers.add_parser(
        "check-task",
        help="check that a task works as che-bench needs (exit 1 if not)",
        description="Sampler and oracle agree at lengths 1..60 and up to 500, same seed same "
        "data, ids, shapes and masks in range, bad lengths refused, parameters recorded. "
        "One line per failure.",
    )
    task.add_argument("name", help="task name (see `che-bench tasks`)")
    add_key_values_argument(
        task,
        "--param",
        "task parameter to check with (repeatable; also --task-param, as `run`)",
        aliases=("--task-param",),
    )
    task.set_defaults(handler=check_task_command)


def _register_check_model(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser(
        "check-model",
        help="check that an architecture works as che-bench needs (exit 1 if not)",
        description="For an architecture other than the transformer (see check-encoding): "
        "shapes and finite outputs at training lengths and test lengths up to 500 (and on an "
        "in-place task), a pack of 3 equals its members alone and gives back each member's "
        "weights, state_dict round trip, options recorded (describe, build_options, build_key), "
        "every option takes effect (option_choices for strings), "
        "100 training steps reduce the loss, same seed same weights, logits independent of the "
        "batch, training and evaluation on the meta device (as on a GPU), causal outputs "
        "(causal_outputs) and forward equal to reference_forward where the model declares "
        "them. Built-in baselines are checked at tiny sizes, a plugin's model with its "
        "defaults. One line per failure, then the measured step time.",
    )
    model.add_argument("name", help="architecture name (see `che-bench models`)")
    add_key_values_argument(
        model, "--arch-option", "architecture option to check with (repeatable)"
    )
    add_runtime_arguments(model, ("threads",))
    model.set_defaults(handler=check_model_command)


def check_encoding_command(args: argparse.Namespace) -> int:
    from che_bench.checks import conformance
    from che_bench.encodings import build_encoding, canonical_encoding_name

    name = canonical_encoding_name(args.name)
    options = parse_key_values(args.pe_option, "--pe-option")
    threads = _threads(args)
    # Bad options are a usage error (exit 2), not a failed check.
    build_encoding(name, dim=16, heads=4, layers=1, train_max_tokens=40, **options)
    status = _report(
        f"encoding {name}{' (causal)' if args.causal else ''}",
        conformance.encoding_checks(args.causal),
        lambda check: conformance.run_encoding_check(check, name, options, causal=args.causal),
    )
    print_wrapped(
        _speed_line(
            lambda speed, cpu: speed.encoding_speed_line(name, options, args.causal, cpu, threads)
        )
    )
    return status


def check_task_command(args: argparse.Namespace) -> int:
    from che_bench.checks import conformance
    from che_bench.tasks import get_task

    task = get_task(args.name, **parse_key_values(args.param, "--param"))
    return _report(
        f"task {task.name}",
        conformance.TASK_CHECKS,
        lambda check: conformance.run_task_check(check, task),
    )


def check_model_command(args: argparse.Namespace) -> int:
    from che_bench.checks import model_checks
    from che_bench.model.architectures import build_architecture, canonical_architecture
    from che_bench.tasks import get_task

    name = canonical_architecture(args.name)
    given = parse_key_values(args.arch_option, "--arch-option")
    options = model_checks.check_options(name, given)
    # Bad options are a usage error (exit 2), not a failed check.
    build_architecture(name, get_task(model_checks.SHORT_TASK), **options)
    threads = _threads(args)
    status = _report(
        f"architecture {name}",
        model_checks.MODEL_CHECKS,
        lambda check: model_checks.run_model_check(check, name, options),
    )
    # A run's model: the options given over the defaults, not the checks' tiny sizes.
    print_wrapped(_speed_line(lambda speed, cpu: speed.model_speed_line(name, given, cpu, threads)))
    return status


def _threads(args: argparse.Namespace) -> int:
    """The torch threads a run given ``--threads`` would use (checked; 1 by default)."""
    return runtime_options_from_args(args).threads or DEFAULT_THREADS


def _speed_line(measure: Callable[[ModuleType, Any], str]) -> str:
    """``measure(che_bench.checks.speed, the CPU)``: the step time of a run's model, or why it
    could not be measured."""
    import torch

    from che_bench.checks import speed

    try:
        return measure(speed, torch.device("cpu"))
    except Exception as exc:  # a model that cannot train fails its checks already
        return f"speed: not measured ({type(exc).__name__}: {one_line(exc)})"


def _report(subject: str, checks: dict, run: Callable[[str], list[str]]) -> int:
    """Run every check, print one line per check (and per failure); 1 if any failed."""
    failed = 0
    for check in checks:
        start = time.perf_counter()
        failures = run(check)
        seconds = time.perf_counter() - start
        print(f"{'FAIL' if failures else 'ok  '} {check} ({seconds:.1f} s)")
        for line in failures:
            print(f"     {line}")
        failed += bool(failures)
    verdict = (
        f"{failed} of {len(checks)} checks failed" if failed else f"all {len(checks)} checks passed"
    )
    print(f"{subject}: {verdict}", file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0
