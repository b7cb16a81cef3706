"""PaTH's data-dependent parameters: the Householder factors ``w_t, beta_t`` (and PaTH-FoX's
forget gate) of one direction, made from the attention layer's input ``x [M, B, T, D]``.

As fla's ``PaTHAttention`` (``fla/layers/path_attn.py``, spec ``data_dependent_encodings.md`` §2):

* ``w``: a low-rank linear map ``D -> 32 -> H d`` (no biases), a causal depthwise convolution
  over time (kernel 3, no bias), SiLU, then per head an L2 normalisation in fp32,
  ``w / sqrt(|w|^2 + 1e-6)``. The paper names the low-rank map, the convolution and the
  normalisation but no activation; fla applies SiLU (its ``ShortConvolution``'s default), and
  so does che-bench: the reference code is what trained the published models.
* ``beta = 2 sigmoid(u . x + b)`` in (0, 2) (``negative_eigenvalues``, fla's and the paper's:
  ``H_t`` then has eigenvalue ``1 - beta`` in (-1, 1) along ``w_t``), or ``sigmoid(.)`` in (0, 1)
  (the DeltaNet-style ablation, in neither PaTH source).
* PaTH-FoX's gate: ``log f = logsigmoid(u_f . x + b_f)`` per head, in fp32.
* Initialisation as fla's ``_init_weights``: every weight (linear and convolution) N(0, 0.02^2),
  every bias 0, so ``beta`` starts near 1 and ``f`` near 0.5. At che-bench's width (D = 64,
  8 heads of 8) these small weights leave ``|w|^2`` before the normalisation near the 1e-6
  epsilon, so ``w`` starts shorter than 1 (norm 0.15-0.92, mean 0.61, on unit-variance inputs)
  and ``H_t`` nearer the identity than a projection; at fla's widths (D >= 1024) it starts
  unit.

The keys right of the query in the bidirectional form take a second module built with
``anticausal=True``: its convolution reads tokens ``t .. t+2`` instead of ``t-2 .. t``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from che_bench.encodings.path_transform import Householders
from che_bench.members import MemberCausalConv1d, MemberLinear, init_members_

#: Rank of fla's low-rank ``w`` map.
W_RANK = 32
#: Width of the short convolution over time.
W_KERNEL = 3
#: Standard deviation of every initial weight (fla's ``initializer_range``).
INIT_STD = 0.02
#: fla's ``l2_norm`` epsilon.
NORM_EPS = 1e-6


class PathFactors(NamedTuple):
    """One direction's factors (``householders``: ``w [M, B, H, T, d]``, ``beta [M, B, H, T]``)
    and PaTH-FoX's ``log_forget [M, B, H, T]`` (None without the gate)."""

    householders: Householders
    log_forget: Tensor | None


class PathProjections(nn.Module):
    """The parameters of one direction of PaTH in one layer, ``M`` members side by side.

    ``forward(x)`` with ``x [M, B, T, D]`` gives ``PathFactors``; ``heads`` must divide ``dim``.
    Parameters (per member): ``w_down [32, D]``, ``w_up [D, 32]``, ``w_conv [D, 3]``,
    ``beta_proj [H, D]`` + bias ``[H]``, and with ``forget_gate`` ``forget_proj [H, D]`` + bias.
    """

    def __init__(
        self,
        members: int,
        dim: int,
        heads: int,
        *,
        negative_eigenvalues: bool = True,
        forget_gate: bool = False,
        anticausal: bool = False,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.beta_range = 2.0 if negative_eigenvalues else 1.0
        self.anticausal = anticausal
        self.w_down = MemberLinear(members, dim, W_RANK, bias=False)
        self.w_up = MemberLinear(members, W_RANK, dim, bias=False)
        self.w_conv = MemberCausalConv1d(members, dim, W_KERNEL, bias=False, channels_last=True)
        self.beta_proj = MemberLinear(members, dim, heads)
        self.forget_proj = MemberLinear(members, dim, heads) if forget_gate else None
        for layer in (self.w_down, self.w_up, self.w_conv, self.beta_proj, self.forget_proj):
            if layer is not None:
                init_members_(layer.weight, lambda w: nn.init.normal_(w, std=INIT_STD))
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> PathFactors:
        w = self.convolve(self.w_up(self.w_down(x)))
        w = F.silu(w).unflatten(-1, (self.heads, self.head_dim)).transpose(2, 3).float()
        w = w * torch.rsqrt(w.square().sum(-1, keepdim=True) + NORM_EPS)
        beta = torch.sigmoid(self.beta_proj(x)).transpose(2, 3) * self.beta_range
        log_forget = None
        if self.forget_proj is not None:
            log_forget = F.logsigmoid(self.forget_proj(x).float()).transpose(2, 3)
        return PathFactors(Householders(w, beta), log_forget)

    def convolve(self, x: Tensor) -> Tensor:
        """The short convolution over time of ``x [M, B, T, D]``: causal, or reading the
        tokens ahead when ``anticausal`` (the causal one over the reversed sequence)."""
        if self.anticausal:
            return self.w_conv(x.flip(2)).flip(2)
        return self.w_conv(x)
