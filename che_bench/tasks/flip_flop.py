"""Flip-flop language modelling (Liu et al. 2023, "Exposing Attention Glitches with Flip-Flop
Language Modeling", arXiv 2306.00946; data release: Hugging Face synthseq/flipflop), generated
here from the seed; spec: shared/spec/word_problems.md 4."""

from __future__ import annotations

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.tasks.base import Batch, Task

WRITE, READ, IGNORE = 0, 1, 2
#: Token id of data bit b: ``BIT0 + b`` (the release's ids: w 0, r 1, i 2, "0" 3, "1" 4).
BIT0 = 3


class FlipFlop(Task):
    """FFL(p): n instructions, each followed by a data bit (2n tokens, ids w 0, r 1, i 2,
    "0" 3, "1" 4). The first instruction is w, the last r, the others i.i.d. w, r, i with
    probabilities ((1-p)/2, (1-p)/2, p), p = ``p_ignore``; the bit after w or i is uniform,
    the bit after r is the bit of the latest w. Scored (the paper's "clean" mode): the bit
    that follows each r, predicted in place at the r itself, so the loss and the accuracy
    count the reads only; 1 - accuracy is the read error ("glitch") rate.

    The official splits: train and val p = 0.8, val_sparse p = 0.98, val_dense p = 0.1, at
    T = 512 tokens (n = 256). The task is language modelling: it is causal by default, and
    with bidirectional attention (``--no-causal``) the answer, the next token, is visible.

    Example (n = 4): ``w 1 i 0 r 1 r 1`` -> ``. . . . 1 . 1 .`` (``.`` not scored).
    """

    name = "flip_flop"
    level = "regular"
    input_size = 5
    output_size = 2
    min_length = 2
    output_layout = "in_place"
    causal = True  # next-token prediction
    output_length_formula = "2n (in place)"
    length_label = "instructions n (2n tokens)"
    listed_params = ({"p_ignore": 0.98}, {"p_ignore": 0.1})

    def __init__(self, p_ignore: float = 0.8) -> None:
        if isinstance(p_ignore, bool) or not isinstance(p_ignore, (int, float)):
            raise CheBenchError(f"task 'flip_flop': p_ignore must be a number, got {p_ignore!r}")
        if not 0 <= p_ignore <= 1:
            raise CheBenchError(f"task 'flip_flop': p_ignore must lie in [0, 1], got {p_ignore}")
        self.p_ignore = float(p_ignore)

    def params(self) -> dict:
        return {"p_ignore": self.p_ignore}

    @property
    def input_symbols(self) -> tuple[str, ...]:
        return ("w", "r", "i", "0", "1")

    def input_length(self, n: int) -> int:
        return 2 * n

    def output_length(self, n: int) -> int:
        return 2 * n

    def _sample(self, n: int, batch_size: int, rng: np.random.Generator) -> Batch:
        p_write = (1 - self.p_ignore) / 2
        instructions = rng.choice(3, size=(batch_size, n), p=[p_write, p_write, 1 - 2 * p_write])
        instructions[:, 0], instructions[:, -1] = WRITE, READ
        bits = rng.integers(0, 2, size=(batch_size, n))
        # Each read repeats the bit of the latest write before it (the first one is a write).
        positions = np.broadcast_to(np.arange(n), (batch_size, n))
        latest_write = np.maximum.accumulate(np.where(instructions == WRITE, positions, 0), axis=1)
        reads = instructions == READ
        bits = np.where(reads, np.take_along_axis(bits, latest_write, axis=1), bits)
        inputs = np.empty((batch_size, 2 * n), dtype=np.int64)
        inputs[:, 0::2], inputs[:, 1::2] = instructions, BIT0 + bits
        targets = np.zeros(inputs.shape, dtype=np.int64)
        mask = np.zeros(inputs.shape, dtype=bool)
        targets[:, 0::2] = np.where(reads, bits, 0)
        mask[:, 0::2] = reads
        return Batch(inputs, targets, mask)

    def _solve(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if inputs.shape[1] % 2:
            raise CheBenchError(f"{self.name}: inputs must hold instruction-bit pairs")
        targets = np.zeros(inputs.shape, dtype=np.int64)
        mask = np.zeros(inputs.shape, dtype=bool)
        for row, tokens in enumerate(inputs.tolist()):
            instructions, bits = tokens[0::2], tokens[1::2]
            if (
                instructions[0] != WRITE
                or instructions[-1] != READ
                or max(instructions) > IGNORE
                or min(bits) < BIT0
            ):
                raise CheBenchError(
                    f"{self.name}: expected w, r, i each followed by a bit, first w, last r"
                )
            memory = 0  # set by the first instruction, a write
            for index, (instruction, bit) in enumerate(zip(instructions, bits, strict=True)):
                if instruction == WRITE:
                    memory = bit - BIT0
                elif instruction == READ:
                    targets[row, 2 * index], mask[row, 2 * index] = memory, True
        return targets, mask
