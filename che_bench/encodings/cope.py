"""CoPE (contextual position encoding), with left/right tables for an encoder."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from che_bench.encodings.base import AttentionHook, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import query_positions, running_sum
from che_bench.errors import CheBenchError
from che_bench.members import per_member

if TYPE_CHECKING:
    from typing_extensions import Unpack


class CopeHook(AttentionHook):
    """Contextual positions counted by sigmoid gates, per head, bidirectional.

    With gates ``g_it = sigmoid(q_i . k_t / sqrt(d_h))``, a key left of the query (or the
    query itself) sits at ``p_ij = sum_{t=j..i} g_it``, a key on the right at
    ``p_ij = sum_{t=i..j} g_it``; ``p`` is clamped to ``npos - 1``. The position logit
    interpolates ``z_i[n] = q_i . e[n]`` between ``floor(p)`` and ``ceil(p)`` in the table of
    the key's side (``e_left`` or ``e_right``, ``[M, d_h, npos]``, zeros init, shared by the
    heads), and is added before the ``1/sqrt(d_h)`` scaling, as in the official code.
    """

    # gates, two cumulative counts (and their flips), positions, two int64 indices, two
    # gathered logits and the interpolation
    score_maps = 16

    def __init__(self, head_dim: int, npos: int, members: int) -> None:
        super().__init__()
        self.npos = npos
        self.left = nn.Parameter(torch.zeros(members, head_dim, npos))
        self.right = nn.Parameter(torch.zeros(members, head_dim, npos))

    def scores(self, q: torch.Tensor, k: torch.Tensor, rows: slice, ctx: None) -> torch.Tensor:
        length = k.shape[-2]
        queries = q[..., rows, :]
        content = torch.matmul(queries, k.transpose(-1, -2))  # [M, B, H, R, T], unscaled
        scale = math.sqrt(q.shape[-1])
        gates = torch.sigmoid(content.float() / scale)
        query = query_positions(rows, length, q.device)[:, None]
        key = torch.arange(length, device=q.device)[None, :]
        is_left = key <= query  # the query itself counts as left, like causal CoPE
        left_count = running_sum(gates * is_left, from_the_right=True)
        right_count = running_sum(gates * (key >= query), from_the_right=False)
        position = torch.where(is_left, left_count, right_count).clamp(max=self.npos - 1)

        # One gather over both tables: the right table's entries follow the left one's.
        tables = per_member(torch.cat([self.left, self.right], dim=-1), q.dim())
        table_logits = torch.matmul(queries.float(), tables)
        side_start = torch.where(is_left, 0, self.npos)
        floor = position.floor()
        upper_weight = position - floor  # gradient flows through the gates only
        lower = table_logits.gather(-1, floor.long() + side_start)
        upper = table_logits.gather(-1, position.ceil().long() + side_start)
        position_logits = upper * upper_weight + lower * (1 - upper_weight)
        return ((content.float() + position_logits) / scale).to(content.dtype)


@register("contextual")
class CopeEncoding(PositionalEncoding):
    """CoPE in every layer: per-layer left/right position tables shared by all heads.

    Options: ``cope_npos`` (default ``train_max_tokens + 1``: counts beyond the training
    range saturate at the last trained row instead of reaching untrained zero rows).
    """

    name = "cope"
    description = "Contextual position encoding (gate counts, separate left/right tables)."
    kind = "relative"

    def __init__(self, *, cope_npos: int | None = None, **shape: Unpack[EncodingShape]) -> None:
        super().__init__(**shape)
        npos = self.train_max_tokens + 1 if cope_npos is None else cope_npos
        if npos < 2:
            raise CheBenchError(f"cope_npos must be >= 2; got {npos}")
        self.hooks = nn.ModuleList(
            CopeHook(self.head_dim, npos, self.members) for _ in range(self.layers)
        )
        self.resolved_options = {"cope_npos": npos}
