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

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.encodings.base import AttentionHook, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import cache_blocks, check_choice, running_sum

if TYPE_CHECKING:
    from typing_extensions import Unpack

REMAINDERS = ("current", "none")


def _right_stick(logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The stick broken over the keys after each query, nearest first, written into ``out``:
    ``log A_ij = z_ij - sum_{i<k<=j} softplus(z_ik)`` (``log sigmoid(z) = z - softplus(z)``,
    ``log(1 - sigmoid(z)) = -softplus(z)``); returns the log of what is left, ``[..., R, 1]``.
    ``visible`` (``[R, T]``, 1.0 or 0.0) marks the keys after the query (a product with it is
    three times as fast as filling by a mask). The running sum starts at the query: the
    nearest keys' terms are exact."""
    broken = running_sum(F.softplus(logits).mul_(visible), from_the_right=False)
    left_over = -broken[..., -1:]
    # exp(0) at the hidden keys, then 0: never exp(z) there, which may overflow. A weight
    # below e times the smallest normal float (3.2e-38 in float32) is taken as that: exp's
    # subnormal and underflowing results take the CPU 30 to 70 times as long (far keys).
    floor = math.log(torch.finfo(logits.dtype).tiny) + 1.0
    torch.sub(logits, broken, out=out).mul_(visible).clamp_min_(floor).exp_().mul_(visible)
    return left_over


class StickWeights(torch.autograd.Function):
    """Stick-breaking weights ``[M, B, H, R, T]`` of logits ``z`` for the query rows from
    ``start``: the first ``leftward`` heads break a stick over the keys to their left (the
    keys read backwards: the right stick of the flipped row), the others over the keys to
    their right; with ``remainder`` what is left sits on the diagonal. Forward and backward
    go cache block by cache block of sequences (``cache_blocks``).

    Backward, with ``P = grad * A`` (``P_ii`` the remainder's part, ``Pv`` the rest) and the
    running sum ``C`` of ``Pv`` along the keys: ``dz = Pv - sigmoid(z) (C + P_ii)`` for a left
    head, ``dz = Pv - sigmoid(z) (sum_j Pv - C + Pv + P_ii)`` for a right one (the keys
    farther along its stick), zero at the hidden keys: no flip, one pass per map."""

    @staticmethod
    def forward(ctx, logits, start: int, leftward: int, remainder: bool):
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
        maps, flat = logits.reshape(-1, *logits.shape[-3:]), out.view(-1, *logits.shape[-3:])
        sides = _sides(start, logits)
        for block in cache_blocks(maps.shape[0], maps[0].numel()):
            _stick_forward(maps[block], flat[block], start, leftward, sides, remainder)
        ctx.start, ctx.leftward = start, leftward
        ctx.save_for_backward(logits, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, out = ctx.saved_tensors
        shape = logits.shape[-3:]
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        flat = [tensor.reshape(-1, *shape) for tensor in (grad, logits, out, grad_logits)]
        sides = _sides(ctx.start, logits)
        for block in cache_blocks(flat[0].shape[0], flat[0][0].numel()):
            _stick_backward(*(tensor[block] for tensor in flat), ctx.start, ctx.leftward, sides)
        return grad_logits, None, None, None


def _stick_forward(
    logits: torch.Tensor,
    out: torch.Tensor,
    start: int,
    leftward: int,
    sides: tuple[torch.Tensor, torch.Tensor],
    remainder: bool,
) -> None:
    """``StickWeights`` of a block of maps ``[n, H, R, T]``, written into ``out``; ``sides``:
    ``_sides``."""
    left_keys, right_keys = sides
    left_over = logits.new_empty(logits.shape[:-1])
    if leftward:
        flipped = logits[:, :leftward].flip(-1)
        left = _right_stick(flipped, left_keys.flip(-1), flipped)
        out[:, :leftward] = flipped.flip(-1)
        left_over[:, :leftward] = left[..., 0]
    if leftward < logits.shape[1]:
        left = _right_stick(logits[:, leftward:], right_keys, out[:, leftward:])
        left_over[:, leftward:] = left[..., 0]
    diagonal = out.diagonal(start, -2, -1)
    if remainder:
        diagonal.copy_(left_over.exp_())
    else:
        diagonal.zero_()


def _stick_backward(
    grad: torch.Tensor,
    logits: torch.Tensor,
    out: torch.Tensor,
    grad_logits: torch.Tensor,
    start: int,
    leftward: int,
    sides: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """The logits' gradient of a block of maps ``[n, H, R, T]`` (``StickWeights``), written
    into ``grad_logits``."""
    part = grad * out
    on_diagonal = part.diagonal(start, -2, -1)
    remainder = on_diagonal.clone()[..., None]
    on_diagonal.zero_()
    # left heads: the keys at and before j; right heads: at and after j
    farther = running_sum(part, from_the_right=False).add_(remainder)
    right, right_part = farther[:, leftward:], part[:, leftward:]
    row = right_part.sum(-1, keepdim=True).add_(remainder[:, leftward:], alpha=2.0)
    right.neg_().add_(right_part).add_(row)
    torch.addcmul(part, torch.sigmoid(logits), farther, value=-1.0, out=grad_logits)
    grad_logits[:, :leftward].mul_(sides[0])
    grad_logits[:, leftward:].mul_(sides[1])


def _sides(start: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, T]`` of the query rows from ``start``: 1.0 at the keys before each query (left)
    and after it (right), else 0.0, in the logits' dtype."""
    query = torch.arange(start, start + logits.shape[-2], device=logits.device)[:, None]
    key = torch.arange(logits.shape[-1], device=logits.device)
    return (key < query).to(logits.dtype), (key > query).to(logits.dtype)


class StickBreakingHook(AttentionHook):
    """Replaces the softmax by stick-breaking (module docstring); plain scaled scores."""

    extra_maps = 3  # log(1 - beta) and its running sum, a flipped copy, the weights

    def __init__(self, remainder: str) -> None:
        super().__init__()
        self.remainder = remainder == "current"

    def normalise(
        self, logits: torch.Tensor, rows: slice, future: torch.Tensor | None, ctx: Any
    ) -> torch.Tensor:
        heads = logits.shape[2]
        leftward = heads if future is not None else (heads + 1) // 2
        return StickWeights.apply(logits, rows.start, leftward, self.remainder)


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

    def __init__(self, *, stick_remainder: str = "current", **shape: Unpack[EncodingShape]) -> None:
        super().__init__(**shape)
        check_choice("stick_remainder", stick_remainder, REMAINDERS)
        self.hooks = nn.ModuleList(StickBreakingHook(stick_remainder) for _ in range(self.layers))
        self.resolved_options = {"stick_remainder": stick_remainder}
