"""The majority task: which bit is more frequent."""

from __future__ import annotations

import numpy as np

from che_bench.tasks import Batch, Task, register_task, single_class

ZEROS, ONES, TIE = 0, 1, 2


@register_task("majority_vote")
class Majority(Task):
    """n iid bits; class 1 if ones outnumber zeros, 0 if zeros outnumber ones, 2 on a tie.

    It needs a counter (not a finite automaton) and no order at all: the target depends only
    on the multiset of bits, so a model without positions can solve it.

    Example: ``0 1 1 0 1`` has three ones and two zeros -> class 1; ``0 1 1 0`` -> class 2.
    """

    name = "majority"
    level = "dcf"
    input_size = 2
    output_size = 3
    permutation_invariant = True
    output_length_formula = "1"

    def output_length(self, n: int) -> int:
        return 1

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        inputs = rng.integers(0, 2, size=(batch_size, n))
        balance = np.sign(2 * inputs.sum(axis=1) - n)  # +1 more ones, -1 more zeros, 0 tie
        classes = np.choose(balance + 1, [ZEROS, TIE, ONES])
        return Batch(inputs, *single_class(classes))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ones = (inputs == 1).sum(axis=1)
        zeros = (inputs == 0).sum(axis=1)
        classes = np.where(ones > zeros, ONES, np.where(zeros > ones, ZEROS, TIE))
        return single_class(classes)
