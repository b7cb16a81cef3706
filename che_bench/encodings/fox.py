"""FoX, the Forgetting Transformer (Lin et al., ICLR 2025): a data-dependent forget gate per
head whose summed logarithm is added to the scaled scores; no other position signal.

Causal (the paper's form, and the official code's and fla's): per head h, the gate
``f_t = sigmoid(w_h . x_t + b_h)`` reads the attention sublayer's input ``x_t`` (one
``Linear(D, H)``, ``fgate_proj``), and

    D_ij = sum_{s=j+1..i} log f_s = c_i - c_j,   c_t = sum_{s<=t} log f_s   (j <= i)

is added, unscaled, after the scores' ``1/sqrt(d_h)`` scaling (the official code and fla's
naive reference; fla's PaTH-FoX scales it, which is not FoX). Initialisation as both: weight
N(0, 0.02^2), bias 0, so f is about 0.5 (a decay of about -0.69 per token) at the start.

Bidirectional (the CHE encoder's default; no source defines it): a second gate set
``f'_t = sigmoid(w'_h . x_t + b'_h)``, initialised alike, for the keys to the right,
mirroring the causal sum: ``D_ij = sum_{s=i..j-1} log f'_s`` for ``j > i`` (query end
included, key end excluded). One shared gate would give ``-|c_i - c_j|``, which cannot tell
left from right. A causal model (``build_encoding``'s ``causal``) has no right gates.

The bias has a batch axis (``sequence_bias``): DAPE's filter takes ``D`` as its bias
channels (2H channels, as for ALiBi or Kerple), per sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.encodings.base import AttentionHook, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import cache_blocks, running_sum
from che_bench.members import MemberLinear, init_members_

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: The gates' weight initialisation (FoX and fla: N(0, 0.02^2); the bias starts at 0).
GATE_STD = 0.02


def forget_gate(members: int, dim: int, heads: int) -> MemberLinear:
    """One ``Linear(D, H)`` per member, initialised as FoX's ``fgate_proj``."""
    gate = MemberLinear(members, dim, heads)  # bias zero
    init_members_(gate.weight, lambda weight: nn.init.normal_(weight, std=GATE_STD))
    return gate


class ForgetBias(torch.autograd.Function):
    """``D`` of the query rows ``start..stop`` (module docstring), ``[..., R, T]``, from the
    running sums ``left`` (``c``) and ``right`` (``c'``) ``[..., T]``, cache block by cache
    block: one map in each direction, where the plain form (two differences and a selection,
    autograd's backward through each) takes about five times the passes over it.

    ``D = (c_i - c_j) + [j > i] (e_j - e_i)`` with ``e = c + c'``; its gradient is row and
    column sums of the incoming one (and of its part above the diagonal). Right of the query
    the difference of the two sums rounds like one of sums twice as large (about 1e-4 at
    1,500 tokens in float32, where D is about -1000)."""

    @staticmethod
    def forward(ctx, left: torch.Tensor, right: torch.Tensor, start: int, stop: int):
        ctx.start, ctx.stop = start, stop
        length = left.shape[-1]
        both = (left + right).reshape(-1, length)
        flat_left = left.reshape(-1, length)
        out = left.new_empty(both.shape[0], stop - start, length)
        for block in cache_blocks(out.shape[0], out[0].numel()):
            part, sums, lefts = out[block], both[block], flat_left[block]
            torch.sub(sums[:, None, :], sums[:, start:stop, None], out=part)
            part.triu_(start + 1)  # the keys after each query
            part += lefts[:, start:stop, None]
            part -= lefts[:, None, :]
        return out.view(*left.shape[:-1], stop - start, length)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, stop = ctx.start, ctx.stop
        length = grad.shape[-1]
        flat = grad.reshape(-1, stop - start, length)
        sequences = flat.shape[0]
        by_row, by_key = (
            flat.new_empty(2, sequences, stop - start),
            flat.new_empty(2, sequences, length),
        )
        blocks = cache_blocks(sequences, flat[0].numel())
        after = flat.new_empty(blocks[0].stop, stop - start, length)
        for block in blocks:
            part, above = flat[block], after[: block.stop - block.start]
            torch.sum(part, -1, out=by_row[0, block])
            torch.sum(part, -2, out=by_key[0, block])
            torch.triu(part, start + 1, out=above)
            torch.sum(above, -1, out=by_row[1, block])
            torch.sum(above, -2, out=by_key[1, block])
        grad_both = by_key[1]
        grad_both[:, start:stop] -= by_row[1]
        grad_left = grad_both - by_key[0]
        grad_left[:, start:stop] += by_row[0]
        shape = (*grad.shape[:-2], length)
        return grad_left.view(shape), grad_both.view(shape), None, None


class ForgetGateHook(AttentionHook):
    """Adds ``D_ij`` (module docstring) to the scores of every head: ``prepare`` computes the
    gates' log values from ``x`` and their running sums once; ``bias`` forms ``[M, B, H, R, T]``
    for the rows asked for."""

    reads_input = True
    sequence_bias = True
    extra_maps = 1  # the bias (``ForgetBias``)

    def __init__(self, dim: int, heads: int, members: int, causal: bool = False) -> None:
        super().__init__()
        self.left_gate = forget_gate(members, dim, heads)
        # A causal model never sees the keys right of the query: no gates for them.
        self.right_gate = None if causal else forget_gate(members, dim, heads)

    def prepare(
        self, q: torch.Tensor, k: torch.Tensor, draw: Any = None, x: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """ctx: the gates' log values ``log f``, ``log f'`` ``[M, B, H, T]`` and their sums,
        ``left`` (``c_t``, up to t included) and ``right`` (``c'_t``, before t)."""
        assert x is not None  # reads_input: the attention passes it
        log_left = F.logsigmoid(self.left_gate(x)).transpose(-1, -2)
        if self.right_gate is None:
            log_right = torch.zeros_like(log_left)
        else:
            log_right = F.logsigmoid(self.right_gate(x)).transpose(-1, -2)
        right_inclusive = running_sum(log_right, from_the_right=False)
        ctx = {
            "log_left": log_left,
            "log_right": log_right,
            "left": running_sum(log_left, from_the_right=False),
            "right": right_inclusive - log_right,
        }
        return q, k, ctx

    def bias(self, rows: slice, length: int, ctx: dict[str, torch.Tensor]) -> torch.Tensor:
        return ForgetBias.apply(ctx["left"], ctx["right"], rows.start, rows.stop)

    def reference_bias(self, query: int, key: int, ctx: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[M, B, H]``: the gates' logarithms summed over (key, query] or [query, key)."""
        if key <= query:
            return ctx["log_left"][..., key + 1 : query + 1].sum(-1)
        return ctx["log_right"][..., query:key].sum(-1)

    def state_floats(self, length: int) -> int:
        return 4 * self.left_gate.fan_out * length  # four [H, T] maps per sequence


@register("forgetting_transformer")
class ForgettingEncoding(PositionalEncoding):
    """FoX's forget gates in every layer (module docstring), bidirectional in the encoder.

    No options; ``2 (D + 1) H`` parameters per layer (the left and right gates), ``(D + 1) H``
    in a causal model (the left gates only).
    """

    name = "fox"
    description = "FoX forget gates: bias sum of log sigmoid(w.x + b) between key and query."
    kind = "relative"
    carries_bias = True

    def __init__(self, *, causal: bool = False, **shape: Unpack[EncodingShape]) -> None:
        super().__init__(**shape)
        self.hooks = nn.ModuleList(
            ForgetGateHook(self.dim, self.heads, self.members, causal) for _ in range(self.layers)
        )
