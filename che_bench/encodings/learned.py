"""Learned absolute encodings: plain and randomized (Ruoss et al.)."""

from __future__ import annotations

import torch
from torch import nn

from che_bench.encodings.base import PositionalEncoding, register
from che_bench.encodings.common import check_positive
from che_bench.encodings.randomized import DEFAULT_NOISE_MAX_LENGTH, RandomOptions, RandomPositions
from che_bench.errors import CheBenchError


@register("learnt")
class LearnedEncoding(PositionalEncoding):
    """Adds row ``p`` of a learned ``[max_positions, D]`` table to the embedding of token ``p``.

    Init: truncated normal (at +-2 std) with std ``learned_init_std`` = 1.0, the Haiku
    embedding default of the reference code. Rows never reached in training keep their
    random init, which is the expected failure of learned positions at longer lengths.
    A sequence longer than the table is an error (no silent clamping as in JAX).

    Options: ``max_positions`` (2048, enough for duplicate_string at n=500: T=1500),
    ``learned_init_std`` (1.0).
    """

    name = "learned"
    description = "Learned absolute position table added to the embeddings."
    kind = "absolute"
    adds_to_embedding = True

    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        layers: int,
        train_max_tokens: int,
        max_positions: int = 2048,
        learned_init_std: float = 1.0,
    ) -> None:
        super().__init__(dim=dim, heads=heads, layers=layers, train_max_tokens=train_max_tokens)
        check_positive("max_positions", max_positions)
        check_positive("learned_init_std", learned_init_std)
        self.table = nn.Parameter(torch.empty(max_positions, dim))
        nn.init.trunc_normal_(
            self.table, std=learned_init_std, a=-2 * learned_init_std, b=2 * learned_init_std
        )
        self.resolved_options = {
            "max_positions": max_positions,
            "learned_init_std": learned_init_std,
        }

    def positions(self, length: int) -> torch.Tensor:
        rows = self.table.shape[0]
        if length > rows:
            raise CheBenchError(
                f"learned encoding: sequence of {length} tokens exceeds its table of {rows} "
                "rows; build it with a larger max_positions"
            )
        return torch.arange(length)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[self.positions(x.shape[1]).to(x.device)].to(x.dtype)


@register("random_learnt", "noisy_learnt", "noisy_learned")
class RandomLearnedEncoding(RandomPositions, LearnedEncoding):
    """Learned table of ``noise_max_length`` rows, read at sorted random positions drawn
    once per forward pass (all layers, all sequences of the batch).

    Options: ``noise_max_length`` (2048), ``randomize_at_eval`` (True), ``learned_init_std``.
    """

    name = "random_learned"
    description = "Learned absolute table read at randomized positions (sorted draw from [0, L))."

    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        layers: int,
        train_max_tokens: int,
        noise_max_length: int = DEFAULT_NOISE_MAX_LENGTH,
        randomize_at_eval: bool = True,
        learned_init_std: float = 1.0,
    ) -> None:
        super().__init__(
            dim=dim,
            heads=heads,
            layers=layers,
            train_max_tokens=train_max_tokens,
            max_positions=noise_max_length,
            learned_init_std=learned_init_std,
        )
        self.random = RandomOptions(noise_max_length, randomize_at_eval)
        self.resolved_options = {**self.random.recorded(), "learned_init_std": learned_init_std}
