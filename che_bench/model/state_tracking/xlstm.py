"""What the mLSTM and sLSTM models share (xLSTM, Beck et al., NeurIPS 2024; spec
state_tracking.md 1.e, from NX-AI/xlstm ``xlstm/components`` and ``xlstm/blocks``): the
LayerNorm with scale ``1 + w`` and no bias, the per-head norm of a cell's output, the
block-diagonal ("headwise") linear map, the gated feed-forward of the sLSTM block, the "small"
and "wang" initialisations, and the stack's embedding, read-out and final norm.

Every parameter has a leading member axis ``[M, ...]`` (``che_bench.members``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.errors import CheBenchError
from che_bench.members import MemberLinear, init_members_, per_member
from che_bench.model.state_tracking.stack import StateTrackingModel
from che_bench.tasks.base import Task

#: Up-projection widths are rounded up to a multiple of this (xlstm ``UpProjConfigMixin``).
UP_MULTIPLE = 64
#: The LayerNorms' epsilon (xlstm ``components/ln.py``).
NORM_EPS = 1e-5


def round_up(value: float, multiple: int = UP_MULTIPLE) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (E=128, factor 2 -> 256)."""
    return math.ceil(value / multiple) * multiple


def small_init_(weight: torch.Tensor, dim: int) -> None:
    """N(0, 2 / (5 dim)) ("small init", Nguyen & Salazar 2019), as xlstm initialises the
    embedding, read-out and up-projections with ``dim`` the model width."""
    nn.init.normal_(weight, std=math.sqrt(2 / (5 * dim)))


def wang_init_(weight: torch.Tensor, dim: int, blocks: int) -> None:
    """N(0, (2 / (blocks sqrt(dim)))^2) ("wang init", GPT-NeoX), xlstm's init of every
    down-projection; ``blocks`` is the number of blocks in the stack."""
    nn.init.normal_(weight, std=2 / (blocks * math.sqrt(dim)))


class ScaledLayerNorm(nn.Module):
    """LayerNorm over the last axis with scale ``1 + w`` (w initialised 0) and no offset,
    eps 1e-5 (xlstm ``LayerNorm(weight=True, bias=False, residual_weight=True)``)."""

    def __init__(self, members: int, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.weight = nn.Parameter(torch.zeros(members, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:  # one member: the fused affine kernel
            return F.layer_norm(x, (self.dim,), 1 + self.weight[0], None, NORM_EPS)
        return F.layer_norm(x, (self.dim,), eps=NORM_EPS) * per_member(1 + self.weight, x.dim())


def head_norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A cell's output ``h [M, B, T, H, d]`` normalised per head (LayerNorm over each head's
    d features: xlstm's ``MultiHeadLayerNorm``, a GroupNorm with H groups), scaled by
    ``1 + weight`` (``weight [M, H*d]``, no offset) -> ``[M, B, T, H*d]``."""
    members, batch, steps, heads, size = h.shape
    normed = F.layer_norm(h, (size,), eps=NORM_EPS).reshape(members, batch, steps, heads * size)
    return normed * per_member(1 + weight, 4)


class HeadwiseLinear(nn.Module):
    """A block-diagonal linear map without bias (xlstm ``LinearHeadwiseExpand``):
    ``x [M, ..., blocks*size]``, block j of the output is ``W_j`` times block j of the input;
    weight ``[M, blocks, size_out, size]``, small-initialised with the model width ``dim``."""

    def __init__(self, members: int, blocks: int, size: int, dim: int) -> None:
        super().__init__()
        self.blocks, self.size = blocks, size
        self.weight = nn.Parameter(torch.empty(members, blocks, size, size))
        init_members_(self.weight, lambda w: small_init_(w, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1, self.blocks, self.size)
        out = torch.einsum("mnbi,mboi->mnbo", flat, self.weight)
        return out.reshape(x.shape)


class GatedFeedForward(nn.Module):
    """The sLSTM block's feed-forward (xlstm ``GatedFeedForward``, spec 1.e):
    ``[g, u] = W_up x`` (E -> 2 Ef, Ef = roundup64(1.3 E)), ``W_down (GELU(g) * u)``; no
    biases; W_up small-initialised, W_down wang-initialised."""

    def __init__(self, members: int, width: int, blocks: int) -> None:
        super().__init__()
        self.inner = round_up(1.3 * width)
        self.up = MemberLinear(members, width, 2 * self.inner, bias=False)
        self.down = MemberLinear(members, self.inner, width, bias=False)
        init_members_(self.up.weight, lambda w: small_init_(w, width))
        init_members_(self.down.weight, lambda w: wang_init_(w, width, blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.up(x).split(self.inner, dim=-1)
        return self.down(F.gelu(gate) * up)


class XLSTMModel(StateTrackingModel):
    """The xLSTM stack (spec 1.e): small-initialised embedding and read-out, a
    ``ScaledLayerNorm`` after the blocks (``add_post_blocks_norm``); the blocks are the
    subclass's."""

    #: Options this model refuses with a reason rather than "takes no option" (read by
    #: ``architecture_options``). Grazzi et al. (ICLR 2025, App. E.4) extend neither mLSTM
    #: (gates multiplied in log space, a normaliser that could approach 0) nor sLSTM
    #: (nonlinear recurrence) to negative eigenvalues (spec 1.f).
    refused_options: ClassVar[dict[str, str]] = {
        "negative_eigenvalues": "Grazzi et al. (ICLR 2025, App. E.4) do not extend mLSTM or "
        "sLSTM to negative eigenvalues (only mamba, deltanet, gated_deltanet, deltaproduct)"
    }

    def __init__(self, task: Task, members: int = 1, **options: Any) -> None:
        for key in sorted(set(options) & set(self.refused_options)):
            raise CheBenchError(f"{self.name} takes no option {key}: {self.refused_options[key]}")
        super().__init__(task, members, **options)

    def init_embedding(self, weight: torch.Tensor) -> None:
        small_init_(weight, self.width)

    def init_head(self, weight: torch.Tensor) -> None:
        small_init_(weight, self.width)

    def make_final_norm(self) -> nn.Module:
        return ScaledLayerNorm(self.members, self.width)
