"""Learned absolute encodings: plain and randomized (Ruoss et al.)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from che_bench.encodings.base import Draws, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import check_positive
from che_bench.encodings.randomized import DEFAULT_NOISE_MAX_LENGTH, RandomOptions, RandomPositions
from che_bench.errors import CheBenchError
from che_bench.members import init_members_, truncated_normal_

if TYPE_CHECKING:
    from typing_extensions import Unpack


@register("learnt")
class LearnedEncoding(PositionalEncoding):
    """Adds row ``p`` of a learned ``[max_positions, D]`` table (one per member) to the
    embedding of token ``p``.

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
        max_positions: int = 2048,
        learned_init_std: float = 1.0,
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(**shape)
        check_positive("max_positions", max_positions)
        check_positive("learned_init_std", learned_init_std)
        self.table = nn.Parameter(torch.empty(self.members, max_positions, self.dim))
        init_members_(self.table, lambda table: truncated_normal_(table, learned_init_std))
        self.resolved_options = {
            "max_positions": max_positions,
            "learned_init_std": learned_init_std,
        }

    def max_tokens(self) -> int:
        return self.table.shape[1]

    def embed(self, x: torch.Tensor, draws: Draws | None = None) -> torch.Tensor:
        length, rows = x.shape[-2], self.table.shape[1]
        if draws is not None and draws.embedding is not None:  # positions [M, T], own rows
            positions = draws.embedding
            rows_read = self.table.gather(1, positions[..., None].expand(-1, -1, self.dim))
        elif length > rows:
            raise CheBenchError(
                f"learned encoding: sequence of {length} tokens exceeds its table of {rows} "
                "rows; build it with a larger max_positions"
            )
        else:
            rows_read = self.table[:, :length]
        return x + rows_read[:, None].to(x.dtype)


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
        noise_max_length: int = DEFAULT_NOISE_MAX_LENGTH,
        randomize_at_eval: bool = True,
        learned_init_std: float = 1.0,
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(max_positions=noise_max_length, learned_init_std=learned_init_std, **shape)
        self.random = RandomOptions(noise_max_length, randomize_at_eval)
        self.resolved_options = {**self.random.recorded(), "learned_init_std": learned_init_std}
