"""The deterministic context-free tasks of CHE: stack_manipulation, reverse_string,
modular_arithmetic_brackets, solve_equation."""

from __future__ import annotations

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.tasks.base import (
    Batch,
    IidStringTask,
    Task,
    check_int_param,
    single_class,
    through_first,
)
from che_bench.tasks.expressions import Vocabulary, evaluate, sample_bracket_expressions

POP, PUSH_0, PUSH_1 = 2, 3, 4
TERMINATOR = 2


class StackManipulation(Task):
    """A stack of bits (bottom first) followed by actions; target = the final stack.

    Ids: 0, 1 = stack symbols; 2 = POP, 3 = PUSH 0, 4 = PUSH 1. For n >= 2 the initial
    stack has k ~ U{1..n-1} iid bits and n-k actions iid U{2, 3, 4} follow; n = 1 is a
    single bit and no action. POP on an empty stack does nothing. Target: the final
    stack top first, then the terminator 2, then 0s up to n+1 positions; the accuracy
    mask keeps the positions up to and including the terminator.

    Example: n = 7, ``1 0 1 0 1 1 POP`` -> stack 1 0 1 0 1 (bottom..top) -> target
    ``1 0 1 0 1 2 0 0``, mask ``1 1 1 1 1 1 0 0``. n = 1: ``1`` -> ``1 2``.
    """

    name = "stack_manipulation"
    level = "dcf"
    input_size = 5
    output_size = 3
    output_length_formula = "n+1"

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return ("0", "1", "POP", "PUSH0", "PUSH1")

    def output_length(self, n: int) -> int:
        return n + 1

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        inputs = rng.integers(POP, PUSH_1 + 1, size=(batch_size, n))
        stack_size = rng.integers(1, max(n, 2), size=batch_size)  # U{1..n-1}; n = 1: all stack
        in_stack = np.arange(n)[None, :] < stack_size[:, None]
        inputs[in_stack] = rng.integers(0, 2, size=int(in_stack.sum()))
        # Run every row at once: an initial bit is a push of that bit.
        stack = np.zeros((batch_size, n), dtype=np.int64)
        height = np.zeros(batch_size, dtype=np.int64)
        rows = np.arange(batch_size)
        for token in inputs.T:
            pushes = token != POP
            stack[rows[pushes], height[pushes]] = np.where(token < POP, token, token - PUSH_0)[
                pushes
            ]
            height = np.where(pushes, height + 1, np.maximum(height - 1, 0))
        # Output top first: position i holds stack[height-1-i] while i < height.
        position = np.arange(n + 1)[None, :]
        source = np.clip(height[:, None] - 1 - position, 0, n - 1)
        targets = np.where(position < height[:, None], np.take_along_axis(stack, source, axis=1), 0)
        targets[rows, height] = TERMINATOR
        return Batch(inputs, targets, through_first(targets, TERMINATOR))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = inputs.shape[1]
        targets = np.zeros((inputs.shape[0], n + 1), dtype=np.int64)
        for row, tokens in enumerate(inputs.tolist()):
            split = next((i for i, t in enumerate(tokens) if t >= POP), n)
            stack = tokens[:split]
            if any(t < POP for t in tokens[split:]):
                raise CheBenchError("malformed stack_manipulation input: a bit after an action")
            for action in tokens[split:]:
                if action == POP:
                    if stack:
                        stack.pop()
                else:
                    stack.append(action - PUSH_0)
            targets[row, : len(stack)] = stack[::-1]
            targets[row, len(stack)] = TERMINATOR
        return targets, through_first(targets, TERMINATOR)


class ReverseString(IidStringTask):
    """n iid tokens from ``vocab_size``; target = the input reversed.

    Example: ``0 1 0 0 1 1 0`` -> ``0 1 1 0 0 1 0``.
    """

    name = "reverse_string"
    level = "dcf"
    output_length_formula = "n"

    def output_length(self, n: int) -> int:
        return n

    def _sampler_targets(self, inputs: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(inputs[:, ::-1])

    def _oracle_targets(self, inputs: np.ndarray) -> np.ndarray:
        return np.flip(inputs, axis=1).copy()


class _ExpressionTask(Task):
    """A task over bracketed expressions mod ``modulus``: the digits' ids are ``0..m-1``, the
    other symbols' follow in order (``vocab``); the answer is one of the ``m`` residues."""

    level = "dcf"
    output_length_formula = "1"

    def _set_vocabulary(self, modulus: int, symbols: tuple[str, ...]) -> None:
        self.modulus = m = check_int_param(self.name, "modulus", modulus, 2)
        self.vocab = Vocabulary(m, {symbol: m + i for i, symbol in enumerate(symbols)})
        self.input_size = m + len(symbols)
        self.output_size = m

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return self.vocab.names(self.input_size)

    def output_length(self, n: int) -> int:
        return 1


class ModularArithmeticBrackets(_ExpressionTask):
    """A fully bracketed expression of exactly n tokens; target = its value mod ``modulus``.

    Ids: digits ``0..m-1``, ``+`` = m, ``-`` = m+1, ``*`` = m+2, ``(`` = m+3, ``)`` = m+4;
    m+5 (``x``) completes the reference's shared alphabet and never occurs, input_size m+6.
    Grammar: n = 1 ``d``, 2 ``-d``, 3 ``(d)``, 4 ``(-d)``; n >= 5: a ~ U{1..n-4}, b = n-3-a,
    ``( L op R )`` with op uniform over {+, -, *} (``mult=False``: {+, -}). Unary minus
    only precedes a digit, so ``--3`` (binary then unary minus) occurs.

    Example (m = 5): n = 7, ``( - 0 * - 3 )`` -> 0 -> class 0; n = 10,
    ``( ( 0 - 3 ) - - 3 )`` -> 0 -> class 0.
    """

    name = "modular_arithmetic_brackets"

    def __init__(self, modulus: int = 5, mult: bool = True) -> None:
        self._set_vocabulary(modulus, ("+", "-", "*", "(", ")", "x"))
        if not isinstance(mult, bool):
            raise CheBenchError(
                f"task {self.name!r}: parameter 'mult' must be a boolean, got {mult!r}"
            )
        self.mult = mult

    def params(self) -> dict:
        return {"modulus": self.modulus, "mult": self.mult}

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        operators = ("+", "-", "*") if self.mult else ("+", "-")
        inputs, values = sample_bracket_expressions(n, batch_size, self.vocab, operators, rng)
        return Batch(inputs, *single_class(values))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if (inputs == self.vocab.id("x")).any():
            raise CheBenchError(f"{self.name}: inputs contain the unused id of 'x'")
        return single_class(np.array([evaluate(row, self.vocab)[1] for row in inputs]))


class SolveEquation(_ExpressionTask):
    """``E = v`` where one digit of a bracketed expression E was replaced by ``x``;
    target = the replaced digit (the unique solution mod ``modulus``).

    Ids (differ from modular_arithmetic_brackets!): digits ``0..m-1``, ``+`` = m,
    ``-`` = m+1, ``(`` = m+2, ``)`` = m+3, ``x`` = m+4, ``=`` = m+5; input_size m+6.
    n >= 3: E has n-2 tokens from the grammar of modular_arithmetic_brackets without
    ``*``; v = E mod m; a uniform position of E is moved right cyclically to the next
    digit, which becomes ``x``. n < 3: all-zero input, class 0.

    Example (m = 5): n = 7, ``( 1 - x ) = 1`` -> x = 0; n = 6, ``( - x ) = 4`` -> x = 1.
    """

    name = "solve_equation"

    def __init__(self, modulus: int = 5) -> None:
        self._set_vocabulary(modulus, ("+", "-", "(", ")", "x", "="))

    def params(self) -> dict:
        return {"modulus": self.modulus}

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        if n < 3:
            return Batch(
                np.zeros((batch_size, n), dtype=np.int64), *single_class(np.zeros(batch_size))
            )
        size = n - 2
        expression, values = sample_bracket_expressions(
            size, batch_size, self.vocab, ("+", "-"), rng
        )
        rows = np.arange(batch_size)
        # First digit at or cyclically after a uniform start: search the doubled row.
        start = rng.integers(0, size, size=batch_size)
        is_digit = np.tile(expression < self.modulus, 2)
        is_digit[np.arange(2 * size)[None, :] < start[:, None]] = False
        position = np.argmax(is_digit, axis=1) % size
        solutions = expression[rows, position]
        expression[rows, position] = self.vocab.id("x")
        inputs = np.column_stack([expression, np.full(batch_size, self.vocab.id("=")), values])
        return Batch(inputs, *single_class(solutions))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        batch_size, n = inputs.shape
        solutions = np.zeros(batch_size, dtype=np.int64)
        if n < 3:
            if inputs.any():
                raise CheBenchError(f"{self.name}: inputs shorter than 3 must be all zeros")
            return single_class(solutions)
        m = self.modulus
        if (inputs[:, -2] != self.vocab.id("=")).any() or (inputs[:, -1] >= m).any():
            raise CheBenchError(f"{self.name}: inputs must end with '=' and a digit")
        for row, tokens in enumerate(inputs):
            if (tokens[:-2] == self.vocab.id("x")).sum() != 1:
                raise CheBenchError(f"{self.name}: the expression must contain exactly one 'x'")
            coefficient, constant = evaluate(tokens[:-2], self.vocab)
            # coefficient * x + constant = v (mod m); with only + and - the coefficient is +-1.
            solutions[row] = (int(tokens[-1]) - constant) * pow(coefficient, -1, m) % m
        return single_class(solutions)
