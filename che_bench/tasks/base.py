"""The task interface every generator implements.

A task turns a length ``n`` into a batch of (inputs, targets, mask) with token ids
exactly as in the reference CHE code, and can recompute targets and mask from the
inputs alone (``solve``, the oracle), independently of the sampler.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from che_bench.errors import CheBenchError

LEVELS = ("regular", "dcf", "cs", "recall")


@dataclass(frozen=True)
class Batch:
    """One batch of a single length: ``inputs`` int64 ``[B, n_in]``, ``targets``
    int64 ``[B, output_length(n)]`` and ``mask`` bool (same shape as targets:
    the positions that count for accuracy; the loss uses every position)."""

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray


class Task(abc.ABC):
    """Base class: one subclass per task, with a docstring holding a worked example."""

    name: ClassVar[str]
    level: ClassVar[str]
    #: Number of input token ids (some ids may never be sampled, as in the reference).
    input_size: int
    #: Number of target classes.
    output_size: int
    #: Smallest length the sampler accepts.
    min_length: ClassVar[int] = 1
    #: True when the target depends only on the multiset of input tokens.
    permutation_invariant: ClassVar[bool] = False

    @property
    def chance(self) -> float:
        """Accuracy of uniform guessing over the output classes."""
        return 1.0 / self.output_size

    def input_length(self, n: int) -> int:
        """Number of input tokens for requested length ``n`` (``n`` except where a task says)."""
        return n

    @abc.abstractmethod
    def output_length(self, n: int) -> int:
        """Number of output positions for requested length ``n``."""

    @abc.abstractmethod
    def sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        """A batch of ``batch_size`` sequences of requested length ``n``."""

    @abc.abstractmethod
    def solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(targets, mask) recomputed from ``inputs`` alone (the oracle)."""

    def check_length(self, n: int) -> None:
        """Raise a clear error for a length the task does not define."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < self.min_length:
            raise CheBenchError(
                f"task {self.name!r} needs an integer length >= {self.min_length}, got {n!r}"
            )

    def params(self) -> dict:
        """Constructor parameters, recorded with every run."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"
