"""Rotary position embeddings: plain and randomized (Ruoss et al.)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from che_bench.encodings.base import AttentionHook, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import check_choice, check_positive
from che_bench.encodings.randomized import (
    DEFAULT_NOISE_MAX_LENGTH,
    LayerDraws,
    RandomizedLayers,
    RandomOptions,
    sample_sorted,
)
from che_bench.errors import CheBenchError

if TYPE_CHECKING:
    from typing_extensions import Unpack

PAIRINGS = ("interleaved", "half")


def rotate(x: torch.Tensor, angles: torch.Tensor, pairing: str) -> torch.Tensor:
    """Rotate the feature pairs of ``x [..., T, d]`` by ``angles [..., T, d/2]`` (in fp32).

    ``interleaved`` pairs features ``(2m, 2m+1)`` (randomized-PE/CHE code); ``half`` pairs
    ``(m, m + d/2)`` (NeoX ``rotate_half``). Pair ``m`` turns by ``angles[:, m]``.
    """
    cos, sin = angles.cos(), angles.sin()
    features = x.float()
    if pairing == "interleaved":
        a, b = features[..., 0::2], features[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = features.chunk(2, dim=-1)
        rotated = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return rotated.to(x.dtype)


class RotaryHook(AttentionHook):
    """Rotates q and k by ``position * theta_m``, ``theta_m = base^(-2m/d_h)``; scores of the
    rotated vectors then depend on ``i - j`` only. Randomized: the layer's sample of sorted
    positions ``[M, T]`` replaces ``0..T-1``, the same for q and k."""

    theta: torch.Tensor

    def __init__(self, head_dim: int, base: float, pairing: str) -> None:
        super().__init__()
        exponents = torch.arange(head_dim // 2, dtype=torch.float64) * (2 / head_dim)
        self.register_buffer("theta", (base**-exponents).float(), persistent=False)
        self.pairing = pairing

    def prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        draw: torch.Tensor | None = None,
        x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        if draw is None:
            angles = torch.arange(q.shape[-2], device=q.device).float()[:, None] * self.theta
        else:  # [M, T] positions -> [M, 1, 1, T, d/2] angles
            angles = (draw.float()[..., None] * self.theta)[:, None, None]
        return rotate(q, angles, self.pairing), rotate(k, angles, self.pairing), None


def check_rope_options(head_dim: int, base: float, pairing: str) -> None:
    if head_dim % 2:
        raise CheBenchError(f"RoPE needs an even head width; got {head_dim}")
    check_positive("rope_base", base)
    check_choice("rope_pairing", pairing, PAIRINGS)


@register("rotary")
class RotaryEncoding(PositionalEncoding):
    """RoPE on every head dimension of q and k, in every layer.

    Options: ``rope_base`` (10000), ``rope_pairing`` ("interleaved" as in the CHE code, or
    "half" as in NeoX; equivalent up to a fixed permutation of the q/k projections).
    """

    name = "rope"
    description = "Rotary position embedding of q and k (scores depend on i - j)."
    kind = "relative"
    option_choices: ClassVar[dict[str, tuple[Any, ...]]] = {"rope_pairing": PAIRINGS}

    def __init__(
        self,
        *,
        rope_base: float = 10000.0,
        rope_pairing: str = "interleaved",
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(**shape)
        check_rope_options(self.head_dim, rope_base, rope_pairing)
        self.hooks = nn.ModuleList(
            RotaryHook(self.head_dim, rope_base, rope_pairing) for _ in range(self.layers)
        )
        self.resolved_options = {"rope_base": rope_base, "rope_pairing": rope_pairing}


@register("random_rotary", "noisy_rotary", "noisy_rope")
class RandomRotaryEncoding(RandomizedLayers, RotaryEncoding):
    """RoPE at sorted random positions from ``[0, noise_max_length)``, drawn separately in
    every layer by default (as in the reference), the same draw for q and k.

    Options: ``noise_max_length`` (2048), ``randomize_at_eval`` (True), ``random_per_layer``
    (True; False draws once per forward pass), ``rope_base``, ``rope_pairing``.
    """

    name = "random_rope"
    description = "Randomized RoPE (sorted positions drawn from [0, L), per layer)."

    def __init__(
        self,
        *,
        rope_base: float = 10000.0,
        rope_pairing: str = "interleaved",
        noise_max_length: int = DEFAULT_NOISE_MAX_LENGTH,
        randomize_at_eval: bool = True,
        random_per_layer: bool = True,
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(rope_base=rope_base, rope_pairing=rope_pairing, **shape)
        self.layer_draws = LayerDraws(
            RandomOptions(noise_max_length, randomize_at_eval),
            random_per_layer,
            self.layers,
            sample_sorted,
        )
        self.resolved_options = {**self.resolved_options, **self.layer_draws.recorded()}
