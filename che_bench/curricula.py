"""Training-length curricula: the length each training step trains on, as a function of the
step (0 first, as CHE's training loop counts) and a random generator, defined as CHE's
``experiments/curriculum.py`` (google-deepmind/neural_networks_chomsky_hierarchy) defines
its four (``CURRICULUM_BUILDERS`` in its ``experiments/constants.py``):

* ``uniform`` (``UniformCurriculum``, che-bench's default): each step a length drawn
  uniformly from the task's minimum length to ``train_max_length``.
* ``fixed`` (``FixedCurriculum``): ``sequence_length`` at every step; draws nothing.
* ``regular_increase`` (``RegularIncreaseCurriculum``): at step t,
  ``initial_sequence_length + increase_amount * (t // increase_frequency)``; with
  ``sample_all_length``, ``increase_amount`` times an integer drawn uniformly from
  ``0..t // increase_frequency`` instead (nothing is drawn while that range is one value).
* ``reverse_exponential`` (``ReverseExponentialCurriculum``): a length drawn from the uniform
  curriculum's lengths with weights ``tau ** length``, normalised in float32 as CHE does.

The generator is the run's length generator (``che_bench.train.batches``), a numpy
``Generator``. Given a legacy ``RandomState`` instead, a curriculum draws exactly what CHE's
calls of ``np.random`` draw from it (``benchmarks/bench_architectures_check.py`` trains on
CHE's length sequence this way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np

from che_bench.errors import CheBenchError, accepted_text
from che_bench.setting_types import Validator, at_least, positive_number, true_or_false

#: The curricula, the default (the one every run had before curricula existed) first.
CURRICULA = ("uniform", "fixed", "regular_increase", "reverse_exponential")
UNIFORM = CURRICULA[0]

#: Each curriculum's options: CHE's constructor arguments, under CHE's names, but the lengths
#: to draw from (the task's minimum length to train_max_length here).
OPTIONS: dict[str, dict[str, Validator]] = {
    "uniform": {},
    "fixed": {"sequence_length": at_least(1)},
    "regular_increase": {
        "initial_sequence_length": at_least(1),
        "increase_frequency": at_least(1),
        "increase_amount": at_least(1),
        "sample_all_length": true_or_false,
    },
    "reverse_exponential": {"tau": positive_number},
}

Rng = np.random.Generator | np.random.RandomState


class Curriculum(Protocol):
    """A training-length curriculum (one of the classes below)."""

    def length(self, step: int, rng: Rng) -> int:
        """The training length of step ``step`` (0 first), drawn from ``rng`` if at all."""
        ...


def _integer(rng: Rng, low: int, high: int) -> int:
    """An integer drawn uniformly from ``low..high - 1`` the way numpy draws it: a Generator's
    ``integers`` (the uniform lengths every run drew before curricula existed), or a
    RandomState's ``randint`` (CHE's ``np.random.randint``)."""
    if isinstance(rng, np.random.RandomState):
        return int(rng.randint(low, high))
    return int(rng.integers(low, high))


@dataclass(frozen=True)
class Uniform:
    """CHE's ``UniformCurriculum`` over ``lengths``."""

    lengths: range

    def length(self, step: int, rng: Rng) -> int:
        return _integer(rng, self.lengths.start, self.lengths.stop)


@dataclass(frozen=True)
class Fixed:
    """CHE's ``FixedCurriculum``: one length, no draw."""

    sequence_length: int

    def length(self, step: int, rng: Rng) -> int:
        return self.sequence_length


@dataclass(frozen=True)
class RegularIncrease:
    """CHE's ``RegularIncreaseCurriculum``."""

    initial_sequence_length: int
    increase_frequency: int
    increase_amount: int
    sample_all_length: bool

    def length(self, step: int, rng: Rng) -> int:
        increases = step // self.increase_frequency
        if self.sample_all_length:
            # numpy's randint(0, 1) returns 0 without drawing, and so does this.
            increases = _integer(rng, 0, increases + 1)
        return self.initial_sequence_length + self.increase_amount * increases

    def longest(self, steps: int) -> int:
        """The longest length of a run of ``steps`` steps (that of its last step)."""
        return self.initial_sequence_length + self.increase_amount * (
            (steps - 1) // self.increase_frequency
        )


@dataclass(frozen=True)
class ReverseExponential:
    """CHE's ``ReverseExponentialCurriculum`` over ``lengths``."""

    lengths: range
    tau: float

    def weights(self) -> np.ndarray:
        """``tau ** length`` over the lengths, cast to float32 and normalised there (CHE's
        order of operations, so the probabilities match its bit for bit)."""
        weights = np.array(self.tau ** np.array(self.lengths), dtype=np.float32)
        return weights / np.sum(weights)

    def length(self, step: int, rng: Rng) -> int:
        # Generator.choice and RandomState.choice with p both draw one double and search the
        # cumulative sum, as CHE's np.random.choice.
        return int(rng.choice(np.array(self.lengths), p=self.weights()))


def _check_length(name: str, length: int, lengths: range) -> None:
    if length not in lengths:
        raise CheBenchError(
            f"curriculum option {name} must be a training length, "
            f"{lengths.start}..{lengths.stop - 1}, got {length}"
        )


def _fixed(options: dict[str, Any], lengths: range, steps: int) -> Fixed:
    # CHE's FixedCurriculum has no default; che-bench's: the longest training length.
    curriculum = Fixed(options.get("sequence_length", lengths.stop - 1))
    _check_length("sequence_length", curriculum.sequence_length, lengths)
    return curriculum


def _regular_increase(options: dict[str, Any], lengths: range, steps: int) -> RegularIncrease:
    # CHE's RegularIncreaseCurriculum has no defaults; its module docstring's example starts
    # at length 1 and increases it by 1. che-bench's: start at the task's minimum length,
    # increase by 1, and spread the increases evenly over the run, so that its last steps
    # train at train_max_length.
    initial = options.get("initial_sequence_length", lengths.start)
    _check_length("initial_sequence_length", initial, lengths)
    amount = options.get("increase_amount", 1)
    stages = (lengths.stop - 1 - initial) // amount + 1
    curriculum = RegularIncrease(
        initial,
        options.get("increase_frequency", -(-steps // stages)),
        amount,
        options.get("sample_all_length", False),
    )
    longest = curriculum.longest(steps)
    if longest >= lengths.stop:
        raise CheBenchError(
            f"curriculum regular_increase reaches length {longest} at step {steps - 1}, above "
            f"train_max_length {lengths.stop - 1} (raise increase_frequency or lower "
            "increase_amount)"
        )
    return curriculum


def _reverse_exponential(options: dict[str, Any], lengths: range, steps: int) -> ReverseExponential:
    if "tau" not in options:
        raise CheBenchError(
            "curriculum reverse_exponential needs its option tau (--curriculum-option "
            "tau=X: weights tau ** length; CHE gives it no default)"
        )
    curriculum = ReverseExponential(lengths, options["tau"])
    with np.errstate(all="ignore"):
        weights = curriculum.weights()
    if not np.all(np.isfinite(weights)):
        raise CheBenchError(
            f"curriculum option tau={curriculum.tau} gives no weights tau ** length over "
            f"{lengths.start}..{lengths.stop - 1} in float32 (CHE's precision)"
        )
    return curriculum


_BUILDERS: dict[str, Callable[[dict[str, Any], range, int], Curriculum]] = {
    "uniform": lambda options, lengths, steps: Uniform(lengths),
    "fixed": _fixed,
    "regular_increase": _regular_increase,
    "reverse_exponential": _reverse_exponential,
}


def build(name: str, options: dict[str, Any], lengths: range, steps: int) -> Curriculum:
    """Curriculum ``name`` over the training ``lengths`` of a run of ``steps`` steps, with
    ``options`` (checked, and defaults for those not given). Refuses, with a one-line
    CheBenchError, an unknown curriculum or option, a bad value, and a length outside
    ``lengths``."""
    if name not in OPTIONS:
        raise CheBenchError(f"curriculum must be one of {', '.join(CURRICULA)}, got {name!r}")
    known = OPTIONS[name]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise CheBenchError(
            f"curriculum {name} takes no option {', '.join(unknown)} ({accepted_text(known)})"
        )
    checked = {key: known[key](f"curriculum option {key}", value) for key, value in options.items()}
    return _BUILDERS[name](checked, lengths, steps)


def recorded_options(curriculum: Curriculum) -> dict[str, Any]:
    """The options that define ``curriculum`` (its defaults filled in), as a run records them;
    the uniform curriculum has none."""
    return {
        field.name: getattr(curriculum, field.name)
        for field in fields(curriculum)  # type: ignore[arg-type]
        if field.name != "lengths"
    }


def resolved_options(run_fields: dict[str, Any], min_length: int) -> dict[str, Any]:
    """The curriculum options a run records, from its settings (``curriculum``,
    ``curriculum_options``, ``train_max_length``, ``steps``) and its task's minimum length;
    refuses a training range without a length."""
    max_length = run_fields["train_max_length"]
    if max_length < min_length:
        raise CheBenchError(
            f"train_max_length {max_length} is below the task's minimum length {min_length}"
        )
    curriculum = build(
        run_fields["curriculum"],
        dict(run_fields["curriculum_options"]),
        range(min_length, max_length + 1),
        run_fields["steps"],
    )
    return recorded_options(curriculum)
