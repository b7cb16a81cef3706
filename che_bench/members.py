"""Layers with a leading member axis: one module holds the parameters of several models.

Every parameter (and buffer) of a che-bench model has shape ``[M, ...]``: ``M`` independent
models (the members of a pack: runs that differ only in seeds and learning rate) computed
side by side, as one wider computation. Activations carry the same leading axis,
``[M, B, T, D]``. A single run is a pack of one, so there is one code path.

A pack's member m is initialised exactly as run m alone: ``build_members``
(``che_bench.model.architectures``) builds each member as a one-member model after
``torch.manual_seed`` of that run's seed, builds the ``M``-member model for its shapes (its
own draws are discarded) and loads the members' weights into it side by side
(``load_member_states``: every ``state_dict`` entry concatenated along its first axis). What
this needs of a model: its construction draws only from torch's global RNG, and every
``state_dict`` entry of an ``M``-member build is the one-member entry with ``M`` rows on
the first axis. The initialisers here also run member by member (``init_members_``), so that
a module built for ``M`` members draws each member's slice as a one-member module would.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

INITS = ("haiku", "torch")


def truncated_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Haiku's truncated normal: N(0, std^2) cut at +-2 std (no variance correction)."""
    return nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)


def init_members_(parameter: torch.Tensor, init: Callable[[torch.Tensor], object]) -> None:
    """Initialise ``parameter`` ``[M, ...]`` member by member: ``init`` is called once per
    member, in member order, with that member's slice ``parameter[m]`` (a view of shape
    ``[...]``, under ``torch.no_grad``), and fills it in place, e.g.
    ``lambda w: nn.init.uniform_(w, -0.1, 0.1)``; what it returns is ignored. Drawn so from
    torch's global RNG, member m gets what a one-member parameter would after the same
    draws."""
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


def member_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, ..., fan_in]`` through each member's map ``weight [M, fan_out, fan_in]`` (and
    ``bias [M, fan_out]``): one batched product (``batched_product``)."""
    flat = x.reshape(x.shape[0], -1, weight.shape[2])
    out = batched_product(flat, weight.transpose(1, 2), bias)
    return out.view(*x.shape[:-1], weight.shape[1])


def batched_product(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.bmm(a, b)``, or with ``bias [M, N]`` added to every row ``torch.baddbmm``; under
    CPU bf16 autocast on a CPU whose torch has no native bf16 product, ``bf16_product``."""
    if a.device.type == "cpu" and emulates_bf16_products():
        return bf16_product(a, b, bias)
    return torch.bmm(a, b) if bias is None else torch.baddbmm(bias[:, None], a, b)


@functools.cache
def native_bf16_products() -> bool:
    """Whether torch's CPU matrix products in bf16 take oneDNN: on x86 a CPU with AVX-512 or
    native bf16. Elsewhere (an AVX2 CPU, such as AMD's before Zen 4) they take a scalar
    reference kernel, measured 35 times slower than float32's (AMD EPYC family 25 model 1,
    torch 2.13: a [1216, 1024] x [1024, 128] product in 178 ms against 5 ms)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def emulates_bf16_products() -> bool:
    """Whether CPU autocast is on, to bf16, where torch has no native bf16 product."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        enabled, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    else:
        enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    return enabled and dtype == torch.bfloat16 and not native_bf16_products()


def bf16_product(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b (+ bias[:, None])``, batched, as bf16 autocast computes it, forward and backward
    (its operands and results rounded to bf16, its sums in float32) but by float32's product:
    each result is autocast's but for the order of the float32 sums, which can move a
    rounding by one bf16 unit."""
    out: torch.Tensor = _Bf16Product.apply(a, b, bias)
    return out


def _rounded(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16, held in float32 for float32's product."""
    return t.to(torch.bfloat16).float()


class _Bf16Product(torch.autograd.Function):
    """``bf16_product``. Its backward is that of autocast's product run under autocast, as the
    training step runs it: each gradient a float32-summed product of bf16 operands, rounded
    to bf16, then cast to its input's dtype."""

    @staticmethod
    def forward(
        ctx: Any, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            a16, b16 = _rounded(a), _rounded(b)
            ctx.save_for_backward(a16, b16)
            ctx.dtypes = a.dtype, b.dtype, None if bias is None else bias.dtype
            if bias is None:
                return torch.bmm(a16, b16).to(torch.bfloat16)
            return torch.baddbmm(_rounded(bias)[:, None], a16, b16).to(torch.bfloat16)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a16, b16 = ctx.saved_tensors
        a_dtype, b_dtype, bias_dtype = ctx.dtypes
        needs_a, needs_b, needs_bias = ctx.needs_input_grad
        grad_a = grad_b = grad_bias = None
        with torch.autocast("cpu", enabled=False):
            g = gradient.float()
            if needs_a:
                grad_a = torch.bmm(g, b16.transpose(1, 2)).to(torch.bfloat16).to(a_dtype)
            if needs_b:
                grad_b = torch.bmm(a16.transpose(1, 2), g).to(torch.bfloat16).to(b_dtype)
            if needs_bias:
                grad_bias = gradient.sum(1).to(bias_dtype)
        return grad_a, grad_b, grad_bias


class MemberLinear(nn.Module):
    """``M`` independent linear maps, ``x [M, ..., fan_in] -> [M, ..., fan_out]``: member m's
    inputs through member m's map (one batched product).

    ``weight`` is ``[M, fan_out, fan_in]`` (each member's slice laid out as
    ``nn.Linear.weight``), ``bias`` ``[M, fan_out]``, or None with ``bias=False``
    (``bias_parameter()`` returns it, or raises ValueError). ``init`` (each member in turn):
    ``"haiku"``, the default (weight truncated normal with std ``1/sqrt(fan_in)``, cut at
    two std; bias zero: the reference model's ``hk.Linear``) or ``"torch"`` (``nn.Linear``'s
    default: weight and bias uniform within ``±1/sqrt(fan_in)``). Any other scheme:
    re-initialise with ``init_members_(layer.weight, ...)``.
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
        return member_linear(x, self.weight, self.bias)


class MemberLayerNorm(nn.Module):
    """LayerNorm over the last axis of ``x [M, ..., dim]`` with a learned scale ``weight``
    ``[M, dim]`` (ones) and offset ``bias`` ``[M, dim]`` (zeros) per member; draws nothing."""

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
    reads only its own table (ids must lie in ``0..V-1``). ``weight`` is ``[M, V, D]``, each
    member's table drawn in turn from a truncated normal with std ``std`` (cut at two std)."""

    def __init__(self, members: int, vocabulary: int, dim: int, std: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(members, vocabulary, dim))
        init_members_(self.weight, lambda w: truncated_normal_(w, std))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        members = torch.arange(self.weight.shape[0], device=ids.device)
        return self.weight[per_member(members, ids.dim()), ids]


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
