"""Fixed sample sets: Merrill, Petty & Sabharwal's data (jopetty/word-problem, "The Illusion
of State", ICML 2024; spec: shared/spec/word_problems.md 1.3 and 1.5) instead of fresh
sequences at every step.

Their generator writes one file per length m of ``samples`` distinct sequences (all of them
where there are fewer), and training on length k takes every file 2 <= m < k whole and 80% of
the length-k file, testing on the other 20%. Here the set of each length is drawn once from a
seed (``SampleSet``): the training batches draw from the training part (``TRAINING``), the
evaluation at k from the held-out part (``HELD_OUT``); every other length is evaluated on fresh
sequences (longer ones are never in training). A task draws from a set once given one
(``Task.draw_from``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.tasks.base import Batch, Task

#: Merrill et al.'s ``train_size`` (scikit-learn's train_test_split: floor(0.8 N) to train).
TRAIN_FRACTION = 0.8
#: The parts of a set a task draws from.
TRAINING, HELD_OUT = "training", "held-out"
#: Sets separate from the evaluation's fresh sequences of the same seed ("sets").
_SALT = 0x73657473
#: Draws without a new sequence, per sequence found, after which a set holds all there are.
EXHAUSTED = 20


class SampleSet:
    """``size`` distinct sequences of ``task`` at each length (as many as repeated draws find
    where there are fewer), drawn once from ``seed`` and that length, in random order; the
    set at ``split_length`` is split: its first ``floor(TRAIN_FRACTION * N)`` sequences train,
    the others are held out. Sets are made at their first use and kept (not pickled: a batch
    worker makes its own, the same)."""

    def __init__(self, task: Task, size: int, seed: int, split_length: int) -> None:
        self.task, self.size, self.seed, self.split_length = task, size, seed, split_length
        self._sets: dict[int, Batch] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_sets": {}}

    def sequences(self, n: int) -> Batch:
        """The whole set at length ``n`` (compact integer types)."""
        if n not in self._sets:
            rng = np.random.default_rng([self.seed, n, _SALT])
            self._sets[n] = _distinct_sequences(self.task, n, self.size, rng)
        return self._sets[n]

    def part(self, n: int, part: str) -> Batch:
        """The sequences of ``part`` at length ``n``: the whole set below the split length, its
        training or held-out share at it."""
        found = self.sequences(n)
        if n < self.split_length:
            if part == HELD_OUT:
                raise CheBenchError(f"length {n} has no held-out sequences (below the split)")
            return found
        count = len(found.inputs)
        trained = math.floor(TRAIN_FRACTION * count)
        if not 0 < trained < count:
            raise CheBenchError(
                f"sample set: length {n} has {count} distinct sequence(s) of task "
                f"{self.task.name!r}, too few to hold {1 - TRAIN_FRACTION:.0%} out"
            )
        rows = slice(0, trained) if part == TRAINING else slice(trained, count)
        return Batch(found.inputs[rows], found.targets[rows], found.mask[rows])


@dataclass(frozen=True)
class SetDraws:
    """Where a task's ``sample`` draws from: ``part`` of ``sample_set`` at the lengths that
    have it (``batch_size`` of its sequences, uniformly with replacement), fresh sequences
    at the others (held-out: every length but the split length; training: longer ones)."""

    sample_set: SampleSet
    part: str

    def sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch | None:
        """``batch_size`` sequences of the set at length ``n``; None where the set has none."""
        split = self.sample_set.split_length
        if n > split or (self.part == HELD_OUT and n != split):
            return None
        found = self.sample_set.part(n, self.part)
        rows = rng.integers(0, len(found.inputs), size=batch_size)
        return Batch(
            found.inputs[rows].astype(np.int64),
            found.targets[rows].astype(np.int64),
            found.mask[rows],
        )


def _distinct_sequences(task: Task, n: int, size: int, rng: np.random.Generator) -> Batch:
    """``size`` distinct sequences (by their inputs) of ``task`` at length ``n`` drawn from
    ``rng``, in random order: rounds of ``size`` draws until ``size`` are found, or until
    ``EXHAUSTED`` times as many draws as were found add none (then there are that many: all of
    them but with a chance below e^-20 each). Two sequences count as one when their 64-bit
    codes (``_codes``) are equal: distinct ones share one about once in 10^7 sets of 10^6."""
    task.check_length(n)
    multipliers = np.random.default_rng([n, _SALT]).integers(1, 2**63, size=task.input_length(n))
    kept = task._sample(n, size, rng)  # the generator itself, not a set it draws from
    kept = _rows(kept, np.sort(np.unique(_codes(kept.inputs, multipliers), return_index=True)[1]))
    idle = 0  # draws since the last new sequence
    while len(kept.inputs) < size and idle < EXHAUSTED * len(kept.inputs):
        merged = _joined(kept, task._sample(n, size, rng))
        _, first = np.unique(_codes(merged.inputs, multipliers), return_index=True)
        idle = idle + size if len(first) == len(kept.inputs) else 0
        kept = _rows(merged, np.sort(first)[:size])  # the kept ones, then new ones as drawn
    order = rng.permutation(len(kept.inputs))
    return Batch(_compact(kept.inputs[order]), _compact(kept.targets[order]), kept.mask[order])


def _codes(inputs: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
    """A 64-bit code of each row: its tokens (+1) times ``multipliers``, summed mod 2^64."""
    return (inputs.astype(np.uint64) + np.uint64(1)) @ multipliers.astype(np.uint64)


def _joined(first: Batch, second: Batch) -> Batch:
    return Batch(
        *(np.concatenate([a, b]) for a, b in zip(_arrays(first), _arrays(second), strict=True))
    )


def _rows(batch: Batch, rows: np.ndarray) -> Batch:
    return Batch(*(array[rows] for array in _arrays(batch)))


def _arrays(batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return batch.inputs, batch.targets, batch.mask


def _compact(ids: np.ndarray) -> np.ndarray:
    """``ids`` (non-negative) in the smallest unsigned type that holds them: a set of 10^6
    sequences of length 20 takes 20 MB of token ids instead of 160."""
    return ids.astype(np.min_scalar_type(int(ids.max(initial=0))))
