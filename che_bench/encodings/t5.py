"""T5 bucketed relative bias (bidirectional buckets)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from che_bench.encodings.base import AttentionHook, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import layer_hooks, offsets, toeplitz_rows
from che_bench.errors import CheBenchError
from che_bench.members import init_members_

if TYPE_CHECKING:
    from typing_extensions import Unpack


def t5_buckets(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Bidirectional T5 bucket of each signed offset ``j - i`` (long tensor in, long out).

    Half the buckets serve keys to the right (offset ``+num_buckets/2``); within a half,
    distances below ``max_exact = num_buckets/4`` get their own bucket and longer ones share
    logarithmically wider buckets up to ``max_distance``, beyond which all share the last.
    """
    half = num_buckets // 2
    max_exact = half // 2
    distance = relative.abs()
    # clamp before the log: the small branch is discarded anyway, but log(0) would be -inf.
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(
        max_distance / max_exact
    )
    far = (max_exact + (log_ratio * (half - max_exact)).long()).clamp(max=half - 1)
    return (relative > 0).long() * half + torch.where(distance < max_exact, distance, far)


class T5Hook(AttentionHook):
    """``Bias[h, i, j] = scale * table[bucket(j - i), h]`` (a ``[buckets, H]`` table per
    member), added to the scaled scores."""

    def __init__(
        self,
        heads: int,
        num_buckets: int,
        max_distance: int,
        neox_scaling: bool,
        dim: int,
        members: int,
    ) -> None:
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.table = nn.Parameter(torch.empty(members, num_buckets, heads))
        if neox_scaling:  # NeoX: Xavier init, looked-up bias times sqrt(d_h)
            init_members_(self.table, nn.init.xavier_normal_)
            self.scale = math.sqrt(dim // heads)
        else:  # HF T5 init std D^-1/2, raw table added to the scaled scores
            init_members_(self.table, lambda table: nn.init.normal_(table, std=dim**-0.5))
            self.scale = 1.0

    def bias(self, rows: slice, length: int, ctx: None) -> torch.Tensor:
        relative = offsets(length, self.table.device)
        buckets = t5_buckets(relative, self.num_buckets, self.max_distance)
        per_offset = self.table[:, buckets].transpose(1, 2) * self.scale  # [M, H, 2T-1]
        return toeplitz_rows(per_offset, rows, length)[:, None]


@register("t5_bias", "t5_relative")
class T5Encoding(PositionalEncoding):
    """T5 relative bias with bidirectional buckets, one table shared by all layers.

    Options: ``t5_num_buckets`` (32), ``t5_max_distance`` (128), ``t5_neox_scaling`` (False:
    init std ``D^-1/2`` and the raw table added to the scaled scores; True: Xavier init and
    the bias multiplied by ``sqrt(d_h)`` as in NeoX/DAPE), ``share_across_layers`` (True).
    """

    name = "t5"
    description = "T5 bucketed relative bias (32 bidirectional buckets, max distance 128)."
    kind = "relative"
    carries_bias = True

    def __init__(
        self,
        *,
        t5_num_buckets: int = 32,
        t5_max_distance: int = 128,
        t5_neox_scaling: bool = False,
        share_across_layers: bool = True,
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(**shape)
        if t5_num_buckets < 4 or t5_num_buckets % 4:
            raise CheBenchError(
                f"t5_num_buckets must be a positive multiple of 4; got {t5_num_buckets}"
            )
        if t5_max_distance <= t5_num_buckets // 4:
            raise CheBenchError("t5_max_distance must exceed t5_num_buckets / 4")
        self.hooks = layer_hooks(
            lambda: T5Hook(
                self.heads, t5_num_buckets, t5_max_distance, t5_neox_scaling, self.dim, self.members
            ),
            self.layers,
            share_across_layers,
        )
        self.resolved_options = {
            "t5_num_buckets": t5_num_buckets,
            "t5_max_distance": t5_max_distance,
            "t5_neox_scaling": t5_neox_scaling,
            "share_across_layers": share_across_layers,
        }
