"""Group word problems: the prefix products of a word over a finite group (Merrill, Petty &
Sabharwal 2024, jopetty/word-problem), DeltaProduct's variants of it (automl/DeltaProduct
``state_tracking/src/generate_data.py``) and PaTH's "is the word the identity" form (Yang et
al. 2025); spec: shared/spec/word_problems.md 1-3. Groups and their indices: ``groups``."""

from __future__ import annotations

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.tasks.base import Batch, Task, check_choice_param, check_int_param
from che_bench.tasks.groups import Group, moved_points

#: The variants, named after DeltaProduct's group-string suffixes where they come from there.
VARIANTS = ("standard", "only_swaps", "limit_to", "only_swaps_hard", "tokens", "identity")
#: Variants that draw from the elements moving few points (2, or ``m`` for limit_to).
_FEW_MOVED = ("only_swaps", "limit_to", "only_swaps_hard")
#: Variants whose elements occupy ``m`` tokens each, and their default m (None: required).
_BLOCKS = {"tokens": None, "only_swaps_hard": 4}


class WordProblem(Task):
    """A word x_1 .. x_n of group elements (input id = element index, ``groups``: index 0 the
    identity, S<n> in ``itertools.permutations`` order, products i_g * |H| + i_h); the target
    at every position t is the prefix product y_t = y_(t-1) . x_t (y_0 the identity, (a . b)(i)
    = a(b(i))), read in place, as in Merrill et al.'s token tagging.

    ``variant`` (DeltaProduct's generator unless said otherwise; n counts input tokens):

    * ``standard``: x_t i.i.d. uniform over the group.
    * ``only_swaps``: x_t uniform over the elements of S<n> moving at most 2 points (the
      identity and the transpositions: 11 of S5).
    * ``limit_to``: uniform over the elements of S<n> or A<n> moving at most ``m`` points.
    * ``tokens``: each element takes ``m`` tokens, itself then m-1 separators (id |G|; with
      ``separator=false`` m-1 copies of itself); the last block is cut at n. The target at
      each position is the product of the blocks completed there (identity before the
      first), so a block's element is answered at its last token (Grazzi et al.'s setup iv).
    * ``only_swaps_hard``: blocks of ``m`` (4) tokens as in ``tokens``, each block's element
      the product of m swaps drawn as in ``only_swaps`` (the last, cut block: of as many as
      fit), its other tokens the identity 0.
    * ``identity``: PaTH's binary task on A<n> (A5): x_t among the 3-cycles (1 2 k), k = 3..n,
      and their inverses; one target, at the last position: class 1 iff the whole word is the
      identity. Classes are balanced: each word is with probability 1/2 uniform among the
      identity words of length n (drawn letter by letter with the exact probability of
      finishing at the identity), otherwise uniform among the others.

    Example (S3, standard): inputs ``3 3 3`` ((2,3,1) three times) -> ``3 4 0``; ``1 2`` ->
    ``1 4``; ``2 1`` -> ``2 3``. S3 with ``tokens``, m = 2: ``3 | 3 | 3`` -> ``0 3 3 4 4``.
    """

    name = "word_problem"
    level = "regular"
    output_layout = "in_place"
    causal = True  # the sources train causal models on it (--no-causal: bidirectional)
    output_length_formula = "n (in place)"
    listed_params = (
        {"group": "S3"},
        {"group": "S5"},
        {"group": "A4_x_Z5"},
        {"group": "Z60"},
        {"group": "S5", "variant": "only_swaps"},
        {"group": "S5", "variant": "limit_to", "m": 3},
        {"group": "S5", "variant": "only_swaps_hard"},
        {"group": "S5", "variant": "tokens", "m": 4},
        {"variant": "identity"},
    )

    def __init__(
        self,
        group: str = "A5",
        variant: str = "standard",
        m: int | None = None,
        separator: bool = True,
    ) -> None:
        self.group = Group(group)
        self.variant = check_choice_param(self.name, "variant", variant, VARIANTS)
        self.m = self._checked_m(m)
        if not isinstance(separator, bool) or (not separator and self.variant != "tokens"):
            raise CheBenchError(
                f"task 'word_problem': separator is true or false, and false only with variant "
                f"tokens, got {separator!r} with {self.variant}"
            )
        self.separator = separator
        self.block = self.m if self.variant in _BLOCKS and self.m else 1
        #: The id of a block's tokens after its first (None: copies of the element).
        self.filler = {"only_swaps_hard": 0, "tokens": self.group.order if separator else None}.get(
            self.variant
        )
        self.letters = self._letters()
        order = self.group.order
        self.input_size = order + int(self.variant == "tokens" and separator)
        self.output_size = 2 if self.variant == "identity" else order
        if self.variant == "identity":
            self.min_length = 2  # no single generator is the identity
        elif self.block > 1:
            self.length_label = f"tokens n ({self.block} per element)"

    def _checked_m(self, m: object) -> int | None:
        if self.variant == "limit_to" or self.variant in _BLOCKS:
            default = _BLOCKS.get(self.variant)
            if m is None and default is None:
                raise CheBenchError(f"task 'word_problem': variant {self.variant} needs m")
            return check_int_param(self.name, "m", default if m is None else m, 2)
        if m is not None:
            raise CheBenchError(
                f"task 'word_problem': m is for variants limit_to, tokens and only_swaps_hard, "
                f"not {self.variant}"
            )
        return None

    def _letters(self) -> np.ndarray:
        """The element indices each letter (block) is drawn from, uniformly."""
        if self.variant == "identity":
            return identity_generators(self.group)
        if self.variant not in _FEW_MOVED:
            return np.arange(self.group.order)
        factor = self.group.permutation_factor(f"variant {self.variant}")
        most = self.m if self.variant == "limit_to" and self.m else 2
        letters = [
            i
            for i, p in enumerate(factor.elements)
            if isinstance(p, tuple) and moved_points(p) <= most
        ]
        if len(letters) < 2:
            raise CheBenchError(
                f"task 'word_problem': in {self.group.name} only the identity moves at most "
                f"{most} points"
            )
        return np.array(letters, dtype=np.int64)

    def params(self) -> dict:
        return {
            "group": self.group.name,
            "variant": self.variant,
            "m": self.m,
            "separator": self.separator,
        }

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return (*(str(i) for i in range(self.group.order)), "|")[: self.input_size]

    def output_length(self, n: int) -> int:
        return n

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        if self.variant == "identity":
            return self._sample_identity(n, batch_size, rng)
        table, blocks = self.group.table, -(-n // self.block)
        if self.variant == "only_swaps_hard":  # each block's element: its block of swaps
            swaps = self.letters[rng.integers(0, len(self.letters), size=(batch_size, n))]
            swaps = np.pad(swaps, ((0, 0), (0, blocks * self.block - n)))  # pads: identity
            elements = swaps[:, 0 :: self.block]
            for offset in range(1, self.block):
                elements = table[elements, swaps[:, offset :: self.block]]
        else:
            elements = self.letters[rng.integers(0, len(self.letters), size=(batch_size, blocks))]
        inputs = np.repeat(elements, self.block, axis=1)[:, :n]
        if self.filler is not None:
            inputs[:, np.arange(n) % self.block != 0] = self.filler
        # products[:, c] = product of the first c blocks (c = 0: the identity).
        products = np.zeros((batch_size, blocks + 1), dtype=np.int64)
        for b in range(blocks):
            products[:, b + 1] = table[products[:, b], elements[:, b]]
        targets = products[:, (np.arange(n) + 1) // self.block]
        return Batch(inputs, targets, np.ones(targets.shape, dtype=bool))

    def _sample_identity(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        table, letters = self.group.table, self.letters
        inputs = np.empty((batch_size, n), dtype=np.int64)
        # reach[k, g]: chance that g times k random letters is the identity.
        reach = np.zeros((n, self.group.order))
        reach[0, 0] = 1.0
        for k in range(1, n):
            reach[k] = reach[k - 1][table[:, letters]].mean(axis=1)
        wanted = rng.random(batch_size) < 0.5
        product = np.zeros(batch_size, dtype=np.int64)
        for t in range(n):
            weights = reach[n - 1 - t][table[product[:, None], letters[None, :]]]
            # The exponential race: letter i wins with chance weights_i / sum (never at 0).
            with np.errstate(divide="ignore"):
                race = rng.exponential(size=weights.shape) / weights
            inputs[:, t] = letters[np.argmin(race, axis=1)]
            product = table[product, inputs[:, t]]
        others = ~wanted
        while others.any():  # uniform non-identity words: redraw those that hit the identity
            inputs[others] = letters[rng.integers(0, len(letters), size=(int(others.sum()), n))]
            product = np.zeros(batch_size, dtype=np.int64)
            for t in range(n):
                product = table[product, inputs[:, t]]
            others = ~wanted & (product == 0)
        targets = np.zeros((batch_size, n), dtype=np.int64)
        mask = np.zeros((batch_size, n), dtype=bool)
        targets[:, -1], mask[:, -1] = product == 0, True
        return Batch(inputs, targets, mask)

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        group = self.group
        identity = group.element(0)
        targets = np.zeros(inputs.shape, dtype=np.int64)
        for row, tokens in enumerate(inputs.tolist()):
            product = block_element = identity
            for position, token in enumerate(tokens):
                if position % self.block == 0:
                    if token >= group.order:
                        raise CheBenchError(f"{self.name}: a block must start with an element")
                    block_element = group.element(token)
                if position % self.block == self.block - 1:
                    product = group.compose(product, block_element)
                targets[row, position] = group.index(product)
        if self.variant != "identity":
            return targets, np.ones(targets.shape, dtype=bool)
        mask = np.zeros(inputs.shape, dtype=bool)
        mask[:, -1] = True
        return np.where(mask, targets == 0, 0).astype(np.int64), mask


def identity_generators(group: Group) -> np.ndarray:
    """PaTH's letters in A<n>: the 3-cycles (1 2 k), k = 3..n, then their inverses (1 k 2)."""
    factor = group.permutation_factor("variant identity")
    if factor.kind != "A":
        raise CheBenchError(f"variant identity needs a group A<n>, got {group.name}")
    cycles = [(1, 2, k) for k in range(3, factor.n + 1)]
    cycles += [(1, k, 2) for k in range(3, factor.n + 1)]
    return np.array([factor.positions[one_line(factor.n, c)] for c in cycles], dtype=np.int64)


def one_line(n: int, cycle: tuple[int, ...]) -> tuple[int, ...]:
    """The one-line tuple of the permutation of 1..n that is the single ``cycle``."""
    images = list(range(1, n + 1))
    for point, image in zip(cycle, (*cycle[1:], cycle[0]), strict=True):
        images[point - 1] = image
    return tuple(images)
