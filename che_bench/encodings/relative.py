"""Transformer-XL relative attention: plain and randomized (Ruoss et al.)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from che_bench.encodings.base import AttentionHook, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import check_positive, offset_index, offsets, sinusoid, two_sided
from che_bench.encodings.randomized import (
    DEFAULT_NOISE_MAX_LENGTH,
    DistanceDraws,
    Distances,
    RandomizedLayers,
    RandomOptions,
)
from che_bench.members import MemberLinear, init_members_

if TYPE_CHECKING:
    from typing_extensions import Unpack


class RelativeHook(AttentionHook):
    """Transformer-XL scores with per-layer content bias ``u``, position bias ``v`` and
    projection ``W_R`` of the sinusoid ``r_o`` of the signed offset ``o = j - i``::

        S_ij = [(q_i + u) . k_j + (q_i + v) . (W_R r_{j-i})] / sqrt(d_h)

    The position term is computed for the offsets a row chunk needs and gathered at
    ``o = j - i`` (no relative-shift reshaping), so row chunks are exact.

    Randomized: with the layer's sample (left, right) ``[M, T-1]`` of sorted distances
    ``s_1 < ... < s_{T-1}`` from ``[1, L)``, the offset ``o`` fed to the sinusoid becomes
    ``+s_o`` right of the query and ``-s_|o|`` left of it. ``reference_bug`` reproduces the
    public reference code instead: every key at or right of the query gets position ``L - 1``
    and a key ``d`` to the left gets ``L - s_d``.
    """

    # content, the position term over R + T - 1 offsets, the gathered term and the sum
    score_maps = 5

    def __init__(
        self,
        dim: int,
        heads: int,
        max_time: float,
        members: int,
        reference_bug_limit: int | None = None,
    ) -> None:
        super().__init__()
        head_dim = dim // heads
        self.dim, self.heads, self.max_time = dim, heads, max_time
        self.reference_bug_limit = reference_bug_limit
        self.u = nn.Parameter(torch.empty(members, heads, head_dim))
        self.v = nn.Parameter(torch.empty(members, heads, head_dim))
        for bias in (self.u, self.v):
            init_members_(bias, lambda b: nn.init.normal_(b, std=0.02))
        # Haiku's default linear init, as in the reference code.
        self.w_r = MemberLinear(members, dim, dim, bias=False)

    def offset_positions(
        self, length: int, device: torch.device, draw: Distances | None
    ) -> torch.Tensor:
        """The value fed to the sinusoid for every offset ``-(T-1) .. T-1`` (per-offset order),
        ``[M or 1, 2T-1]``."""
        if draw is None:
            return offsets(length, device).float()[None]
        left, right = (side.float() for side in draw)
        if self.reference_bug_limit is not None:
            limit = self.reference_bug_limit
            at_or_right = torch.full((left.shape[0], length), limit - 1.0, device=device)
            return torch.cat([limit - left.flip(-1), at_or_right], dim=-1)
        return two_sided(-left, right)

    def prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        draw: Distances | None = None,
        x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ctx: the projected offset features per head, ``[M, H, 2T-1, d_h]``."""
        length, members = q.shape[-2], q.shape[0]
        features = sinusoid(self.offset_positions(length, q.device, draw), self.dim, self.max_time)
        features = features.expand(members, -1, -1).to(self.w_r.weight.dtype)
        projected = self.w_r(features)  # [M, 2T-1, D]
        per_head = projected.view(members, 2 * length - 1, self.heads, -1).transpose(1, 2)
        return q, k, per_head

    def scores(
        self, q: torch.Tensor, k: torch.Tensor, rows: slice, ctx: torch.Tensor
    ) -> torch.Tensor:
        length = k.shape[-2]
        first, stop, _ = rows.indices(length)
        queries = q[..., rows, :]
        u, v = (bias[:, None, :, None, :] for bias in (self.u, self.v))  # [M, 1, H, 1, d_h]
        content = torch.matmul(queries + u, k.transpose(-1, -2))
        # Rows first..stop-1 need offsets -(stop-1) .. T-1-first only.
        low = (length - 1) - (stop - 1)
        needed = ctx[:, None, :, low : (length - 1) + (length - first)]  # [M, 1, H, O, d_h]
        position = torch.matmul(queries + v, needed.transpose(-1, -2))
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

    def __init__(self, *, max_time: float = 10000.0, **shape: Unpack[EncodingShape]) -> None:
        super().__init__(**shape)
        check_positive("max_time", max_time)
        self.hooks = nn.ModuleList(
            RelativeHook(self.dim, self.heads, max_time, self.members) for _ in range(self.layers)
        )
        self.resolved_options = {"max_time": max_time}


@register("noisy_relative")
class RandomRelativeEncoding(RandomizedLayers, PositionalEncoding):
    """Transformer-XL with randomized offsets: offset ``d`` is replaced by ``s_d`` from a
    sorted draw of distinct values in ``[1, noise_max_length)`` (mirrored to the left).

    Options: ``noise_max_length`` (2048), ``randomize_at_eval`` (True), ``random_per_layer``
    (True), ``randomize_both_sides`` (False), ``relative_reference_bug`` (False; True
    reproduces the public reference code, see ``RelativeHook``), ``max_time`` (10000).
    """

    name = "random_relative"
    description = "Randomized Transformer-XL relative attention (offsets drawn from [1, L))."
    kind = "relative"

    def __init__(
        self,
        *,
        max_time: float = 10000.0,
        noise_max_length: int = DEFAULT_NOISE_MAX_LENGTH,
        randomize_at_eval: bool = True,
        random_per_layer: bool = True,
        randomize_both_sides: bool = False,
        relative_reference_bug: bool = False,
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(**shape)
        check_positive("max_time", max_time)
        self.layer_draws = DistanceDraws(
            RandomOptions(noise_max_length, randomize_at_eval),
            random_per_layer,
            self.layers,
            randomize_both_sides,
        )
        bug_limit = noise_max_length if relative_reference_bug else None
        self.hooks = nn.ModuleList(
            RelativeHook(self.dim, self.heads, max_time, self.members, bug_limit)
            for _ in range(self.layers)
        )
        self.resolved_options = {
            "max_time": max_time,
            **self.layer_draws.recorded(),
            "relative_reference_bug": relative_reference_bug,
        }
