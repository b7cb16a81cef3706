"""The context-sensitive tasks of CHE: duplicate_string, missing_duplicate_string, odds_first,
binary_addition, binary_multiplication, compute_sqrt, bucket_sort."""

from __future__ import annotations

import abc
import math

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.tasks.base import (
    Batch,
    IidStringTask,
    Task,
    all_positions,
    first_index,
    single_class,
    through_first,
)

SEPARATOR = TERMINATOR = 2


class DuplicateString(IidStringTask):
    """n iid tokens from ``vocab_size``; target = the input twice (2n positions).

    Example: ``0 1 1`` -> ``0 1 1 0 1 1``.
    """

    name = "duplicate_string"
    level = "cs"
    output_length_formula = "2n"

    def output_length(self, n: int) -> int:
        return 2 * n

    def _sampler_targets(self, inputs: np.ndarray) -> np.ndarray:
        return np.tile(inputs, 2)

    def _oracle_targets(self, inputs: np.ndarray) -> np.ndarray:
        return np.concatenate([inputs, inputs], axis=1)


class MissingDuplicateString(Task):
    """A bit string written twice with one position blanked; target = the blanked bit.

    Ids: 0, 1 bits; 2 = the blank; 3 = padding. n >= 2: h = n // 2 iid bits s, t = s s,
    blank index j ~ U{0..2h-1}, target t[j]; an odd n appends one 3. n = 1: input ``1``,
    class 1. The answer sits h positions away from the blank: t[j+h] if j < h else t[j-h].

    Example: n = 7, ``1 2 1 1 0 1 3`` -> s = 101, blank at j = 1 -> class 0.
    """

    name = "missing_duplicate_string"
    level = "cs"
    input_size = 4
    output_size = 2
    output_length_formula = "1"
    BLANK, PAD = 2, 3

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return ("0", "1", "_", "#")

    def output_length(self, n: int) -> int:
        return 1

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        if n == 1:
            return Batch(
                np.ones((batch_size, 1), dtype=np.int64), *single_class(np.ones(batch_size))
            )
        half = n // 2
        inputs = np.full((batch_size, n), self.PAD, dtype=np.int64)
        inputs[:, : 2 * half] = np.tile(rng.integers(0, 2, size=(batch_size, half)), 2)
        rows, blank = np.arange(batch_size), rng.integers(0, 2 * half, size=batch_size)
        missing = inputs[rows, blank]
        inputs[rows, blank] = self.BLANK
        return Batch(inputs, *single_class(missing))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        batch_size, n = inputs.shape
        if n == 1:
            return single_class(np.ones(batch_size))
        half = n // 2
        blank = first_index(inputs, self.BLANK, "blank")
        partner = np.where(blank < half, blank + half, blank - half)
        return single_class(inputs[np.arange(batch_size), partner])


class OddsFirst(IidStringTask):
    """n iid tokens from ``vocab_size``; target = the tokens at 0-based odd indices
    (1, 3, 5, ...) followed by those at even indices (0, 2, 4, ...), as the reference
    code does (its docstring shows the opposite order).

    Example: ``0 1 0 0 1 1 0`` -> ``1 0 1`` + ``0 0 1 0`` = ``1 0 1 0 0 1 0``.
    """

    name = "odds_first"
    level = "cs"
    output_length_formula = "n"

    def output_length(self, n: int) -> int:
        return n

    def _sampler_targets(self, inputs: np.ndarray) -> np.ndarray:
        return np.concatenate([inputs[:, 1::2], inputs[:, 0::2]], axis=1)

    def _oracle_targets(self, inputs: np.ndarray) -> np.ndarray:
        index = np.arange(inputs.shape[1])
        order = np.argsort(index % 2 == 0, kind="stable")  # odd indices sort first
        return inputs[:, order]


def _le_bits_to_ints(bits: np.ndarray) -> list[int]:
    """Each row of little-endian bits as a Python int."""
    packed = np.packbits(bits.astype(np.uint8), axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


def _ints_to_le_bits(numbers: list[int], width: int) -> np.ndarray:
    """Little-endian bits of each number, ``width`` positions per row (numbers must fit)."""
    nbytes = (width + 7) // 8
    raw = b"".join(number.to_bytes(nbytes, "little") for number in numbers)
    packed = np.frombuffer(raw, dtype=np.uint8).reshape(len(numbers), nbytes)
    return np.unpackbits(packed, axis=1, bitorder="little")[:, :width].astype(np.int64)


class _BinaryOperation(Task):
    """Shared input distribution of binary_addition and binary_multiplication.

    n >= 3: a ~ U{1..n-2}, b = n-1-a; A ~ U{1..2^a-1}, B ~ U{1..2^b-1}, written
    little-endian in exactly a and b bits (zero padding at the high end), input
    ``A-bits 2 B-bits``. n <= 2: a number N ~ U{0..2^n-2} in n little-endian bits and
    no separator. Target: the result in minimal little-endian bits, the terminator 2,
    then 0s; the accuracy mask keeps the positions up to and including the terminator.
    """

    level = "cs"
    input_size = 3
    output_size = 3

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        if n <= 2:
            numbers = rng.integers(0, 2**n - 1, size=batch_size).tolist()
            return Batch(_ints_to_le_bits(numbers, n), *self._short_targets(n, numbers))
        first_size = rng.integers(1, n - 1, size=batch_size)
        position = np.arange(n)[None, :]
        in_first = position < first_size[:, None]
        in_second = position > first_size[:, None]
        bits = rng.integers(0, 2, size=(batch_size, n))
        while True:  # rejection: both operands non-zero, uniform over the rest
            zero = ~((bits & in_first).any(axis=1) & (bits & in_second).any(axis=1))
            if not zero.any():
                break
            bits[zero] = rng.integers(0, 2, size=(int(zero.sum()), n))
        inputs = np.where(in_first | in_second, bits, SEPARATOR)
        # Both operands aligned at bit 0 in n-1 columns, zero above their size.
        column = position[:, : n - 1]
        first = np.where(column < first_size[:, None], bits[:, : n - 1], 0)
        second_bits = np.take_along_axis(
            bits, np.minimum(first_size[:, None] + 1 + column, n - 1), axis=1
        )
        second = np.where(column < n - 1 - first_size[:, None], second_bits, 0)
        targets = self._combine(n, first, second)
        return Batch(inputs, targets, through_first(targets, TERMINATOR))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        batch_size, n = inputs.shape
        if n <= 2:
            if (inputs == SEPARATOR).any():
                raise CheBenchError(f"{self.name}: inputs of length <= 2 have no separator")
            numbers = [int("".join(map(str, row[::-1])), 2) for row in inputs.tolist()]
            return self._short_targets(n, numbers)
        targets = np.zeros((batch_size, self.output_length(n)), dtype=np.int64)
        for row, tokens in enumerate(inputs.tolist()):
            text = "".join(map(str, tokens))
            if text.count(str(SEPARATOR)) != 1:
                raise CheBenchError(f"{self.name}: inputs need exactly one separator 2")
            first, second = (int(part[::-1], 2) for part in text.split(str(SEPARATOR)))
            answer = [int(bit) for bit in reversed(format(self._operate(first, second), "b"))]
            targets[row, : len(answer)] = answer
            targets[row, len(answer)] = TERMINATOR
        return targets, through_first(targets, TERMINATOR)

    @abc.abstractmethod
    def _combine(self, n: int, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        """Sampler side: targets from the aligned little-endian operand bits [B, n-1]."""

    @abc.abstractmethod
    def _operate(self, first: int, second: int) -> int:
        """Oracle side: the arithmetic on the parsed operands."""

    @abc.abstractmethod
    def _short_targets(self, n: int, numbers: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(targets, mask) for n <= 2 (no separator) from the numbers the inputs encode."""


def _terminated(answer_bits: np.ndarray, answer_length: np.ndarray, width: int) -> np.ndarray:
    """Rows of ``answer_bits`` cut at ``answer_length``, then the terminator, then 0s."""
    position = np.arange(width)[None, :]
    bits = np.zeros((answer_bits.shape[0], width), dtype=np.int64)
    used = min(width, answer_bits.shape[1])
    bits[:, :used] = answer_bits[:, :used]
    targets = np.where(position < answer_length[:, None], bits, 0)
    targets[np.arange(len(targets)), answer_length] = TERMINATOR
    return targets


class BinaryAddition(_BinaryOperation):
    """Sum of two little-endian binary numbers separated by 2 (see ``_BinaryOperation``).

    Target: A+B in minimal little-endian bits, 2, then 0s up to n+1 positions. n <= 2:
    the minimal bits of N (``0`` for N = 0), 2, padding.

    Example: n = 7, ``1 1 0 1 2 1 0`` -> 11 + 1 = 12 -> ``0 0 1 1 2 0 0 0``, mask
    ``1 1 1 1 1 0 0 0``.
    """

    name = "binary_addition"
    output_length_formula = "n+1"

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return ("0", "1", "+")

    def output_length(self, n: int) -> int:
        return n + 1

    def _combine(self, n: int, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        total = np.zeros((first.shape[0], n), dtype=np.int64)
        carry = np.zeros(first.shape[0], dtype=np.int64)
        for i in range(n - 1):  # ripple-carry adder
            column = first[:, i] + second[:, i] + carry
            total[:, i], carry = column & 1, column >> 1
        total[:, n - 1] = carry
        length = n - np.argmax(total[:, ::-1], axis=1)  # index of the highest 1, plus 1
        return _terminated(total, length, n + 1)

    def _operate(self, first: int, second: int) -> int:
        return first + second

    def _short_targets(self, n: int, numbers: list[int]) -> tuple[np.ndarray, np.ndarray]:
        length = np.array([max(1, number.bit_length()) for number in numbers])  # 0 is written `0`
        targets = _terminated(_ints_to_le_bits(numbers, n), length, n + 1)
        return targets, through_first(targets, TERMINATOR)


class BinaryMultiplication(_BinaryOperation):
    """Product of two little-endian binary numbers separated by 2 (see ``_BinaryOperation``).

    Target: A*B in minimal little-endian bits, 2, then 0s up to n positions. n <= 2:
    a constant target of n-1 zeros then 2 (``2`` for n = 1, ``0 2`` for n = 2),
    whatever the input.

    Example: n = 7, ``1 1 0 1 2 1 0`` -> 11 * 1 = 11 -> ``1 1 0 1 2 0 0``.
    """

    name = "binary_multiplication"
    output_length_formula = "n"

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return ("0", "1", "*")

    def output_length(self, n: int) -> int:
        return n

    def _combine(self, n: int, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        products = [
            a * b for a, b in zip(_le_bits_to_ints(first), _le_bits_to_ints(second), strict=True)
        ]
        length = np.array([product.bit_length() for product in products])
        return _terminated(_ints_to_le_bits(products, n), length, n)

    def _operate(self, first: int, second: int) -> int:
        return first * second

    def _short_targets(self, n: int, numbers: list[int]) -> tuple[np.ndarray, np.ndarray]:
        targets = np.zeros((len(numbers), n), dtype=np.int64)
        targets[:, n - 1] = TERMINATOR
        return targets, through_first(targets, TERMINATOR)


class ComputeSqrt(Task):
    """N ~ U{1..2^n-1} in exactly n big-endian bits; target = floor(sqrt(N)) in
    big-endian bits, zero-padded to ceil(n/2) positions. No terminator, all-ones mask.

    Example: n = 7, ``0 1 1 0 0 1 1`` = 51 -> 7 -> ``0 1 1 1``.
    """

    name = "compute_sqrt"
    level = "cs"
    input_size = 2
    output_size = 2
    output_length_formula = "ceil(n/2)"

    def output_length(self, n: int) -> int:
        return (n + 1) // 2

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        inputs = rng.integers(0, 2, size=(batch_size, n))
        while True:  # rejection of N = 0 keeps N uniform on 1..2^n-1
            zero = ~inputs.any(axis=1)
            if not zero.any():
                break
            inputs[zero] = rng.integers(0, 2, size=(int(zero.sum()), n))
        roots = [math.isqrt(number) for number in _le_bits_to_ints(inputs[:, ::-1])]
        width = self.output_length(n)
        targets = np.ascontiguousarray(_ints_to_le_bits(roots, width)[:, ::-1])
        return Batch(inputs, targets, all_positions(targets))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        width = self.output_length(inputs.shape[1])
        targets = np.array(
            [
                [
                    int(bit)
                    for bit in format(math.isqrt(int("".join(map(str, row)), 2)), f"0{width}b")
                ]
                for row in inputs.tolist()
            ],
            dtype=np.int64,
        ).reshape(len(inputs), width)
        return targets, all_positions(targets)


class BucketSort(IidStringTask):
    """n iid tokens from ``vocab_size``; target = the tokens sorted ascending.

    Example (vocab 5): ``2 0 3 1 1 1`` -> ``0 1 1 1 2 3``.
    """

    name = "bucket_sort"
    level = "cs"
    permutation_invariant = True
    output_length_formula = "n"

    def __init__(self, vocab_size: int = 5) -> None:  # the reference's default vocabulary
        super().__init__(vocab_size)

    def output_length(self, n: int) -> int:
        return n

    def _sampler_targets(self, inputs: np.ndarray) -> np.ndarray:
        return np.sort(inputs, axis=1)

    def _oracle_targets(self, inputs: np.ndarray) -> np.ndarray:
        # Counting sort: position i holds the smallest symbol whose running count exceeds i,
        # i.e. the number of symbols whose running count is <= i.
        counts = np.stack([(inputs == s).sum(axis=1) for s in range(self.vocab_size)], axis=1)
        ends = np.cumsum(counts, axis=1)
        position = np.arange(inputs.shape[1])
        return (position[None, :, None] >= ends[:, None, :]).sum(axis=2)
