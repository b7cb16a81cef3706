"""The regular tasks of CHE: even_pairs, modular_arithmetic, parity_check, cycle_navigation."""

from __future__ import annotations

import numpy as np

from che_bench.tasks.base import Batch, Task, check_int_param, single_class
from che_bench.tasks.expressions import Vocabulary, evaluate
from che_bench.tasks.harness_layout import (
    CHE,
    HARNESS,
    HARNESS_MIN_LENGTH,
    answer_at_last,
    check_layout,
    layout_params,
)


class EvenPairs(Task):
    """n iid bits; class 0 iff the number of unequal neighbours (i, i+1) is even.

    That count is even exactly when the first and last bit agree; n = 1 gives class 0.

    Example: ``0 1 0 0 1 1 0`` has 4 unequal neighbours -> class 0.
    """

    name = "even_pairs"
    level = "regular"
    input_size = 2
    output_size = 2
    output_length_formula = "1"

    def output_length(self, n: int) -> int:
        return 1

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        inputs = rng.integers(0, 2, size=(batch_size, n))
        unequal_pairs = (inputs[:, 1:] != inputs[:, :-1]).sum(axis=1)
        return Batch(inputs, *single_class(unequal_pairs % 2))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return single_class(inputs[:, 0] != inputs[:, -1])


class ModularArithmetic(Task):
    """Bracket-free expression ``d op d op ... d`` mod ``modulus``; target = its value.

    Ids: digits ``0..m-1``, ``+`` = m, ``-`` = m+1, ``*`` = m+2, blank ``_`` = m+3
    (never sampled). Only odd input lengths exist: a requested even n yields n-1 tokens.
    Digits iid U{0..m-1}, operators iid uniform over {+, -, *}; ``*`` binds tighter,
    then left to right; the value is reduced to 0..m-1.

    Example (m = 5): n = 7, ``4 - 2 * 0 * 4`` -> 4 - 0 = 4 -> class 4; n = 6 gives
    5 tokens, e.g. ``3 + 4 + 0`` -> class 2.

    ``layout="harness"`` (``che_bench.tasks.harness_layout``): the expression then ``=`` (id
    m+3), n counting both: only even lengths exist (an odd n yields n-1 tokens), from n = 2;
    the answer is read at ``=``. Example: n = 6, ``3 + 4 + 0 =`` -> class 2 at ``=``.
    """

    name = "modular_arithmetic"
    level = "regular"
    output_length_formula = "1"
    listed_params = ({"layout": HARNESS},)

    def __init__(self, modulus: int = 5, layout: str = CHE) -> None:
        self.modulus = check_int_param(self.name, "modulus", modulus, 2)
        self.layout = check_layout(self.name, layout)
        equals = "=" if self.layout == HARNESS else "_"
        self.vocab = Vocabulary(
            self.modulus,
            {
                "+": self.modulus,
                "-": self.modulus + 1,
                "*": self.modulus + 2,
                equals: self.modulus + 3,
            },
        )
        self.input_size = self.modulus + 4
        self.output_size = self.modulus
        if self.layout == HARNESS:
            self.output_layout, self.output_length_formula = "in_place", "n"
            self.min_length = HARNESS_MIN_LENGTH
            self.output_size = self.modulus + 5  # the harness's vocabulary, padding included

    def params(self) -> dict:
        return {"modulus": self.modulus, **layout_params(self.layout)}

    @property
    def chance(self) -> float:
        return 1.0 / self.modulus

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return self.vocab.names(self.input_size)

    def input_length(self, n: int) -> int:
        odd = n if n % 2 else n - 1
        return odd if self.layout == CHE else (n if n % 2 == 0 else n - 1)

    def output_length(self, n: int) -> int:
        return 1 if self.layout == CHE else self.input_length(n)

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        expression_length = self.input_length(n) - (self.layout == HARNESS)
        inputs, values = self._expressions(expression_length, batch_size, rng)
        if self.layout == CHE:
            return Batch(inputs, *single_class(values))
        inputs = np.concatenate([inputs, np.full((batch_size, 1), self.modulus + 3)], axis=1)
        return Batch(inputs, *answer_at_last(inputs, values))

    def _expressions(
        self, length: int, batch_size: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """``batch_size`` expressions of ``length`` (odd) tokens and their values."""
        m = self.modulus
        terms = length // 2 + 1
        digits = rng.integers(0, m, size=(batch_size, terms))
        ops = rng.integers(0, 3, size=(batch_size, terms - 1))  # 0 +, 1 -, 2 *
        inputs = np.empty((batch_size, 2 * terms - 1), dtype=np.int64)
        inputs[:, 0::2] = digits
        inputs[:, 1::2] = m + ops
        # Left-to-right scan: `total` holds the finished additive terms, `term` the
        # product being built.
        total = np.zeros(batch_size, dtype=np.int64)
        term = digits[:, 0]
        for i in range(terms - 1):
            op, digit = ops[:, i], digits[:, i + 1]
            starts_term = op != 2
            total = np.where(starts_term, total + term, total)
            term = np.select([op == 0, op == 1], [digit, -digit], default=term * digit) % m
        return inputs, (total + term) % m

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.layout == CHE:
            return single_class(np.array([evaluate(row, self.vocab)[1] for row in inputs]))
        values = np.array([evaluate(row[:-1], self.vocab)[1] for row in inputs])
        return answer_at_last(inputs, values)


class ParityCheck(Task):
    """n iid bits; target = number of 1s mod 2.

    Example: ``0 1 0 0 1 1 0`` -> three 1s -> class 1.

    ``layout="harness"`` (``che_bench.tasks.harness_layout``): the answer read at the last
    bit, from n = 2; the same example -> class 1 at its last bit.
    """

    name = "parity_check"
    level = "regular"
    input_size = 2
    output_size = 2
    permutation_invariant = True
    output_length_formula = "1"
    listed_params = ({"layout": HARNESS},)

    def __init__(self, layout: str = CHE) -> None:
        self.layout = check_layout(self.name, layout)
        if self.layout == HARNESS:
            self.output_layout, self.output_length_formula = "in_place", "n"
            self.min_length = HARNESS_MIN_LENGTH
            self.output_size = 3  # the harness's vocabulary: padding and two bits

    def params(self) -> dict:
        return layout_params(self.layout)

    @property
    def chance(self) -> float:
        return 0.5

    def output_length(self, n: int) -> int:
        return 1 if self.layout == CHE else n

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        inputs = rng.integers(0, 2, size=(batch_size, n))
        parity = np.bitwise_xor.reduce(inputs, axis=1)
        if self.layout == HARNESS:
            return Batch(inputs, *answer_at_last(inputs, parity))
        return Batch(inputs, *single_class(parity))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        parity = inputs.sum(axis=1) % 2
        return answer_at_last(inputs, parity) if self.layout == HARNESS else single_class(parity)


class CycleNavigation(Task):
    """n iid actions on a cycle of ``cycle_length`` positions, starting at 0.

    Action id a moves by a-1: 0 = step left, 1 = stay, 2 = step right. Target = final
    position (sum of moves mod ``cycle_length``).

    Example (cycle 5): ``2 0 2 2 1 1 2`` -> +1-1+1+1+0+0+1 = 3 -> class 3.
    """

    name = "cycle_navigation"
    level = "regular"
    input_size = 3
    permutation_invariant = True
    output_length_formula = "1"

    def __init__(self, cycle_length: int = 5) -> None:
        self.cycle_length = check_int_param(self.name, "cycle_length", cycle_length, 2)
        self.output_size = self.cycle_length

    def params(self) -> dict:
        return {"cycle_length": self.cycle_length}

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return ("L", "S", "R")

    def output_length(self, n: int) -> int:
        return 1

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        inputs = rng.integers(0, 3, size=(batch_size, n))
        rights, lefts = (inputs == 2).sum(axis=1), (inputs == 0).sum(axis=1)
        return Batch(inputs, *single_class((rights - lefts) % self.cycle_length))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return single_class((inputs - 1).sum(axis=1) % self.cycle_length)
