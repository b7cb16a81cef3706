"""Layers with a leading member axis: one module holds the parameters of several models.

Every parameter of a che-bench model has shape ``[M, ...]``: ``M`` independent models (the
members of a pack: runs that differ only in seeds and learning rate) computed side by side, as
one wider computation. Activations carry the same leading axis, ``[M, B, T, D]``. A single run
is a pack of one, so there is one code path.

Initialisers run member by member, so member ``m`` of a module built for ``M`` members is drawn
exactly as a one-member module would be; packs are in any case assembled by stacking models
built one at a time, each from its own seed (``che_bench.model.packs.stack_members``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

INITS = ("haiku", "torch")


def truncated_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Haiku's truncated normal: N(0, std^2) cut at +-2 std (no variance correction)."""
    return nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)


def init_members_(parameter: torch.Tensor, init: Callable[[torch.Tensor], object]) -> None:
    """Apply ``init`` to every member's slice of ``parameter`` in turn."""
    with torch.no_grad():
        for member in parameter:
            init(member)


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def load_member_states(pack: ModuleT, models: Sequence[nn.Module]) -> ModuleT:
    """``pack`` (built alike for all their members) with the weights of ``models`` side by
    side, in order."""
    states = [model.state_dict() for model in models]
    pack.load_state_dict({name: torch.cat([state[name] for state in states]) for name in states[0]})
    return pack


def per_member(parameter: torch.Tensor, ndim: int) -> torch.Tensor:
    """View ``[M, *rest]`` as ``[M, 1, ..., 1, *rest]`` with ``ndim`` dimensions in all, so
    that it broadcasts against activations ``[M, B, ..., *rest]``."""
    members, *rest = parameter.shape
    return parameter.view(members, *([1] * (ndim - 1 - len(rest))), *rest)


class MemberLinear(nn.Module):
    """``M`` independent linear maps applied to ``x [M, ..., fan_in]`` (one batched product).

    ``init``: "haiku" (truncated normal with std 1/sqrt(fan_in), zero bias; the reference
    model's) or "torch" (``nn.Linear``'s default: uniform within +-1/sqrt(fan_in)).
    """

    def __init__(
        self, members: int, fan_in: int, fan_out: int, bias: bool = True, init: str = "haiku"
    ) -> None:
        super().__init__()
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        self.fan_in, self.fan_out = fan_in, fan_out
        self.weight = nn.Parameter(torch.empty(members, fan_out, fan_in))
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(members, fan_out)) if bias else None
        )
        bound = 1 / math.sqrt(fan_in)
        if init == "haiku":
            init_members_(self.weight, lambda w: truncated_normal_(w, bound))
            if self.bias is not None:
                nn.init.zeros_(self.bias)
        else:
            init_members_(self.weight, lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)))
            if self.bias is not None:
                init_members_(self.bias, lambda b: nn.init.uniform_(b, -bound, bound))

    def bias_parameter(self) -> nn.Parameter:
        """The bias of a map built with one."""
        if self.bias is None:
            raise ValueError("this map was built without a bias")
        return self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1, self.fan_in)
        weight = self.weight.transpose(1, 2)
        if self.bias is None:
            out = torch.bmm(flat, weight)
        else:
            out = torch.baddbmm(self.bias[:, None], flat, weight)
        return out.view(*x.shape[:-1], self.fan_out)


class MemberLayerNorm(nn.Module):
    """LayerNorm over the last axis with a learned scale and offset per member."""

    def __init__(self, members: int, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(members, dim))
        self.bias = nn.Parameter(torch.zeros(members, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:  # one member: the fused affine kernel
            return F.layer_norm(x, (self.dim,), self.weight[0], self.bias[0], self.eps)
        normalised = F.layer_norm(x, (self.dim,), eps=self.eps)
        return torch.addcmul(
            per_member(self.bias, x.dim()), normalised, per_member(self.weight, x.dim())
        )


class MemberEmbedding(nn.Module):
    """A token table per member: ids ``[M, B, T]`` -> vectors ``[M, B, T, D]``; member ``m``
    reads only its own table (ids must lie in ``0..V-1``)."""

    def __init__(self, members: int, vocabulary: int, dim: int, std: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(members, vocabulary, dim))
        init_members_(self.weight, lambda w: truncated_normal_(w, std))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        members = torch.arange(self.weight.shape[0], device=ids.device)
        return self.weight[per_member(members, ids.dim()), ids]
