"""Sinusoidal absolute encodings: plain (Vaswani) and randomized (Ruoss et al.)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from che_bench.encodings.base import Draws, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import check_positive, sinusoid
from che_bench.encodings.randomized import DEFAULT_NOISE_MAX_LENGTH, RandomOptions, RandomPositions

if TYPE_CHECKING:
    from typing_extensions import Unpack


@register("sincos", "sinusoidal")
class SinCosEncoding(PositionalEncoding):
    """Adds block-layout sin|cos features of the token positions to the embeddings.

    Options: ``max_time`` (10000); ``sin_cos_backward`` (False: positions ``0..T-1`` as in
    the randomized-PE code; True: ``T..1`` as in the CHE code, so the output placeholders at
    the end of the tape always get the same positions).
    """

    name = "sin_cos"
    description = "Sinusoidal absolute positions (block sin|cos) added to the embeddings."
    kind = "absolute"
    adds_to_embedding = True

    def __init__(
        self,
        *,
        max_time: float = 10000.0,
        sin_cos_backward: bool = False,
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(**shape)
        self.max_time = check_positive("max_time", max_time)
        self.backward = sin_cos_backward
        self.resolved_options = {"max_time": max_time, "sin_cos_backward": sin_cos_backward}

    def embed(self, x: torch.Tensor, draws: Draws | None = None) -> torch.Tensor:
        if draws is not None and draws.embedding is not None:  # positions [M, T] -> [M, 1, T, D]
            positions = draws.embedding[:, None]
        else:
            length = x.shape[-2]
            forward = torch.arange(length, device=x.device)
            positions = length - forward if self.backward else forward
        return x + sinusoid(positions, self.dim, self.max_time).to(x.dtype)


@register("random_sincos", "noisy_sin_cos")
class RandomSinCosEncoding(RandomPositions, SinCosEncoding):
    """Sinusoidal features of sorted random positions from ``[0, noise_max_length)``,
    drawn once per forward pass (all layers, all sequences of the batch).

    Options: ``noise_max_length`` (2048), ``randomize_at_eval`` (True), ``max_time`` (10000).
    """

    name = "random_sin_cos"
    description = "Randomized sinusoidal absolute positions (sorted draw from [0, L))."

    def __init__(
        self,
        *,
        max_time: float = 10000.0,
        noise_max_length: int = DEFAULT_NOISE_MAX_LENGTH,
        randomize_at_eval: bool = True,
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(max_time=max_time, **shape)
        self.random = RandomOptions(noise_max_length, randomize_at_eval)
        self.resolved_options = {"max_time": max_time, **self.random.recorded()}
