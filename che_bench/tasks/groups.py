"""Finite groups for the word problems: Z_n, S_n, A_n and their direct products, with element
indices and the product of Merrill, Petty & Sabharwal's generator (jopetty/word-problem
``src/generate_data.py`` over jopetty/abstract_algebra; spec: shared/spec/word_problems.md 1.1).

* ``Z<n>``: index i is the residue i; the product is addition mod n.
* ``S<n>``: the one-line tuples ``(p(1), ..., p(n))`` in ``itertools.permutations((1..n))``
  order; index = rank in that list (0 = the identity).
* ``A<n>`` (n >= 3): the even permutations, kept in their S<n> order and renumbered.
* ``G_x_H``: the pairs of ``itertools.product(G, H)``, index ``i_g * |H| + i_h``, the product
  componentwise; more factors fold left.
* The product of two permutations is their composition as functions, ``a`` after ``b``:
  ``(a . b)(i) = a(b(i))``, on tuples ``c[i] = a[b[i]]``.

A group computes products two ways: ``compose`` on element tuples (what the oracles use) and
``table``, the Cayley table built with numpy from the factors' arrays (what the samplers use).
"""

from __future__ import annotations

import itertools
import math
import re
from functools import cached_property

import numpy as np

from che_bench.errors import CheBenchError

#: Largest group order accepted: the Cayley table has order^2 entries (32 MiB at 2048).
MAX_ORDER = 2048
_FACTOR = re.compile(r"([SAZ])(\d+)")
#: Smallest n of each kind of factor (S2 and Z2 have two elements; A3 is the first non-trivial A).
_SMALLEST = {"S": 2, "A": 3, "Z": 2}
#: Largest n of S<n> and A<n> within MAX_ORDER (|A6| = 360, |A7| = 2520).
_LARGEST_PERMUTED = 6

Element = int | tuple[int, ...]


class Factor:
    """One factor ``S<n>``, ``A<n>`` or ``Z<n>``: its elements in index order."""

    def __init__(self, kind: str, n: int) -> None:
        self.kind, self.n = kind, n
        self.name = f"{kind}{n}"
        self.order = n if kind == "Z" else math.factorial(n) // (2 if kind == "A" else 1)

    @property
    def is_permutation_group(self) -> bool:
        return self.kind != "Z"

    @cached_property
    def elements(self) -> tuple[Element, ...]:
        """The elements, index = position: residues, or one-line tuples with 1-based values."""
        if self.kind == "Z":
            return tuple(range(self.n))
        permutations = itertools.permutations(range(1, self.n + 1))
        if self.kind == "S":
            return tuple(permutations)
        return tuple(p for p in permutations if inversions(p) % 2 == 0)

    @cached_property
    def positions(self) -> dict[Element, int]:
        """Element -> index."""
        return {element: index for index, element in enumerate(self.elements)}

    def compose(self, a: Element, b: Element) -> Element:
        """``a . b``: ``a`` after ``b`` for permutations, the sum mod n for residues."""
        if isinstance(a, int) and isinstance(b, int):
            return (a + b) % self.n
        assert isinstance(a, tuple) and isinstance(b, tuple)
        return tuple(a[i - 1] for i in b)

    def table(self) -> np.ndarray:
        """The Cayley table ``[order, order]`` of indices, entry (a, b) = index of a . b."""
        if self.kind == "Z":
            residues = np.arange(self.n)
            return (residues[:, None] + residues[None, :]) % self.n
        images = np.array(self.elements, dtype=np.int64) - 1  # [order, n], 0-based values
        composed = images[np.arange(self.order)[:, None, None], images[None, :, :]]
        # One-line tuples in lexicographic order have increasing base-n codes.
        weights = self.n ** np.arange(self.n - 1, -1, -1, dtype=np.int64)
        codes = images @ weights
        return np.searchsorted(codes, composed @ weights)


def inversions(permutation: tuple[int, ...]) -> int:
    """Number of pairs i < j with p(i) > p(j) (its parity is the permutation's)."""
    return sum(a > b for a, b in itertools.combinations(permutation, 2))


def moved_points(permutation: tuple[int, ...]) -> int:
    """Number of points a one-line permutation does not fix."""
    return sum(image != point for point, image in enumerate(permutation, start=1))


class Group:
    """A group named like ``S3``, ``A5``, ``Z60`` or ``A4_x_Z5`` (factors joined by ``_x_``,
    letters case-insensitive); a CheBenchError for any other name or an order above
    ``MAX_ORDER``. Elements are tuples with one entry per factor."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise CheBenchError(f"group must be a string like S3, A5, Z60 or A4_x_Z5, got {name!r}")
        self.factors = tuple(_factor(part, name) for part in re.split(r"_x_", name, flags=re.I))
        self.name = "_x_".join(factor.name for factor in self.factors)
        self.order = math.prod(factor.order for factor in self.factors)
        if self.order > MAX_ORDER:
            raise CheBenchError(
                f"group {self.name} has {self.order} elements; at most {MAX_ORDER} are supported"
            )

    def element(self, index: int) -> tuple[Element, ...]:
        """The element of ``index`` (mixed radix, the last factor least significant)."""
        parts = []
        for factor in reversed(self.factors):
            index, part = divmod(int(index), factor.order)
            parts.append(factor.elements[part])
        return tuple(reversed(parts))

    def index(self, element: tuple[Element, ...]) -> int:
        """The index of ``element`` (the inverse of ``element``)."""
        index = 0
        for factor, part in zip(self.factors, element, strict=True):
            index = index * factor.order + factor.positions[part]
        return index

    def compose(self, a: tuple[Element, ...], b: tuple[Element, ...]) -> tuple[Element, ...]:
        """``a . b``, factor by factor."""
        return tuple(f.compose(x, y) for f, x, y in zip(self.factors, a, b, strict=True))

    @cached_property
    def table(self) -> np.ndarray:
        """The Cayley table ``[order, order]`` (int64): entry (a, b) = index of a . b."""
        table = self.factors[0].table()
        for factor in self.factors[1:]:
            other = factor.table()
            size = factor.order
            table = (table[:, None, :, None] * size + other[None, :, None, :]).reshape(
                table.shape[0] * size, -1
            )
        return table.astype(np.int64)

    def permutation_factor(self, what: str) -> Factor:
        """The single permutation factor of a group ``S<n>`` or ``A<n>``; a CheBenchError saying
        that ``what`` needs one otherwise."""
        if len(self.factors) != 1 or not self.factors[0].is_permutation_group:
            raise CheBenchError(f"{what} needs a group S<n> or A<n>, got {self.name}")
        return self.factors[0]


def _factor(part: str, name: str) -> Factor:
    match = _FACTOR.fullmatch(part.upper())
    if match is None:
        raise CheBenchError(
            f"group {name!r}: expected factors S<n>, A<n> or Z<n> joined by _x_, got {part!r}"
        )
    kind, n = match.group(1), int(match.group(2))
    if n < _SMALLEST[kind]:
        raise CheBenchError(f"group {name!r}: {kind}<n> needs n >= {_SMALLEST[kind]}, got {part}")
    if n > (_LARGEST_PERMUTED if kind != "Z" else MAX_ORDER):  # before n! is computed
        raise CheBenchError(f"group {name!r}: {part} has more than {MAX_ORDER} elements")
    return Factor(kind, n)
