"""The option checks of ``check-model`` and ``check-encoding``: every option a model or an
encoding takes changes what it is, so that two runs recorded with different options are two
models.

Each option, set to another value, must change the parameters (names, shapes or values, both
built after ``torch.manual_seed(0)``) or the logits (on the same inputs, in evaluation and in
training mode, with the same random draws), unless the class names it in ``inert_options``
(``BenchModel.inert_options``: by default the evaluation memory budget). The other value is
the first of ``other_values`` the class accepts; an option the class lists in
``option_choices`` is set to each of its choices instead, and each must be accepted. A string
option (or a sequence with no number in it) with no declared choices is a failure: the check
cannot make up a value for it, so the class must list them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch

from che_bench.errors import CheBenchError, one_line
from che_bench.model.architectures import build_architecture, get_architecture
from che_bench.model.base import BenchModel
from che_bench.model.encoder import Encoder, build_model
from che_bench.tasks import get_task

#: The task and lengths the logits are compared on: a short input and the longest training
#: length (an option such as a memory size may only matter on longer inputs).
TASK, LENGTHS, BATCH = "reverse_string", (12, 40), 3
#: The encoder an encoding's options are checked in: tiny (``check-encoding``'s size).
TINY_ENCODER = {"layers": 2, "dim": 16, "heads": 4, "ffn": 32}


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


def needs_choices(value: Any) -> bool:
    """Whether ``value`` is one whose alternatives only its class knows: a string, or a
    sequence with no number for ``other_values`` to change (empty, or of strings)."""
    return isinstance(value, (str, tuple, list)) and not other_values(value)


def option_failures(
    key: str,
    value: Any,
    choices: tuple[Any, ...] | None,
    build: Callable[[Any], Any],
    unchanged: Callable[[Any], bool],
    owner: str,
) -> list[str]:
    """The failures of option ``key`` (now ``value``): each declared choice (or else the
    first of ``other_values`` that ``build`` accepts, a CheBenchError refusing one) must build
    something ``unchanged`` calls changed. ``owner`` names the class ("model", "encoding")."""
    if choices is None:
        if needs_choices(value):
            return [
                f"options take effect: expected {key}={value!r} to be checked, got no value to "
                f"try: list the values it takes in the {owner} class's option_choices (or "
                "name it in inert_options if it changes nothing)"
            ]
        tried: list[tuple[Any, Any]] = []
        for candidate in other_values(value):
            try:
                tried = [(candidate, build(candidate))]
                break
            except CheBenchError:  # a value the class refuses: try the next one
                continue
    else:
        tried = []
        for choice in (choice for choice in choices if choice != value):
            try:
                tried.append((choice, build(choice)))
            except CheBenchError as exc:
                return [
                    f"options take effect: expected {key}={choice!r}, one of its "
                    f"option_choices, to build, got {one_line(exc)}"
                ]
    return [
        f"options take effect: expected {key}={other!r} (instead of {value!r}) to change the "
        "parameters or the logits, got the same ones (an option that changes neither, such as "
        f"a memory budget, belongs in the {owner} class's inert_options)"
        for other, built in tried
        if unchanged(built)
    ]


def check_options_take_effect(arch: str, options: dict[str, Any]) -> list[str]:
    """``option_failures`` of every option of ``arch`` (resolved ``options``) not in its
    class's ``inert_options``."""

    def build(**changed: Any) -> BenchModel:
        torch.manual_seed(0)
        return build_architecture(arch, get_task(TASK), **{**options, **changed})

    base = build()
    model_class = type(base)
    resolved = {**get_architecture(arch).defaults, **options}
    return _failures(base, resolved, model_class.inert_options, model_class.option_choices, build)


def check_encoding_options_take_effect(
    pe: str, options: dict[str, Any], causal: bool = False
) -> list[str]:
    """``option_failures`` of every option of encoding ``pe`` (resolved ``options``) not in
    its class's ``inert_options``, in the tiny encoder (``TINY_ENCODER``)."""

    def build(**changed: Any) -> Encoder:
        torch.manual_seed(0)
        task = get_task(TASK)
        return build_model(task, pe, None, **TINY_ENCODER, causal=causal, **options | changed)

    base = build()
    encoding = base.encoding
    recorded = encoding.options()  # (an option missing here fails the options check)
    resolved = {key: recorded[key] for key in encoding.option_names() if key in recorded}
    resolved.update(options)
    kind = type(encoding)
    return _failures(base, resolved, kind.inert_options, kind.option_choices, build, "encoding")


def _failures(
    base: BenchModel,
    resolved: dict[str, Any],
    inert: frozenset[str],
    choices: dict[str, tuple[Any, ...]],
    build: Callable[..., BenchModel],
    owner: str = "model",
) -> list[str]:
    base_outputs = _Outputs(base)

    def unchanged(other: BenchModel) -> bool:
        if _parameters_differ(base, other):
            return False
        return all(torch.equal(a, b) for a, b in zip(base_outputs, _Outputs(other), strict=True))

    failures = []
    for key, value in resolved.items():
        if key not in inert:
            failures += option_failures(
                key, value, choices.get(key), partial(_build_with, build, key), unchanged, owner
            )
    return failures


def _build_with(build: Callable[..., BenchModel], key: str, value: Any) -> BenchModel:
    return build(**{key: value})


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
