"""The conformance checks of a task (``che-bench check-task NAME``; run through
``che_bench.checks.conformance.run_task_check``): its oracle agrees with its samples, ids,
shapes and masks are what the model relies on, a seed gives the same data, bad lengths are
refused, its parameters round-trip. Each check returns its failures, one line each."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.tasks import Task, get_task

#: Lengths the sampler and oracle are compared at (those >= the task's minimum, and within
#: its maximum).
AGREEMENT_LENGTHS = (*range(1, 61), 64, 100, 128, 255, 256, 499, 500)


def _lengths(task: Task) -> list[int]:
    return [
        n
        for n in AGREEMENT_LENGTHS
        if n >= task.min_length and (task.max_length is None or n <= task.max_length)
    ]


def check_oracle_agrees(task: Task) -> list[str]:
    """``solve(inputs)`` reproduces the sampled targets and mask at every length 1..60 and
    at 64..500 (64 sequences each)."""
    rng = np.random.default_rng(1234)
    failures = []
    for n in _lengths(task):
        batch = task.sample(n, 64, rng)
        targets, mask = task.solve(batch.inputs)
        for what, got, expected in (
            ("targets", targets, batch.targets),
            ("mask", mask, batch.mask),
        ):
            if np.shape(got) != np.shape(expected) or not np.array_equal(got, expected):
                rows = np.shape(got) == np.shape(expected) and int(
                    (np.asarray(got) != expected).any(axis=1).sum()
                )
                failures.append(
                    f"sampler and oracle agree (n={n}): expected the sampled {what}, got "
                    + (f"other ones in {rows} of 64 rows" if rows else f"shape {np.shape(got)}")
                )
    return failures


def check_ids_shapes_masks(task: Task) -> list[str]:
    """Inputs ``[B, input_length(n)]`` with ids in 0..input_size-1, targets and a boolean mask
    ``[B, output_length(n)]`` with ids in 0..output_size-1, int64, a counted position in
    every row, and the sizes the model needs."""
    failures = []
    if not (
        isinstance(task.input_size, int)
        and isinstance(task.output_size, int)
        and task.input_size >= 1
        and task.output_size >= 2
    ):
        failures.append(
            f"sizes: expected integer input_size >= 1 and output_size >= 2, got "
            f"{task.input_size!r}, {task.output_size!r}"
        )
        return failures
    rng = np.random.default_rng(5)
    for n in _lengths(task)[::7] + _lengths(task)[-1:]:
        batch = task.sample(n, 16, rng)
        expected_in, expected_out = (16, task.input_length(n)), (16, task.output_length(n))
        found = [
            problem
            for problem in (
                _id_problem("input", batch.inputs, expected_in, task.input_size),
                _id_problem("target", batch.targets, expected_out, task.output_size),
            )
            if problem
        ]
        if batch.mask.shape != expected_out or batch.mask.dtype != bool:
            found.append(
                f"mask {batch.mask.dtype} {list(batch.mask.shape)} (expected bool "
                f"{list(expected_out)})"
            )
        elif not batch.mask.any(axis=1).all():
            found.append("a row with no counted position (expected at least one per row)")
        failures += [f"ids, shapes and masks (n={n}): {what}" for what in found]
    return failures


def _id_problem(what: str, ids: np.ndarray, shape: tuple[int, int], size: int) -> str | None:
    """What is wrong with a batch's ``what`` ids (input or target): not int64 of ``shape``, or
    an id outside ``0..size-1``; None when nothing."""
    if ids.shape != shape or ids.dtype != np.int64:
        return f"{what}s {ids.dtype} {list(ids.shape)} (expected int64 {list(shape)})"
    if ids.min() < 0 or ids.max() >= size:
        return f"{what} ids {ids.min()}..{ids.max()} (expected 0..{size - 1})"
    return None


def check_same_seed_same_data(task: Task) -> list[str]:
    """The same numpy seed gives the same batch; another seed gives other inputs."""
    n = max(task.min_length, min(20, task.max_length or 20))
    first, again, other = (task.sample(n, 16, np.random.default_rng(seed)) for seed in (5, 5, 6))
    failures = [
        f"same seed same data (n={n}): expected equal {field} for seed 5 twice, got different ones"
        for field in ("inputs", "targets", "mask")
        if not np.array_equal(getattr(first, field), getattr(again, field))
    ]
    if np.array_equal(first.inputs, other.inputs):
        failures.append(
            f"same seed same data (n={n}): expected other inputs for seed 6, got the same"
        )
    return failures


def check_bad_lengths_refused(task: Task) -> list[str]:
    """Lengths the task does not define (below its minimum, above its maximum, not an integer)
    are a CheBenchError from ``sample``."""
    bad: list[Any] = [task.min_length - 1, -3, 2.5, "7", True, None]
    if task.max_length is not None:
        bad.append(task.max_length + 1)
    failures = []
    for n in bad:
        try:
            task.sample(n, 4, np.random.default_rng(0))
        except CheBenchError:
            continue
        except Exception as exc:
            failures.append(
                f"bad lengths refused (n={n!r}): expected a CheBenchError, got {type(exc).__name__}"
            )
            continue
        failures.append(f"bad lengths refused (n={n!r}): expected a CheBenchError, got a batch")
    return failures


def check_params_round_trip(task: Task) -> list[str]:
    """``params()`` (recorded with every run) rebuilds the same task."""
    params = task.params()
    try:
        json.dumps(params)
        rebuilt = get_task(task.name, **params).params()
    except (TypeError, CheBenchError) as exc:
        return [f"params recorded: expected JSON parameters that rebuild the task, got {exc}"]
    return (
        []
        if rebuilt == params
        else [f"params recorded: expected {params} when rebuilt, got {rebuilt}"]
    )


TASK_CHECKS: dict[str, Callable[[Task], list[str]]] = {
    "oracle": check_oracle_agrees,
    "ids": check_ids_shapes_masks,
    "seed": check_same_seed_same_data,
    "lengths": check_bad_lengths_refused,
    "params": check_params_round_trip,
}
