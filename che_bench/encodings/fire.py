"""FIRE (functional interpolation of relative positions), signed for an encoder."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from che_bench.encodings.base import AttentionHook, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import LengthCache, check_positive, query_positions
from che_bench.members import MemberLinear

if TYPE_CHECKING:
    from typing_extensions import Unpack

EPS = 1e-6
MIN_THRESHOLD = 1.0  # lower bound of |lambda * L0|: keeps the row-0 normaliser away from 0
MIN_C = 1e-4  # lower bound of |c|: numerator and denominator must not vanish together


class FireHook(AttentionHook):
    """``Bias[:, i, j] = f(u_ij)`` with ``f: R -> R^H`` an MLP ``1 -> width -> H`` and::

        psi(x) = log(1 + |c| x)
        u_ij   = sign(i - j) psi(|i - j|) / (psi(max(|lambda L0|, N_side(i))) + eps)

    ``N_side`` is the number of keys on the key's side of the query (``i`` on the left,
    ``T - 1 - i`` on the right), so ``u`` lies in ``[-1, 1]`` and the left half equals causal
    FIRE. ``c`` (init 0.1) and ``lambda`` (init 1) are learned (one per member), ``L0`` is
    fixed. Computed in fp32; in no-grad evaluation the map of each row chunk is cached for the
    current length.
    """

    l0: torch.Tensor

    def __init__(self, heads: int, width: int, l0: float, members: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            MemberLinear(members, 1, width, init="torch"),
            nn.ReLU(),
            MemberLinear(members, width, heads, init="torch"),
        )
        self.c = nn.Parameter(torch.full((members,), 0.1))
        self.lam = nn.Parameter(torch.full((members,), 1.0))
        self.register_buffer("l0", torch.tensor(float(l0)), persistent=False)
        self._cache = LengthCache()

    def train(self, mode: bool = True) -> FireHook:
        self._cache.clear()  # do not hold a full-length map between evaluations
        return super().train(mode)

    def relative_coordinate(self, rows: slice, length: int) -> torch.Tensor:
        """The signed, normalised ``u [M, R, T]`` of the query rows, in fp32."""
        device = self.c.device
        query = query_positions(rows, length, device).float()[:, None]
        key = torch.arange(length, device=device, dtype=torch.float32)[None, :]
        c = self.c.float().abs().clamp(min=MIN_C)[:, None, None]
        threshold = (self.lam.float() * self.l0).abs().clamp(min=MIN_THRESHOLD)[:, None, None]
        delta = query - key
        keys_on_side = torch.where(delta > 0, query, length - 1 - query)
        normaliser = torch.log1p(c * torch.maximum(threshold, keys_on_side)) + EPS
        return delta.sign() * torch.log1p(c * delta.abs()) / normaliser

    def compute_bias(self, rows: slice, length: int) -> torch.Tensor:
        with torch.autocast(self.c.device.type, enabled=False):
            u = self.relative_coordinate(rows, length)
            return self.mlp(u[..., None]).permute(0, 3, 1, 2)[:, None]  # [M, 1, H, R, T]

    def bias(self, rows: slice, length: int, ctx: None) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.compute_bias(rows, length)
        versions = tuple(p._version for p in self.parameters())
        key = (length, self.c.device, self.c.dtype, versions)
        return self._cache.get(key, rows.indices(length), lambda: self.compute_bias(rows, length))


@register()
class FireEncoding(PositionalEncoding):
    """FIRE bias in every layer (own MLP, ``c`` and ``lambda`` per layer), signed two-sided.

    Options: ``fire_L0`` (default: ``train_max_tokens``, so the normaliser is constant inside
    the training range and longer rows are interpolated), ``fire_width`` (32, MLP hidden width).
    """

    name = "fire"
    description = "FIRE learned MLP of the log-normalised signed offset (per layer)."
    kind = "relative"
    carries_bias = True

    def __init__(
        self, *, fire_L0: float | None = None, fire_width: int = 32, **shape: Unpack[EncodingShape]
    ) -> None:
        super().__init__(**shape)
        l0 = check_positive("fire_L0", self.train_max_tokens if fire_L0 is None else fire_L0)
        check_positive("fire_width", fire_width)
        self.hooks = nn.ModuleList(
            FireHook(self.heads, fire_width, l0, self.members) for _ in range(self.layers)
        )
        self.resolved_options = {"fire_L0": l0, "fire_width": fire_width}
