"""Multi-query associative recall (MQAR), the recall probe of Zoology (Arora et al. 2023),
with its generator's parameters (spec: shared/spec/mqar.md) and two extrapolation axes."""

from __future__ import annotations

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.tasks.base import Batch, Task, check_choice_param, check_int_param

FILLER = 0


class MultiQueryAssociativeRecall(Task):
    """D key-value pairs, then every key queried once; the answer to a query is its value,
    read *in place* at the query's own position (Zoology's labels).

    Ids (vocabulary V): filler 0, keys ``1..V/2-1``, values ``V/2..V-1``; output class =
    value - V/2 (output_size V/2). A sequence of L tokens: the context ``k1 v1 ... kD vD``
    (distinct keys, distinct values), then a query region of L - 2D tokens whose
    S = (L-2D)//2 even offsets are the query slots. D slots are drawn without replacement with
    probability proportional to ``a * i^(a-1)`` (i = 1..S; ``power_a`` = a, small gaps far
    likelier) and key j is written at slot j's offset. Every other position of the query region
    (odd L: the last one too) is filler: 0, or with ``random_non_queries`` a uniform id of the
    whole vocabulary. Scored: each key's query. A filler at an even offset can repeat a key;
    then its first such occurrence is the one scored (same key, same answer; Zoology scores the
    query slot), so the mask is a function of the input and the oracle can recompute it.

    Axes: ``axis="length"``: n = L, with ``num_pairs`` = D fixed (4D <= n), or
    ``length_per_pair`` = K giving D = n // K. ``axis="pairs"``: n = D, at the fixed
    ``sequence_length`` L; there the first query slot, when it holds no query, is filler 0 (so
    that the context ends visibly and the oracle can count D from the input alone).

    Defaults are sized for a laptop CPU (V = 64, D = 4, filler 0); Zoology's generator has
    V = 8192 and random filler.

    Example (V = 16, D = 2, n = L = 10, a = 1, filler 0): context ``3 9 5 12`` = (k3 -> v9),
    (k5 -> v12); query slots at offsets 0, 2, 4 of the region ``5 0 0 0 3 0``: k5 at offset 0,
    k3 at offset 4 -> targets ``. . . . 4 . . . 1 .`` (classes 12-8, 9-8; ``.`` not scored).
    """

    name = "mqar"
    level = "recall"
    output_layout = "in_place"
    causal = True  # Zoology's task is causal language modelling (--no-causal: bidirectional)
    # Those of axis="length"; __init__ sets axis="pairs"' own (they name the fixed L).
    output_length_formula = "n (in place)"
    length_label = "length n"
    AXES = ("length", "pairs")

    def __init__(
        self,
        vocab_size: int = 64,
        num_pairs: int | None = None,
        length_per_pair: int | None = None,
        power_a: float = 0.01,
        random_non_queries: bool = False,
        axis: str = "length",
        sequence_length: int = 128,
    ) -> None:
        self.vocab_size = check_int_param(self.name, "vocab_size", vocab_size, 4)
        if self.vocab_size % 2:
            raise CheBenchError(f"task 'mqar': vocab_size must be even, got {vocab_size}")
        self.axis = check_choice_param(self.name, "axis", axis, self.AXES)
        if length_per_pair is not None and (num_pairs is not None or axis == "pairs"):
            raise CheBenchError(
                "task 'mqar': length_per_pair is for axis=length, without num_pairs"
            )
        if num_pairs is not None and axis == "pairs":
            raise CheBenchError("task 'mqar': with axis=pairs the length n is the number of pairs")
        self.length_per_pair = (
            None
            if length_per_pair is None
            else check_int_param(self.name, "length_per_pair", length_per_pair, 4)
        )
        self.num_pairs = (
            None
            if axis == "pairs" or self.length_per_pair is not None
            else check_int_param(self.name, "num_pairs", 4 if num_pairs is None else num_pairs, 1)
        )
        if (
            isinstance(power_a, bool)
            or not isinstance(power_a, (int, float))
            or not 0 < power_a <= 1
        ):
            raise CheBenchError(f"task 'mqar': power_a must lie in (0, 1], got {power_a!r}")
        self.power_a = float(power_a)
        if not isinstance(random_non_queries, bool):
            raise CheBenchError(
                f"task 'mqar': random_non_queries must be true or false, got {random_non_queries!r}"
            )
        self.random_non_queries = random_non_queries
        self.sequence_length = check_int_param(self.name, "sequence_length", sequence_length, 4)
        self.keys = self.vocab_size // 2 - 1
        self.input_size, self.output_size = self.vocab_size, self.vocab_size // 2
        self._set_length_range()
        if self.axis == "pairs":
            self.output_length_formula = f"{self.sequence_length} (in place)"
            self.length_label = f"pairs D (length {self.sequence_length})"

    def _set_length_range(self) -> None:
        """min_length / max_length: every length must hold 4D <= L and D <= V/2 - 1 keys."""
        if self.axis == "pairs":
            self.min_length = 1
            self.max_length = min(self.sequence_length // 4, self.keys)
        elif self.length_per_pair is not None:
            self.min_length = self.length_per_pair
            self.max_length = (self.keys + 1) * self.length_per_pair - 1
        else:
            pairs = self.fixed_pairs()
            if pairs > self.keys:
                raise CheBenchError(
                    f"task 'mqar': {pairs} pairs need vocab_size >= {2 * pairs + 2}"
                )
            self.min_length, self.max_length = 4 * pairs, None

    def params(self) -> dict:
        return {
            "vocab_size": self.vocab_size,
            "num_pairs": self.num_pairs,
            "length_per_pair": self.length_per_pair,
            "power_a": self.power_a,
            "random_non_queries": self.random_non_queries,
            "axis": self.axis,
            "sequence_length": self.sequence_length,
        }

    @property
    def input_symbols(self) -> tuple[str, ...]:
        half = self.vocab_size // 2
        return ("_", *tuple(f"k{i}" for i in range(1, half)), *tuple(f"v{i}" for i in range(half)))

    def pairs(self, n: int) -> int:
        """D, the number of key-value pairs at length ``n``."""
        if self.axis == "pairs":
            return n
        return self.fixed_pairs() if self.length_per_pair is None else n // self.length_per_pair

    def fixed_pairs(self) -> int:
        """D of a task whose number of pairs does not follow the length (``num_pairs``)."""
        if self.num_pairs is None:
            raise CheBenchError("task 'mqar': its number of pairs follows the length")
        return self.num_pairs

    def ceiling(self, n: int) -> float | None:
        """1/D with filler 0: from the bag of tokens alone the D context values are all a
        query's answer with equal chance (every key and value appears the same number of times),
        so a position-blind model returns any of them. Unknown (None) with random filler, whose
        extra values in the bag the model cannot tell from the context's."""
        self.check_length(n)
        return None if self.random_non_queries else 1 / self.pairs(n)

    def input_length(self, n: int) -> int:
        return self.sequence_length if self.axis == "pairs" else n

    def output_length(self, n: int) -> int:
        return self.input_length(n)

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        pairs, length = self.pairs(n), self.input_length(n)
        half = self.vocab_size // 2
        keys = 1 + np.argsort(rng.random((batch_size, self.keys)), axis=1)[:, :pairs]
        values = half + np.argsort(rng.random((batch_size, half)), axis=1)[:, :pairs]
        inputs = np.full((batch_size, length), FILLER, dtype=np.int64)
        inputs[:, 0 : 2 * pairs : 2], inputs[:, 1 : 2 * pairs : 2] = keys, values
        region = inputs[:, 2 * pairs :]  # a view: writes land in ``inputs``
        slots = self._query_slots(pairs, (length - 2 * pairs) // 2, batch_size, rng)
        rows = np.arange(batch_size)[:, None]
        if self.random_non_queries:
            region[:] = rng.integers(0, self.vocab_size, size=region.shape)
        if self.axis == "pairs":
            region[:, 0] = FILLER
        region[rows, 2 * slots] = keys
        # Scored: each key's first occurrence among the query slots (a filler may repeat it).
        repeats = region[:, None, 0::2] == keys[:, :, None]
        first = 2 * np.argmax(repeats, axis=2)
        targets = np.zeros((batch_size, length), dtype=np.int64)
        mask = np.zeros((batch_size, length), dtype=bool)
        targets[rows, 2 * pairs + first] = values - half
        mask[rows, 2 * pairs + first] = True
        return Batch(inputs, targets, mask)

    def _query_slots(
        self, pairs: int, slots: int, batch_size: int, rng: np.random.Generator
    ) -> np.ndarray:
        """``[B, D]`` distinct slots, drawn one after another without replacement with
        probabilities proportional to a * i^(a-1): the exponential race of Efraimidis and
        Spirakis (largest u^(1/p_i) wins) samples exactly that, for the whole batch at once."""
        weights = self.power_a * np.arange(1, slots + 1, dtype=np.float64) ** (self.power_a - 1)
        race = np.log(rng.random((batch_size, slots))) / (weights / weights.sum())
        return np.argsort(-race, axis=1)[:, :pairs]

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _batch_size, length = inputs.shape
        half = self.vocab_size // 2
        pairs = self._context_pairs(inputs) if self.axis == "pairs" else self.pairs(length)
        self.check_length(pairs if self.axis == "pairs" else length)
        keys, values = inputs[:, 0 : 2 * pairs : 2], inputs[:, 1 : 2 * pairs : 2]
        if ((keys < 1) | (keys >= half)).any() or (values < half).any():
            raise CheBenchError(f"{self.name}: the context must alternate keys and values")
        if (np.diff(np.sort(keys, axis=1), axis=1) == 0).any():
            raise CheBenchError(f"{self.name}: the context keys must be distinct")
        targets = np.zeros(inputs.shape, dtype=np.int64)
        mask = np.zeros(inputs.shape, dtype=bool)
        for row, (row_keys, row_values) in enumerate(zip(keys, values, strict=True)):
            slot_tokens = list(inputs[row, 2 * pairs :: 2])
            for key, value in zip(row_keys, row_values, strict=True):
                if key not in slot_tokens:
                    raise CheBenchError(f"{self.name}: key {key} is never queried")
                position = 2 * pairs + 2 * slot_tokens.index(key)
                targets[row, position], mask[row, position] = value - half, True
        return targets, mask

    def _context_pairs(self, inputs: np.ndarray) -> int:
        """D read from the input (axis "pairs"): the longest run of (new key, value) pairs at
        the start; the sampler keeps the token after the context from extending it."""
        if inputs.shape[1] != self.sequence_length:
            raise CheBenchError(f"{self.name}: inputs must have {self.sequence_length} tokens")
        half = self.vocab_size // 2
        counts: set[int] = set()
        for row in inputs:
            seen: set[int] = set()
            while (
                2 * len(seen) + 1 < len(row)
                and 1 <= row[2 * len(seen)] < half
                and row[2 * len(seen) + 1] >= half
                and row[2 * len(seen)] not in seen
            ):
                seen.add(int(row[2 * len(seen)]))
            counts.add(len(seen))
        if len(counts) != 1:
            raise CheBenchError(
                f"{self.name}: the rows of a batch must share their number of pairs"
            )
        return counts.pop()
