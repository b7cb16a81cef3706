"""The regular tasks of CHE: even_pairs, modular_arithmetic, parity_check, cycle_navigation."""

from __future__ import annotations

import numpy as np

from che_bench.tasks.base import Batch, Task, check_int_param, single_class
from che_bench.tasks.expressions import Vocabulary, evaluate


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
    """

    name = "modular_arithmetic"
    level = "regular"
    output_length_formula = "1"

    def __init__(self, modulus: int = 5) -> None:
        self.modulus = check_int_param(self.name, "modulus", modulus, 2)
        self.vocab = Vocabulary(
            self.modulus,
            {
                "+": self.modulus,
                "-": self.modulus + 1,
                "*": self.modulus + 2,
                "_": self.modulus + 3,
            },
        )
        self.input_size = self.modulus + 4
        self.output_size = self.modulus

    def params(self) -> dict:
        return {"modulus": self.modulus}

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return self.vocab.names(self.input_size)

    def input_length(self, n: int) -> int:
        return n if n % 2 else n - 1

    def output_length(self, n: int) -> int:
        return 1

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        m = self.modulus
        terms = self.input_length(n) // 2 + 1
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
        return Batch(inputs, *single_class((total + term) % m))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return single_class(np.array([evaluate(row, self.vocab)[1] for row in inputs]))


class ParityCheck(Task):
    """n iid bits; target = number of 1s mod 2.

    Example: ``0 1 0 0 1 1 0`` -> three 1s -> class 1.
    """

    name = "parity_check"
    level = "regular"
    input_size = 2
    output_size = 2
    permutation_invariant = True
    output_length_formula = "1"

    def output_length(self, n: int) -> int:
        return 1

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        inputs = rng.integers(0, 2, size=(batch_size, n))
        return Batch(inputs, *single_class(np.bitwise_xor.reduce(inputs, axis=1)))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return single_class(inputs.sum(axis=1) % 2)


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
