"""Stick-breaking attention (Tan et al., ICLR 2025): the softmax replaced by a stick broken
from the query outwards, nearest key first; no other position signal.

Causal (the paper's form; the official ``sb_ref.py`` and fla's naive reference with their
default ``attend_current=False``): with the logits ``z_ij`` (``q_i . k_j / sqrt(d_h)``, plus
what DAPE adds), ``beta_ij = sigmoid(z_ij)`` and, for keys ``j < i``,

    A_ij = beta_ij * prod_{j<k<i} (1 - beta_ik)
    log A_ij = log sigmoid(z_ij) + sum_{j<k<i} log sigmoid(-z_ik)

computed in log space with a running sum from the right along the keys (O(T^2), not the
reference's O(T^3) product with a triangular matrix). The diagonal is not a key. The stick
left over, ``rem_i = prod_{k<i} (1 - beta_ik)``, goes to the query's own value
(``stick_remainder="current"``, the default: ``o_i = sum_j A_ij v_j + rem_i v_i``, the
remainder correction of the official tests and, per its reviewers, the paper's Eq. 2), so
each row of weights sums to 1 with ``A_ii = rem_i``; ``stick_remainder="none"`` drops it
(rows sum to at most 1; the ablation its reviewers found better).

Bidirectional (the CHE encoder's default; no source defines it beyond NDR's distance order):
two sticks, one per half of the heads. The first ``ceil(H/2)`` heads break the causal stick
over the keys to their left; the others its mirror image over the keys to their right,
``A_ij = beta_ij prod_{i<k<j} (1 - beta_ik)`` for ``j > i``, each with its remainder on the
diagonal. So every head has a direction (a content score cannot tell left from right, and
mixing both sticks in one head would not either) and the causal form is exactly the paper's.

DAPE and DAPE V2 process the logits ``z`` before the stick-breaking (there is no additive
bias: the filter sees the H score channels), with the future keys hidden in a causal model.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.encodings.base import AttentionHook, PositionalEncoding, register
from che_bench.encodings.common import check_choice, running_sum

REMAINDERS = ("current", "none")


def left_stick(logits: torch.Tensor, query: torch.Tensor, remainder: bool) -> torch.Tensor:
    """The causal stick-breaking weights ``[..., R, T]`` of logits ``[..., R, T]`` whose rows
    are the queries ``query`` (``[R, 1]`` positions): keys ``j < i``, nearest first; with
    ``remainder`` the stick left over on the diagonal."""
    key = torch.arange(logits.shape[-1], device=logits.device)
    hidden = key >= query  # the query itself and the keys after it
    log_keep = F.logsigmoid(-logits).masked_fill(hidden, 0.0)  # log(1 - beta)
    # sum over the keys k with j < k < i: from the right, less key j's own term
    broken = running_sum(log_keep, from_the_right=True) - log_keep
    weights = (F.logsigmoid(logits) + broken).masked_fill(hidden, -torch.inf).exp()
    if not remainder:
        return weights
    left_over = log_keep.sum(-1, keepdim=True).exp()
    return torch.where(key == query, left_over, weights)


class StickBreakingHook(AttentionHook):
    """Replaces the softmax by stick-breaking (module docstring); plain scaled scores."""

    extra_maps = 6  # log(1 - beta), its running sum and flips, the log weights, the weights

    def __init__(self, remainder: str) -> None:
        super().__init__()
        self.remainder = remainder == "current"

    def normalise(
        self, logits: torch.Tensor, rows: slice, future: torch.Tensor | None, ctx: Any
    ) -> torch.Tensor:
        length, heads = logits.shape[-1], logits.shape[2]
        query = torch.arange(rows.start, rows.stop, device=logits.device)[:, None]
        leftward = heads if future is not None else (heads + 1) // 2
        left = left_stick(logits[:, :, :leftward], query, self.remainder)
        if leftward == heads:
            return left
        # The right stick is the left one of the sequence read backwards.
        mirrored = left_stick(logits[:, :, leftward:].flip(-1), length - 1 - query, self.remainder)
        return torch.cat([left, mirrored.flip(-1)], 2)


@register("stickbreaking", "sba")
class StickBreakingEncoding(PositionalEncoding):
    """Stick-breaking attention in every layer (module docstring); no parameters.

    Options: ``stick_remainder`` ("current" (default): the stick left over weighs the
    query's own value; "none": dropped).
    """

    name = "stick_breaking"
    description = "Stick-breaking attention instead of softmax (nearest key breaks first)."
    kind = "relative"
    option_choices: ClassVar[dict[str, tuple[Any, ...]]] = {"stick_remainder": REMAINDERS}

    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        layers: int,
        train_max_tokens: int,
        members: int = 1,
        stick_remainder: str = "current",
    ) -> None:
        super().__init__(
            dim=dim, heads=heads, layers=layers, train_max_tokens=train_max_tokens, members=members
        )
        check_choice("stick_remainder", stick_remainder, REMAINDERS)
        self.hooks = nn.ModuleList(StickBreakingHook(stick_remainder) for _ in range(layers))
        self.resolved_options = {"stick_remainder": stick_remainder}
