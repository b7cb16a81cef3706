"""ALiBi linear distance biases for a bidirectional encoder: plain and randomized."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from che_bench.encodings.base import AttentionHook, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import check_choice, toeplitz_rows, two_sided
from che_bench.encodings.randomized import (
    DEFAULT_NOISE_MAX_LENGTH,
    DistanceDraws,
    Distances,
    RandomizedLayers,
    RandomOptions,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

MODES = ("symmetric_offset", "symmetric", "two_slopes")


def alibi_slopes(heads: int) -> list[float]:
    """Head slopes of the ALiBi recipe: ``2^(-8h/H)`` for ``h = 1..H`` when ``H`` is a power
    of two; otherwise the slopes of the largest power of two below ``H`` followed by every
    other slope of the next power of two (e.g. H=6: 1/4, 1/16, 1/64, 1/256, 1/2, 1/8)."""

    def geometric(count: int) -> list[float]:
        ratio = 2 ** (-8 / count)
        return [ratio ** (h + 1) for h in range(count)]

    lower = 2 ** math.floor(math.log2(heads))
    return geometric(lower) + geometric(2 * lower)[0::2][: heads - lower]


class ALiBiHook(AttentionHook):
    """``Bias[h, i, j] = -m_h * dist(i, j)`` for the requested query rows.

    Modes: ``symmetric_offset`` (default, randomized-PE code): ``dist = |i - j| - 0.5`` for
    keys left of the query and ``|i - j|`` otherwise, so left and right differ;
    ``symmetric``: ``|i - j|`` (cannot tell left from right); ``two_slopes``: ``|i - j|`` with
    the slopes in reverse head order for keys on the right.

    Randomized: the layer's sample (left, right) ``[M, T-1]`` of sorted distances
    ``s_1 < ... < s_{T-1}`` from ``[1, L)`` replaces token distances ``1..T-1``; 0 stays 0.
    The bias then differs per member: ``[M, 1, H, R, T]`` instead of ``[1, 1, H, R, T]``.
    """

    left_slopes: torch.Tensor
    right_slopes: torch.Tensor

    def __init__(self, heads: int, mode: str) -> None:
        super().__init__()
        slopes = torch.tensor(alibi_slopes(heads))
        self.register_buffer("left_slopes", slopes, persistent=False)
        right = slopes.flip(0) if mode == "two_slopes" else slopes
        self.register_buffer("right_slopes", right, persistent=False)
        self.left_offset = 0.5 if mode == "symmetric_offset" else 0.0

    def prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        draw: Distances | None = None,
        x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Distances]:
        """ctx: left and right distances ``[M or 1, T-1]`` of the keys 1..T-1 tokens away."""
        if draw is None:
            plain = torch.arange(1, q.shape[-2], device=q.device, dtype=torch.float32)[None]
            return q, k, (plain, plain)
        left, right = draw
        return q, k, (left.float(), right.float())

    def bias(
        self, rows: slice, length: int, ctx: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        left, right = ctx
        per_offset = two_sided(  # [M, H, 2T-1]
            -self.left_slopes[:, None] * (left[:, None] - self.left_offset),
            -self.right_slopes[:, None] * right[:, None],
        )
        return toeplitz_rows(per_offset, rows, length)[:, None]

    def reference_bias(
        self, query: int, key: int, ctx: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """``-m_h * dist(query, key)``, ``[M or 1, 1, H]``, one pair at a time (the check's
        reference for ``bias``)."""
        left, right = ctx
        if key < query:
            value = -self.left_slopes * (left[:, query - key - 1, None] - self.left_offset)
        elif key > query:
            value = -self.right_slopes * right[:, key - query - 1, None]
        else:
            value = torch.zeros(left.shape[0], len(self.left_slopes), device=left.device)
        return value[:, None]


@register()
class ALiBiEncoding(PositionalEncoding):
    """ALiBi with fixed slopes shared by all layers, made bidirectional.

    Options: ``alibi_mode`` ("symmetric_offset" (default), "symmetric", "two_slopes"; see
    ``ALiBiHook``).
    """

    name = "alibi"
    description = "ALiBi distance penalty, bidirectional with a half-slope left offset."
    kind = "relative"
    carries_bias = True
    option_choices: ClassVar[dict[str, tuple[Any, ...]]] = {"alibi_mode": MODES}

    def __init__(
        self, *, alibi_mode: str = "symmetric_offset", **shape: Unpack[EncodingShape]
    ) -> None:
        super().__init__(**shape)
        check_choice("alibi_mode", alibi_mode, MODES)
        self.hooks = nn.ModuleList(ALiBiHook(self.heads, alibi_mode) for _ in range(self.layers))
        self.resolved_options = {"alibi_mode": alibi_mode}


@register("noisy_alibi")
class RandomALiBiEncoding(RandomizedLayers, ALiBiEncoding):
    """ALiBi over randomized distances: token distance ``d`` becomes ``s_d`` from a sorted
    draw of distinct values in ``[1, noise_max_length)``; the +0.5 left offset is kept.

    Options: ``noise_max_length`` (2048), ``randomize_at_eval`` (True), ``random_per_layer``
    (True), ``randomize_both_sides`` (False), ``alibi_mode``.
    """

    name = "random_alibi"
    description = "Randomized ALiBi (distances replaced by a sorted draw from [1, L))."

    def __init__(
        self,
        *,
        alibi_mode: str = "symmetric_offset",
        noise_max_length: int = DEFAULT_NOISE_MAX_LENGTH,
        randomize_at_eval: bool = True,
        random_per_layer: bool = True,
        randomize_both_sides: bool = False,
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(alibi_mode=alibi_mode, **shape)
        self.layer_draws = DistanceDraws(
            RandomOptions(noise_max_length, randomize_at_eval),
            random_per_layer,
            self.layers,
            randomize_both_sides,
        )
        self.resolved_options = {**self.resolved_options, **self.layer_draws.recorded()}
