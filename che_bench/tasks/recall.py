"""che-bench's recall probes (spec section 7): associative_recall (Variant A) and
induction (Variant C). Neither is part of CHE."""

from __future__ import annotations

import functools
import math

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.tasks.base import (
    Batch,
    Task,
    check_choice_param,
    check_int_param,
    first_index,
    single_class,
)

#: Sequences simulated per length for the iid ceilings; the seed is fixed so the
#: curve is the same on every call and machine.
CEILING_SIMULATIONS = 4_000
CEILING_SEED = 0


@functools.cache
def mode_share(draws: int, classes: int) -> float:
    """E[count of the most frequent class] / draws for ``draws`` iid uniform draws over
    ``classes``, by simulation with a fixed seed.

    Given only the multiset of tokens, the hidden answer is equally likely to be any of
    the ``draws`` slots, so guessing the most frequent class is right with this
    probability: the permutation-invariant ceiling.
    """
    rng = np.random.default_rng(CEILING_SEED)
    chunk = max(1, 2_000_000 // (draws + classes))  # bound the memory of one step
    total, done = 0, 0
    while done < CEILING_SIMULATIONS:
        count = min(chunk, CEILING_SIMULATIONS - done)
        values = rng.integers(0, classes, size=(count, draws)) + classes * np.arange(count)[:, None]
        counts = np.bincount(values.ravel(), minlength=count * classes).reshape(count, classes)
        total += int(counts.max(axis=1).sum())
        done += count
    return total / (CEILING_SIMULATIONS * draws)


class AssociativeRecall(Task):
    """Key-value pairs followed by one queried key; target = the value bound to it.

    Ids: keys ``0..K-1``, values ``K..K+V-1``, BLANK ``K+V``; input_size K+V+1, output
    class = value - K (output_size V). For length n: P = (n-1)//2 pairs, and an even n
    starts with one BLANK. Keys: P distinct, uniform without replacement. Values:
    ``distinct`` -> P distinct without replacement, ``iid`` -> uniform with replacement.
    Queried pair t: ``uniform`` U{1..P}, ``near`` U{max(1, P-3)..P}, ``far``
    U{1..ceil(P/4)}. Input ``[BLANK]? k1 v1 ... kP vP k_t``.

    Example (K = V = 4, BLANK = 8): n = 6 -> P = 2,
    ``8 3 5 0 7 0`` = BLANK, (k3 -> v1), (k0 -> v3), query k0 -> class 3.

    Needs P <= K (and P <= V in ``distinct`` mode): the defaults allow n <= 514.
    ``ceiling(n)`` is the best accuracy from the bag of tokens alone: 1/P in
    ``distinct`` mode, E[most frequent value count]/P (simulated) in ``iid`` mode.
    """

    name = "associative_recall"
    level = "recall"
    min_length = 3
    output_length_formula = "1"
    VALUE_MODES = ("distinct", "iid")
    DISTANCES = ("uniform", "near", "far")

    def __init__(
        self,
        num_keys: int = 256,
        num_values: int = 256,
        value_mode: str = "distinct",
        distance: str = "uniform",
    ) -> None:
        self.num_keys = check_int_param(self.name, "num_keys", num_keys, 1)
        self.num_values = check_int_param(self.name, "num_values", num_values, 1)
        self.value_mode = check_choice_param(self.name, "value_mode", value_mode, self.VALUE_MODES)
        self.distance = check_choice_param(self.name, "distance", distance, self.DISTANCES)
        self.blank = self.num_keys + self.num_values
        self.input_size = self.blank + 1
        self.output_size = self.num_values
        max_pairs = self.num_keys if value_mode == "iid" else min(self.num_keys, self.num_values)
        self.max_length = 2 * max_pairs + 2  # P = (n-1)//2 <= max_pairs

    def params(self) -> dict:
        return {
            "num_keys": self.num_keys,
            "num_values": self.num_values,
            "value_mode": self.value_mode,
            "distance": self.distance,
        }

    @property
    def input_symbols(self) -> tuple[str, ...]:
        keys = tuple(f"k{i}" for i in range(self.num_keys))
        return keys + tuple(f"v{i}" for i in range(self.num_values)) + ("_",)

    def output_length(self, n: int) -> int:
        return 1

    def ceiling(self, n: int) -> float:
        self.check_length(n)
        pairs = (n - 1) // 2
        return 1.0 / pairs if self.value_mode == "distinct" else mode_share(pairs, self.num_values)

    def _query_range(self, pairs: int) -> tuple[int, int]:
        """Inclusive 1-based range of the queried pair index."""
        if self.distance == "near":
            return max(1, pairs - 3), pairs
        if self.distance == "far":
            return 1, math.ceil(pairs / 4)
        return 1, pairs

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        pairs = (n - 1) // 2
        keys = np.argsort(rng.random((batch_size, self.num_keys)), axis=1)[:, :pairs]
        if self.value_mode == "distinct":
            values = np.argsort(rng.random((batch_size, self.num_values)), axis=1)[:, :pairs]
        else:
            values = rng.integers(0, self.num_values, size=(batch_size, pairs))
        low, high = self._query_range(pairs)
        query = rng.integers(low, high + 1, size=batch_size) - 1  # 0-based pair index
        rows = np.arange(batch_size)
        body = np.empty((batch_size, 2 * pairs), dtype=np.int64)
        body[:, 0::2], body[:, 1::2] = keys, self.num_keys + values
        parts = [body, keys[rows, query][:, None]]
        if n % 2 == 0:
            parts.insert(0, np.full((batch_size, 1), self.blank))
        return Batch(np.concatenate(parts, axis=1), *single_class(values[rows, query]))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        query = inputs[:, -1:]
        if (query >= self.num_keys).any():
            raise CheBenchError(f"{self.name}: the last token must be a key")
        match = first_index(inputs[:, :-1], query, "earlier copy of the queried key")
        # A key among the pairs, so the token after it is a value (never the query itself).
        value = inputs[np.arange(len(inputs)), match + 1]
        if ((value < self.num_keys) | (value >= self.blank)).any():
            raise CheBenchError(f"{self.name}: the queried key is not followed by a value")
        return single_class(value - self.num_keys)


class Induction(Task):
    """Induction head probe: the symbol that followed the single trigger, asked for by a
    trigger at the end.

    Ids: symbols ``0..A-1``, trigger ``A``; input_size A+1, output_size A. Sampling for
    length n >= 3: a body of n-1 iid uniform symbols; a position p ~ U{0..n-3} (any body
    position but the last) is overwritten with the trigger; the target x is the body
    symbol at p+1; the input is the body followed by one more trigger (n tokens).

    Example (A = 4, trigger 4): ``2 4 1 3 0 4`` -> the trigger was followed by 1 -> class 1.

    ``ceiling(n)``: from the bag of tokens alone x is equally likely any of the n-2
    remaining body symbols, so the best guess is their mode: E[mode count]/(n-2)
    (simulated); above 1/A for short bodies.
    """

    name = "induction"
    level = "recall"
    min_length = 3
    output_length_formula = "1"

    def __init__(self, alphabet: int = 16) -> None:
        self.alphabet = check_int_param(self.name, "alphabet", alphabet, 2)
        self.trigger = self.alphabet
        self.input_size = self.alphabet + 1
        self.output_size = self.alphabet

    def params(self) -> dict:
        return {"alphabet": self.alphabet}

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return (*tuple(str(i) for i in range(self.alphabet)), "*")

    def output_length(self, n: int) -> int:
        return 1

    def ceiling(self, n: int) -> float:
        self.check_length(n)
        return mode_share(n - 2, self.alphabet)

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        body = rng.integers(0, self.alphabet, size=(batch_size, n - 1))
        rows, trigger_at = np.arange(batch_size), rng.integers(0, n - 2, size=batch_size)
        following = body[rows, trigger_at + 1]
        body[rows, trigger_at] = self.trigger
        inputs = np.column_stack([body, np.full(batch_size, self.trigger)])
        return Batch(inputs, *single_class(following))

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if (inputs[:, -1] != self.trigger).any():
            raise CheBenchError(f"{self.name}: inputs must end with the trigger {self.trigger}")
        trigger_at = first_index(inputs[:, :-2], self.trigger, "trigger before the last symbol")
        return single_class(inputs[np.arange(len(inputs)), trigger_at + 1])
