"""``check-model``'s option check: every option a model declares (its ``defaults``) changes
what the model is, so that two runs recorded with different options are two models.

Each option, set to another value (``other_values``), must change the model's parameters
(names, shapes or values, both built after ``torch.manual_seed(0)``) or its logits (on the
same inputs, in evaluation and in training mode), unless the model names it in
``inert_options`` (``BenchModel.inert_options``: by default the evaluation memory budget).
An option whose other values the model all refuses, or whose value is not a number, a flag
or a sequence of numbers, is not checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture, get_architecture
from che_bench.model.base import BenchModel
from che_bench.tasks import get_task

#: The task and lengths the logits are compared on: a short input and the longest training
#: length (an option such as a memory size may only matter on longer inputs).
TASK, LENGTHS, BATCH = "reverse_string", (12, 40), 3


def other_values(value: Any) -> list[Any]:
    """Values other than ``value``, the likeliest to be valid first: a flag flipped; an
    integer doubled, plus one, halved, minus one (0: 1, 2); a float doubled, halved (0.0:
    0.5, 0.1); a tuple or list with its first number changed so; none for anything else
    (a string, None)."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        candidates: list[Any] = [value * 2, value + 1, value // 2, value - 1] if value else [1, 2]
    elif isinstance(value, float):
        candidates = [value * 2, value / 2] if value else [0.5, 0.1]
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                return [
                    type(value)([*value[:index], other, *value[index + 1 :]])
                    for other in other_values(item)
                ]
        return []
    else:
        return []
    return [candidate for candidate in dict.fromkeys(candidates) if candidate != value]


def check_options_take_effect(arch: str, options: dict[str, Any]) -> list[str]:
    """One failure line per option of ``arch``'s (resolved ``options``) that, set to the
    first other value the model accepts, changes neither its parameters nor its logits."""
    base = _build(arch, options)
    resolved = {**get_architecture(arch).defaults, **options}
    inert = type(base).inert_options
    base_outputs = _Outputs(base)
    failures = []
    for key, value in resolved.items():
        if key in inert:
            continue
        other_value, other = _first_accepted(arch, options, key, value)
        if other is None or _parameters_differ(base, other):
            continue
        if any(not torch.equal(a, b) for a, b in zip(base_outputs, _Outputs(other), strict=True)):
            continue
        failures.append(
            f"options take effect: expected {key}={other_value!r} (instead of {value!r}) to "
            "change the parameters or the logits, got the same ones (an option that changes "
            "neither, such as a memory budget, belongs in the model class's inert_options)"
        )
    return failures


def _build(arch: str, options: dict[str, Any]) -> BenchModel:
    torch.manual_seed(0)
    return build_architecture(arch, get_task(TASK), **options)


def _first_accepted(
    arch: str, options: dict[str, Any], key: str, value: Any
) -> tuple[Any, BenchModel | None]:
    """The first of ``other_values(value)`` the model is built with, and that model."""
    for candidate in other_values(value):
        try:
            return candidate, _build(arch, {**options, key: candidate})
        except CheBenchError:  # a value the model refuses: try the next one
            continue
    return None, None


def _parameters_differ(first: BenchModel, second: BenchModel) -> bool:
    one, two = first.state_dict(), second.state_dict()
    return one.keys() != two.keys() or any(not torch.equal(one[key], two[key]) for key in one)


class _Outputs:
    """A model's logits on the compared inputs, computed once, when first iterated."""

    def __init__(self, model: BenchModel) -> None:
        self.model = model
        self.computed: list[torch.Tensor] | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.computed is None:
            self.computed = list(_logits(self.model))
        return iter(self.computed)


def _logits(model: BenchModel) -> Iterator[torch.Tensor]:
    task = get_task(TASK)
    for n in LENGTHS:
        inputs = torch.from_numpy(task.sample(n, BATCH, np.random.default_rng(0)).inputs.copy())
        for training in (False, True):
            model.train(training)
            torch.manual_seed(0)  # the same dropout, if any
            model.seed_draws([0])
            with torch.no_grad():
                yield model(inputs, evaluating=not training)
