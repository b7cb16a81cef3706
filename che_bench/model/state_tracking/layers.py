"""Layers the state-tracking models share, with che-bench's member axis (``che_bench.members``):
RMSNorm, the causal depthwise ("short") convolution, and the head-size check."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.errors import CheBenchError
from che_bench.members import init_members_, per_member


def head_size(width: int, heads: int) -> int:
    """``width // heads``; a width the heads do not divide is a one-line CheBenchError."""
    if width % heads:
        raise CheBenchError(f"width {width} is not a multiple of heads {heads}")
    return width // heads


class MemberRMSNorm(nn.Module):
    """RMSNorm over the last axis, ``x / sqrt(mean(x^2) + eps) * weight``, a learned scale per
    member initialised to 1 (Zhang & Sennrich 2019; fla's and mamba's RMSNorm)."""

    def __init__(self, members: int, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(members, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.normalise(x))

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """``x / sqrt(mean(x^2) + eps)``, before the learned scale (torch's fused ``rms_norm``
        where there is one: torch 2.4 on)."""
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (self.dim,), eps=self.eps)
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)

    def scale(self, normalised: torch.Tensor) -> torch.Tensor:
        """``normalised * weight``, each member's scale on its own activations."""
        return normalised * per_member(self.weight, normalised.dim())


class MemberCausalConv1d(nn.Module):
    """A causal depthwise convolution over time, ``y_t[c] = b[c] + sum_j w[c, j] x_{t-K+1+j}[c]``
    (zeros before the first token), for ``x [M, B, T, C]``; one grouped ``conv1d`` over the
    members' channels. Initialised as ``nn.Conv1d`` (uniform within ``1/sqrt(K)``), unless the
    model re-initialises it.

    ``channels_last``: the convolution runs in the activations' own ``[B, T, C]`` order (torch's
    channels-last layout) instead of ``[B, C, T]``. On a CPU, oneDNN's depthwise kernel then
    needs no layout conversions and its weight gradient no im2col products: the layer's
    forward and backward measured 3-4x faster (docs/benchmarks.md). Outputs and input
    gradients came out bit for bit the same there, the weight gradient rounded otherwise
    (its sums taken in another order), so the models whose committed results were trained
    channels-first keep that default."""

    def __init__(
        self,
        members: int,
        channels: int,
        kernel: int,
        bias: bool = True,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.members, self.channels, self.kernel = members, channels, kernel
        self.channels_last = channels_last
        self.weight = nn.Parameter(torch.empty(members, channels, kernel))
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(members, channels)) if bias else None
        )
        bound = 1 / kernel**0.5  # nn.Conv1d's default: fan_in = kernel for a depthwise map
        init_members_(self.weight, lambda w: nn.init.uniform_(w, -bound, bound))
        if self.bias is not None:
            init_members_(self.bias, lambda b: nn.init.uniform_(b, -bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            return self._channels_last(x)
        members, batch, steps, channels = x.shape
        grouped = x.permute(1, 0, 3, 2).reshape(batch, members * channels, steps)
        grouped = F.pad(grouped, (self.kernel - 1, 0))
        bias = None if self.bias is None else self.bias.reshape(-1)
        weight = self.weight.reshape(members * channels, 1, self.kernel)
        out = F.conv1d(grouped, weight, bias, groups=members * channels)
        return out.view(batch, members, channels, steps).permute(1, 0, 3, 2)

    def _channels_last(self, x: torch.Tensor) -> torch.Tensor:
        """The same map as a ``conv2d`` over ``[B, M * C, 1, T]`` stored as ``[B, 1, T, M * C]``."""
        members, batch, steps, channels = x.shape
        grouped = x.permute(1, 2, 0, 3).reshape(batch, steps, members * channels)
        grouped = F.pad(grouped, (0, 0, self.kernel - 1, 0)).unsqueeze(1).permute(0, 3, 1, 2)
        bias = None if self.bias is None else self.bias.reshape(-1)
        weight = self.weight.reshape(members * channels, 1, 1, self.kernel)
        out = F.conv2d(grouped, weight, bias, groups=members * channels)
        return out.permute(0, 2, 3, 1).reshape(batch, steps, members, channels).permute(2, 0, 1, 3)
