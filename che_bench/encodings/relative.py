"""Transformer-XL relative attention: plain and randomized (Ruoss et al.)."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from che_bench.encodings.base import PositionalEncoding, register
from che_bench.encodings.common import check_positive, offset_index, offsets, sinusoid, two_sided
from che_bench.encodings.randomized import (
    DEFAULT_NOISE_MAX_LENGTH,
    LayerDraws,
    RandomizedHook,
    RandomOptions,
    sample_distances,
)


class RelativeHook(RandomizedHook):
    """Transformer-XL scores with per-layer content bias ``u``, position bias ``v`` and
    projection ``W_R`` of the sinusoid ``r_o`` of the signed offset ``o = j - i``::

        S_ij = [(q_i + u) . k_j + (q_i + v) . (W_R r_{j-i})] / sqrt(d_h)

    The position term is computed for the offsets a row chunk needs and gathered at
    ``o = j - i`` (no relative-shift reshaping), so row chunks are exact.

    Randomized: the offset ``o`` fed to the sinusoid becomes ``+s_o`` right of the query and
    ``-s_|o|`` left of it, with ``s_1 < ... < s_{T-1}`` a sorted draw from ``[1, L)``
    (``randomize_both_sides``: an independent draw for the left side). ``reference_bug``
    reproduces the public reference code instead: every key at or right of the query gets
    position ``L - 1`` and a key ``d`` to the left gets ``L - s_d``.
    """

    # content, the position term over R + T - 1 offsets, the gathered term and the sum
    score_maps = 5

    def __init__(
        self,
        dim: int,
        heads: int,
        max_time: float,
        layer: int,
        draws: LayerDraws | None = None,
        both_sides: bool = False,
        reference_bug: bool = False,
    ) -> None:
        super().__init__(layer, draws)
        head_dim = dim // heads
        self.dim, self.heads, self.max_time = dim, heads, max_time
        self.both_sides, self.reference_bug = both_sides, reference_bug
        self.u = nn.Parameter(torch.randn(heads, head_dim) * 0.02)
        self.v = nn.Parameter(torch.randn(heads, head_dim) * 0.02)
        self.w_r = nn.Linear(dim, dim, bias=False)
        # Haiku's default linear init, as in the reference code.
        std = dim**-0.5
        nn.init.trunc_normal_(self.w_r.weight, std=std, a=-2 * std, b=2 * std)

    def offset_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The value fed to the sinusoid for every offset ``-(T-1) .. T-1`` (per-offset order)."""
        drawn = self.draw(length, partial(sample_distances, both_sides=self.both_sides))
        if drawn is None:
            return offsets(length, device).float()

        left, right = (side.to(device, torch.float32) for side in drawn)
        if self.reference_bug:
            limit = self.draws.random.noise_max_length
            at_or_right = torch.full((length,), limit - 1.0, device=device)
            return torch.cat([limit - left.flip(0), at_or_right])
        return two_sided(-left, right)

    def prepare(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        length = q.shape[-2]
        features = sinusoid(self.offset_positions(length, q.device), self.dim, self.max_time)
        projected = self.w_r(features.to(self.w_r.weight.dtype))  # [2T-1, D]
        per_head = projected.view(2 * length - 1, self.heads, -1).transpose(0, 1)  # [H, 2T-1, d_h]
        return q, k, per_head

    def scores(
        self, q: torch.Tensor, k: torch.Tensor, rows: slice, ctx: torch.Tensor
    ) -> torch.Tensor:
        length = k.shape[-2]
        first, stop, _ = rows.indices(length)
        queries = q[:, :, rows]
        content = torch.matmul(queries + self.u[:, None], k.transpose(-1, -2))
        # Rows first..stop-1 need offsets -(stop-1) .. T-1-first only.
        low = (length - 1) - (stop - 1)
        needed = ctx[:, low : (length - 1) + (length - first)]
        position = torch.matmul(queries + self.v[:, None], needed.transpose(-1, -2))
        index = (offset_index(rows, length, q.device) - low).expand_as(content)
        return (content + position.gather(-1, index)) / math.sqrt(q.shape[-1])


@register("txl", "transformer_xl")
class RelativeEncoding(PositionalEncoding):
    """Transformer-XL relative attention (per-layer ``u``, ``v`` ~ N(0, 0.02^2) and ``W_R``).

    Options: ``max_time`` (10000) of the offset sinusoid.
    """

    name = "relative"
    description = "Transformer-XL relative attention (sinusoid of j - i, per-layer u, v, W_R)."
    kind = "relative"

    def __init__(
        self, *, dim: int, heads: int, layers: int, train_max_tokens: int, max_time: float = 10000.0
    ) -> None:
        super().__init__(dim=dim, heads=heads, layers=layers, train_max_tokens=train_max_tokens)
        check_positive("max_time", max_time)
        self.hooks = nn.ModuleList(
            RelativeHook(dim, heads, max_time, layer) for layer in range(layers)
        )
        self.resolved_options = {"max_time": max_time}


@register("noisy_relative")
class RandomRelativeEncoding(PositionalEncoding):
    """Transformer-XL with randomized offsets: offset ``d`` is replaced by ``s_d`` from a
    sorted draw of distinct values in ``[1, noise_max_length)`` (mirrored to the left).

    Options: ``noise_max_length`` (2048), ``randomize_at_eval`` (True), ``random_per_layer``
    (True), ``randomize_both_sides`` (False), ``relative_reference_bug`` (False; True
    reproduces the public reference code, see ``RelativeHook``), ``max_time`` (10000).
    """

    name = "random_relative"
    description = "Randomized Transformer-XL relative attention (offsets drawn from [1, L))."
    kind = "relative"
    randomized = True

    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        layers: int,
        train_max_tokens: int,
        max_time: float = 10000.0,
        noise_max_length: int = DEFAULT_NOISE_MAX_LENGTH,
        randomize_at_eval: bool = True,
        random_per_layer: bool = True,
        randomize_both_sides: bool = False,
        relative_reference_bug: bool = False,
    ) -> None:
        super().__init__(dim=dim, heads=heads, layers=layers, train_max_tokens=train_max_tokens)
        check_positive("max_time", max_time)
        draws = LayerDraws(RandomOptions(noise_max_length, randomize_at_eval), random_per_layer)
        self.hooks = nn.ModuleList(
            RelativeHook(
                dim,
                heads,
                max_time,
                layer,
                draws,
                both_sides=randomize_both_sides,
                reference_bug=relative_reference_bug,
            )
            for layer in range(layers)
        )
        self.resolved_options = {
            "max_time": max_time,
            **draws.recorded(),
            "randomize_both_sides": randomize_both_sides,
            "relative_reference_bug": relative_reference_bug,
        }
