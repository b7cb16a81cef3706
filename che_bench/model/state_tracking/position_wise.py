"""A block's position-wise stage (what follows its recurrence: norms, projections, the MLP,
the residuals) run at the read-out positions, with gradients that are those of the stage run
at every position, bit for bit.

The loss reads the last block's output at the read-out positions only, so at every other
position the stage's output gradients are zero: its input gradients there are zero too, and
computing them is wasted work (a third of the stage's products and most of its element-wise
backward). Its weight gradients, however, are sums over all positions, and a matrix product
over B x T rows with zero rows between the nonzero ones blocks its sums otherwise than one over
the nonzero rows alone: it rounds otherwise. ``at_read_positions`` keeps both: the stage runs
once at every position without gradients, recording each parametrised layer's input, and
once at the read-out positions with gradients, where each layer's input gradient is the
product over those rows alone and its weight gradient the very product of the stage at every
position (its output gradients laid into zeros at the other positions). Both rely on a row's
product, norm and element-wise results not depending on how many rows there are, which
torch's CPU kernels and MKL gave at DeltaNet's shapes on the AMD EPYC. On the Intel Xeon
(family 6 model 207, MKL 2024.2, one thread) ``bmm`` with the transposed weight that
``member_linear`` passes rounds a row otherwise among 1 to 5 rows (fan-in 128) or 1 to 15
(fan-in 512) than among 10 or 41 times as many (alike at 16 to 32 rows, at 64 and at 256),
so with fewer read-out rows a member (parity's one position, batches under 16) the logits
and gradients there are the every-position ones within float32 rounding only.
tests/test_deltanet.py checks the model's logits and gradients bit for bit where a probe of
those very operations finds them alike.

A stage is written against ``PositionWise``: ``ops.linear(layer, x)``, ``ops.norm(layer, x)``
and, for the map whose output is the stage's last term, ``ops.last_linear(layer, x)`` in place
of ``layer(x)``, so one definition serves every mode, as the delta-rule models' MLP
(``SwiGLU``) is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.members import (
    MemberLinear,
    batched_product,
    init_members_,
    member_linear,
    per_member,
)
from che_bench.model.state_tracking.layers import MemberRMSNorm


def read_out_positions(x: torch.Tensor, read: int) -> torch.Tensor:
    """``x [M, B, T, ...]`` at its last ``read`` positions, those the read-out reads."""
    return x[:, :, x.shape[2] - read :]


class PositionWise:
    """A stage's layers as they run at the positions given (the plain forward)."""

    def linear(self, layer: MemberLinear, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    def norm(self, layer: MemberRMSNorm, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    def last_linear(self, layer: MemberLinear, x: torch.Tensor) -> torch.Tensor:
        """The stage's last linear map, whose output is the stage's last term."""
        return self.linear(layer, x)


EVERY_POSITION = PositionWise()


class _RecordedInputs(PositionWise):
    """The plain forward, keeping what each layer's weight gradient reads: a linear map's
    input, a norm's normalised input."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []

    def linear(self, layer: MemberLinear, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        return layer(x)

    def norm(self, layer: MemberRMSNorm, x: torch.Tensor) -> torch.Tensor:
        normalised = layer.normalise(x)
        self.inputs.append(normalised)
        return layer.scale(normalised)

    def last_linear(self, layer: MemberLinear, x: torch.Tensor) -> torch.Tensor:
        # Nothing reads the stage's output at every position: its input is all that counts.
        self.inputs.append(x)
        return x.new_zeros(())


class _AtReadRows(PositionWise):
    """The forward at the read-out positions, each layer's weight gradient taken over the
    recorded inputs at every position."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        self.inputs = iter(inputs)

    def linear(self, layer: MemberLinear, x: torch.Tensor) -> torch.Tensor:
        if layer.bias is not None:
            raise ValueError("a linear map with a bias has no read-row form here")
        out: torch.Tensor = _ReadRowsLinear.apply(x, layer.weight, next(self.inputs))
        return out

    def norm(self, layer: MemberRMSNorm, x: torch.Tensor) -> torch.Tensor:
        normalised = layer.normalise(x)
        out: torch.Tensor = _ReadRowsScale.apply(normalised, layer.weight, next(self.inputs))
        return out


def _every_position(gradient: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``gradient`` at the last positions of axis 2, zeros before: the output gradient of the
    stage at every position."""
    padded = gradient.new_zeros(shape)
    read_out_positions(padded, gradient.shape[2]).copy_(gradient)
    return padded


class _ReadRowsLinear(torch.autograd.Function):
    """``MemberLinear`` (no bias) at the read rows; its weight gradient is autograd's
    ``bmm`` backward over every position's input ``full``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, full: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(weight, full)
        return member_linear(x, weight)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, full = ctx.saved_tensors
        members, fan_out = weight.shape[:2]
        grad_x = batched_product(gradient.reshape(members, -1, fan_out), weight)
        padded = _every_position(gradient, (*full.shape[:-1], fan_out))
        flat = full.reshape(members, -1, full.shape[-1])
        grad_weight = batched_product(flat.transpose(1, 2), padded.view(members, -1, fan_out))
        return grad_x.view(*gradient.shape[:-1], -1), grad_weight.transpose(1, 2), None


class _ReadRowsScale(torch.autograd.Function):
    """A norm's learned scale at the read rows; its gradient is autograd's broadcast product
    backward over every position's normalised input ``full``."""

    @staticmethod
    def forward(
        ctx: Any, normalised: torch.Tensor, weight: torch.Tensor, full: torch.Tensor
    ) -> torch.Tensor:
        scale = per_member(weight, normalised.dim())
        ctx.save_for_backward(scale, full)
        ctx.weight_shape = weight.shape
        return normalised * scale

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scale, full = ctx.saved_tensors
        padded = _every_position(gradient, tuple(full.shape))
        grad_weight = (padded * full).sum_to_size(scale.shape)
        return gradient * scale, grad_weight.view(ctx.weight_shape), None


Stage = Callable[..., torch.Tensor]


def at_read_positions(stage: Stage, inputs: tuple[torch.Tensor, ...], read: int) -> torch.Tensor:
    """``stage(*inputs, ops)`` at the last ``read`` positions of its ``[M, B, T, ...]``
    inputs, with the gradients of the stage at every position (module docstring). Without
    gradients, the stage at those positions alone."""
    at_read = tuple(read_out_positions(x, read) for x in inputs)
    if not torch.is_grad_enabled():
        return stage(*at_read, EVERY_POSITION)
    recorded = _RecordedInputs()
    with torch.no_grad():
        stage(*inputs, recorded)
    return stage(*at_read, _AtReadRows(recorded.inputs))


#: fla's ``initializer_range`` for the embedding, MLP and read-out.
INIT_STD = 0.02


def mlp_width(width: int) -> int:
    """fla's SwiGLU width: 2/3 of 4 * width, rounded up to a multiple of 256 (128 -> 512)."""
    return 256 * -(-int(width * 4 * 2 / 3) // 256)


class SwiGLU(nn.Module):
    """fla's gated MLP: ``W_down(SiLU(gate) * up)`` with ``[gate, up] = W_gu x``, no biases."""

    def __init__(self, members: int, width: int, layers: int) -> None:
        super().__init__()
        hidden = mlp_width(width)
        self.up = MemberLinear(members, width, 2 * hidden, bias=False, init="torch")
        self.down = MemberLinear(members, hidden, width, bias=False, init="torch")
        init_members_(self.up.weight, lambda w: nn.init.normal_(w, std=INIT_STD))
        # GPT-2's residual scaling, as the GR fork's ``_init_weights`` applies to down_proj.
        down_std = INIT_STD / math.sqrt(2 * layers)
        init_members_(self.down.weight, lambda w: nn.init.normal_(w, std=down_std))

    def forward(self, x: torch.Tensor, ops: PositionWise = EVERY_POSITION) -> torch.Tensor:
        gate, up = ops.linear(self.up, x).chunk(2, dim=-1)
        return ops.last_linear(self.down, F.silu(gate) * up)
