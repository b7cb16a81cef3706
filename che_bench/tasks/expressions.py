"""Modular arithmetic expressions: the bracket grammar sampler and an infix evaluator.

The sampler draws whole batches of fully parenthesised expressions of an exact
character count, level by level with numpy (the reference recurses per string in
Python). The evaluator parses one token sequence with the usual precedence rules; it
is the independent half used by the oracles of modular_arithmetic,
modular_arithmetic_brackets and solve_equation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from che_bench.errors import CheBenchError

# Operator names in the order the reference draws them (op index 0, 1, 2).
OPERATORS = ("+", "-", "*")


@dataclass(frozen=True)
class Vocabulary:
    """Token ids of one task: digits are ``0..modulus-1``; ``symbols`` maps the other
    characters (``+ - * ( ) x =``, those the task has) to their ids."""

    modulus: int
    symbols: dict[str, int]

    def id(self, symbol: str) -> int:
        return self.symbols[symbol]

    def names(self, input_size: int) -> tuple[str, ...]:
        """A printable name per id, ``?`` for ids the task never uses."""
        by_id = {token: symbol for symbol, token in self.symbols.items()}
        return tuple(str(i) if i < self.modulus else by_id.get(i, "?") for i in range(input_size))


def sample_bracket_expressions(
    length: int,
    batch_size: int,
    vocab: Vocabulary,
    operators: Sequence[str],
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """``batch_size`` expressions of exactly ``length`` tokens and their values mod the modulus.

    Grammar (spec 2.7): sizes 1-4 are ``d``, ``-d``, ``(d)``, ``(-d)`` with a uniform digit;
    a size m >= 5 splits into a left part a ~ U{1..m-4} and a right part m-3-a, joined as
    ``( L op R )`` with op uniform over ``operators``.
    Returns (tokens int64 [B, length], values int64 [B]).
    """
    modulus = vocab.modulus
    tokens = np.empty((batch_size, length), dtype=np.int64)
    # Node ids: the roots are 0..B-1, children are numbered as they are created.
    # A tree of m tokens has at most (m+1)//2 nodes (a leaf takes >= 1 token, a join 3).
    values = np.zeros(batch_size * ((length + 1) // 2 + 1), dtype=np.int64)
    joins = []  # per depth: (node, operator index, left child, right child)
    row = np.arange(batch_size)
    start = np.zeros(batch_size, dtype=np.int64)
    size = np.full(batch_size, length, dtype=np.int64)
    node = np.arange(batch_size)
    next_node = batch_size
    open_id, close_id = vocab.id("("), vocab.id(")")
    operator_ids = np.array([vocab.id(op) for op in operators])

    while row.size:
        leaf = size <= 4
        _write_leaves(tokens, values, row[leaf], start[leaf], size[leaf], node[leaf], vocab, rng)
        join = ~leaf
        r, s, m, parent = row[join], start[join], size[join], node[join]
        left_size = rng.integers(1, m - 3)  # U{1..m-4}; rng broadcasts the array bound
        op = rng.integers(0, len(operators), size=r.size)
        tokens[r, s] = open_id
        tokens[r, s + 1 + left_size] = operator_ids[op]
        tokens[r, s + m - 1] = close_id
        left = next_node + np.arange(r.size)
        right = left + r.size
        next_node += 2 * r.size
        joins.append((parent, op, left, right))
        row = np.concatenate([r, r])
        start = np.concatenate([s + 1, s + 2 + left_size])
        size = np.concatenate([left_size, m - 3 - left_size])
        node = np.concatenate([left, right])

    for parent, op, left, right in reversed(joins):
        a, b = values[left], values[right]
        combined = np.select([op == 0, op == 1], [a + b, a - b], default=a * b)
        values[parent] = combined % modulus
    return tokens, values[:batch_size]


def _write_leaves(
    tokens: np.ndarray,
    values: np.ndarray,
    row: np.ndarray,
    start: np.ndarray,
    size: np.ndarray,
    node: np.ndarray,
    vocab: Vocabulary,
    rng: np.random.Generator,
) -> None:
    """Write the leaves (sizes 1-4: ``d``, ``-d``, ``(d)``, ``(-d)``, a uniform digit) of
    ``row`` at ``start`` and their values at ``node``."""
    digit = rng.integers(0, vocab.modulus, size=row.size)
    negated = (size == 2) | (size == 4)
    bracketed = size >= 3
    tokens[row[bracketed], start[bracketed]] = vocab.id("(")
    tokens[row[bracketed], (start + size - 1)[bracketed]] = vocab.id(")")
    tokens[row[negated], (start + bracketed)[negated]] = vocab.id("-")
    tokens[row, start + bracketed + negated] = digit
    values[node] = np.where(negated, -digit, digit) % vocab.modulus


# A value of the evaluator: (coefficient of x, constant), both mod the modulus.
Linear = tuple[int, int]

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "neg": 3}


def evaluate(tokens: Sequence[int], vocab: Vocabulary) -> Linear:
    """Value of one infix expression as ``a*x + b`` mod the modulus, returned as (a, b).

    Handles digits, an optional unknown ``x``, binary ``+ - *`` with the usual
    precedence (``*`` first, then left to right), unary minus and brackets. ``x`` may
    occur at most once, so every product stays linear. Malformed input raises
    CheBenchError.
    """
    modulus = vocab.modulus
    symbol_of = {token: symbol for symbol, token in vocab.symbols.items()}
    operands: list[Linear] = []
    pending: list[str] = []  # operators and "(" not applied yet

    expect_operand = True
    try:
        for token in tokens:
            token = int(token)
            symbol = "digit" if 0 <= token < modulus else symbol_of.get(token)
            if symbol in ("digit", "x"):
                if not expect_operand:
                    raise CheBenchError("malformed expression: two operands in a row")
                operands.append((0, token) if symbol == "digit" else (1, 0))
                expect_operand = False
            elif symbol == "(":
                pending.append("(")
                expect_operand = True
            elif symbol == ")":
                while pending[-1] != "(":
                    _apply(pending.pop(), operands, modulus)
                pending.pop()
                expect_operand = False
            elif symbol == "-" and expect_operand:
                pending.append("neg")
            elif symbol in ("+", "-", "*") and not expect_operand:
                while (
                    pending
                    and pending[-1] != "("
                    and _PRECEDENCE[pending[-1]] >= _PRECEDENCE[symbol]
                ):
                    _apply(pending.pop(), operands, modulus)
                pending.append(symbol)
                expect_operand = True
            else:
                raise CheBenchError(f"malformed expression: unexpected token {token}")
        while pending:
            op = pending.pop()
            if op == "(":
                raise CheBenchError("malformed expression: unbalanced brackets")
            _apply(op, operands, modulus)
    except IndexError as exc:  # an operator without operands or a ")" without "("
        raise CheBenchError("malformed expression: missing operand or bracket") from exc
    if len(operands) != 1 or expect_operand:
        raise CheBenchError("malformed expression: incomplete")
    return operands[0]


def _apply(op: str, operands: list[Linear], modulus: int) -> None:
    """Replace the operands of ``op`` (unary minus "neg", or a binary ``+ - *``) on the stack
    ``operands`` by its value."""
    if op == "neg":
        a, b = operands.pop()
        operands.append((-a % modulus, -b % modulus))
        return
    (a2, b2), (a1, b1) = operands.pop(), operands.pop()
    if op == "+":
        operands.append(((a1 + a2) % modulus, (b1 + b2) % modulus))
    elif op == "-":
        operands.append(((a1 - a2) % modulus, (b1 - b2) % modulus))
    else:
        if a1 and a2:
            raise CheBenchError("malformed expression: x occurs in both factors of a product")
        operands.append(((a1 * b2 + a2 * b1) % modulus, (b1 * b2) % modulus))
