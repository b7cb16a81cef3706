"""The task interface every generator implements.

A task turns a length ``n`` into a batch of (inputs, targets, mask) with token ids
exactly as in the reference CHE code, and can recompute targets and mask from the
inputs alone (``solve``, the oracle), independently of the sampler.

Subclasses implement ``_sample`` and ``_solve``; the public ``sample`` and ``solve``
validate their arguments first, so every task rejects bad lengths the same way.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.registry import Registry

LEVELS = ("regular", "dcf", "cs", "recall")


#: How an unscored output position is shown (``che-bench sample``, per-sample predictions).
MASKED = "·"


@dataclass(frozen=True)
class Batch:
    """One batch of a single length: ``inputs`` int64 ``[B, n_in]``, ``targets``
    int64 ``[B, output_length(n)]`` and ``mask`` bool (same shape as targets:
    the positions that count for accuracy; the loss uses every position)."""

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray


class SequenceSource(Protocol):
    """Where a task's ``sample`` draws from instead of its generator (``Task.draw_from``)."""

    def sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch | None:
        """A batch at length ``n``, or None: fresh sequences from the generator there."""


class Task(abc.ABC):
    """Base class: one subclass per task, with a docstring holding a worked example."""

    name: ClassVar[str]
    level: ClassVar[str]
    #: Number of input token ids (some ids may never be sampled, as in the reference).
    input_size: int
    #: Number of target classes.
    output_size: int
    #: Smallest length the sampler accepts.
    min_length: int = 1
    #: Largest length the sampler accepts (None: unbounded); set by tasks whose
    #: parameters cap it, e.g. the number of distinct keys of the recall probe.
    max_length: int | None = None
    #: True when the target depends only on the multiset of input tokens.
    permutation_invariant: ClassVar[bool] = False
    #: ``output_length(n)`` as a short formula, for listings ("1", "n+1", "ceil(n/2)"); set on
    #: the class (a task whose formula depends on its parameters refines it per instance).
    output_length_formula: str
    #: Where the model reads its outputs: "appended" (``output_length(n)`` placeholder tokens
    #: after the input, the CHE format) or "in_place" (one output per input position, no
    #: placeholders; then the loss, like the accuracy, counts the masked positions only). Set
    #: on the class, or per instance where a parameter decides it (``layout="harness"``).
    output_layout: str = "appended"
    #: Whether the task is defined with causal (decoder-style) attention: the default of the
    #: ``causal`` run setting for it (CHE's tasks: an encoder, bidirectional).
    causal: ClassVar[bool] = False
    #: What the length ``n`` of this task counts, for axis labels (refined per instance like
    #: ``output_length_formula``).
    length_label: str = "length n"
    #: Parameter sets ``che-bench tasks`` lists after the reference one (a parametrised
    #: task's published settings), each given by the parameters that differ from the defaults.
    listed_params: ClassVar[tuple[dict[str, Any], ...]] = ()
    #: Where ``sample`` draws from (None: the generator; ``tasks.sample_sets``).
    source: SequenceSource | None = None

    @property
    def chance(self) -> float:
        """Accuracy of uniform guessing over the output classes."""
        return 1.0 / self.output_size

    @property
    def input_symbols(self) -> tuple[str, ...]:
        """A readable name for every input id (index = id), for printing samples."""
        return tuple(str(i) for i in range(self.input_size))

    def input_length(self, n: int) -> int:
        """Number of input tokens for requested length ``n`` (``n`` except where a task says)."""
        return n

    @abc.abstractmethod
    def output_length(self, n: int) -> int:
        """Number of output positions for requested length ``n``."""

    def model_length(self, n: int) -> int:
        """Number of tokens the model reads at length ``n``: the input, plus the placeholders
        of the appended layout."""
        placeholders = 0 if self.output_layout == "in_place" else self.output_length(n)
        return self.input_length(n) + placeholders

    def ceiling(self, n: int) -> float | None:
        """Best accuracy a model that only sees the multiset of input tokens can reach
        at length ``n``: 1.0 for permutation-invariant tasks, None where unknown
        (the recall probes override this with their exact or simulated value)."""
        self.check_length(n)
        return 1.0 if self.permutation_invariant else None

    def sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        """A batch of ``batch_size`` sequences of requested length ``n``."""
        self.check_length(n)
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, (int, np.integer))
            or batch_size < 1
        ):
            raise CheBenchError(f"batch size must be a positive integer, got {batch_size!r}")
        drawn = None if self.source is None else self.source.sample(int(n), int(batch_size), rng)
        return drawn if drawn is not None else self._sample(int(n), int(batch_size), rng)

    def draw_from(self, source: SequenceSource) -> Task:
        """This task, its ``sample`` drawing from ``source`` where it has sequences."""
        self.source = source
        return self

    def solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(targets, mask) recomputed from ``inputs`` ``[B, n_in]`` alone (the oracle)."""
        inputs = np.asarray(inputs)
        if inputs.ndim != 2 or inputs.shape[1] == 0 or not np.issubdtype(inputs.dtype, np.integer):
            raise CheBenchError(f"{self.name}: inputs must be a non-empty 2-D integer array")
        if inputs.size and (inputs.min() < 0 or inputs.max() >= self.input_size):
            raise CheBenchError(f"{self.name}: input ids must lie in 0..{self.input_size - 1}")
        return self._solve(inputs.astype(np.int64))

    @abc.abstractmethod
    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        """``sample`` after validation."""

    @abc.abstractmethod
    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``solve`` after validation."""

    def check_length(self, n: int) -> None:
        """Raise a clear error for a length the task does not define."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < self.min_length:
            raise CheBenchError(
                f"task {self.name!r} needs an integer length >= {self.min_length}, got {n!r}"
            )
        if self.max_length is not None and n > self.max_length:
            raise CheBenchError(
                f"task {self.name!r} with {self.params()} supports lengths up to "
                f"{self.max_length}, got {n}"
            )

    def params(self) -> dict:
        """Constructor parameters, recorded with every run."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


class IidStringTask(Task):
    """n iid uniform tokens from ``vocab_size`` ids, one class per id; the target is a
    function of the whole string and every output position counts.

    Subclasses give that function twice: ``_sampler_targets`` (how the generator builds
    the target) and ``_oracle_targets`` (an independent recomputation for ``solve``).
    """

    def __init__(self, vocab_size: int = 2) -> None:
        self.vocab_size = check_int_param(self.name, "vocab_size", vocab_size, 2)
        self.input_size = self.output_size = self.vocab_size

    def params(self) -> dict:
        return {"vocab_size": self.vocab_size}

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        inputs = rng.integers(0, self.vocab_size, size=(batch_size, n))
        targets = self._sampler_targets(inputs)
        return Batch(inputs, targets, all_positions(targets))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        targets = self._oracle_targets(inputs)
        return targets, all_positions(targets)

    @abc.abstractmethod
    def _sampler_targets(self, inputs: np.ndarray) -> np.ndarray:
        """Sampler side: the targets of freshly drawn ``inputs``."""

    @abc.abstractmethod
    def _oracle_targets(self, inputs: np.ndarray) -> np.ndarray:
        """Oracle side: the targets recomputed from validated ``inputs``."""


def check_int_param(task_name: str, name: str, value: object, minimum: int) -> int:
    """``value`` as an int if it is an integer >= ``minimum``, else a CheBenchError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise CheBenchError(
            f"task {task_name!r}: parameter {name!r} must be an integer >= {minimum}, got {value!r}"
        )
    return int(value)


def check_choice_param(task_name: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a CheBenchError listing them."""
    if value not in choices:
        raise CheBenchError(
            f"task {task_name!r}: parameter {name!r} must be one of {', '.join(choices)}, got "
            f"{value!r}"
        )
    return str(value)


def all_positions(targets: np.ndarray) -> np.ndarray:
    """The all-ones accuracy mask of most tasks."""
    return np.ones(targets.shape, dtype=bool)


def single_class(classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(targets [B, 1], all-ones mask) from one class per row: the single-output tasks."""
    targets = np.asarray(classes).astype(np.int64).reshape(-1, 1)
    return targets, all_positions(targets)


def through_first(targets: np.ndarray, terminator: int) -> np.ndarray:
    """Accuracy mask keeping each row's positions up to and including its first ``terminator``."""
    first = np.argmax(targets == terminator, axis=1)
    return np.arange(targets.shape[1])[None, :] <= first[:, None]


def first_index(rows: np.ndarray, token: int | np.ndarray, what: str) -> np.ndarray:
    """Per row, the index of the first ``token`` (one id, or one per row as ``[B, 1]``);
    CheBenchError if a row has none."""
    found = rows == token
    if not found.any(axis=1).all():
        raise CheBenchError(f"malformed input: a row has no {what} (id {token})")
    return np.argmax(found, axis=1)


#: Every registered task class (built-ins and plugins), see ``register_task``.
TASKS: Registry[type[Task]] = Registry("task")


def register_task(*aliases: Any):
    """Class decorator: make a task available under its ``name`` and ``aliases``
    (``@register_task`` or ``@register_task("alias", ...)``; a name already taken, or a
    class without the task attributes, is a CheBenchError)."""

    def decorate(cls: type[Task]) -> type[Task]:
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise CheBenchError(f"register_task: {cls!r} is not a che_bench.tasks.Task subclass")
        missing = [
            name for name in ("name", "level", "output_length_formula") if not hasattr(cls, name)
        ]
        if missing:
            raise CheBenchError(f"task class {cls.__name__} does not set {', '.join(missing)}")
        TASKS.add(cls.name, cls, aliases)
        return cls

    if len(aliases) == 1 and isinstance(aliases[0], type):  # bare @register_task
        return decorate(aliases[0])
    return decorate
