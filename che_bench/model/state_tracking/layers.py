"""Layers the state-tracking models share, with che-bench's member axis (``che_bench.members``):
RMSNorm, the causal depthwise ("short") convolution (``MemberCausalConv1d``, kept in
``che_bench.members`` because PaTH's encoding uses it too), and the head-size check."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.errors import CheBenchError
from che_bench.members import MemberCausalConv1d as MemberCausalConv1d
from che_bench.members import per_member


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
