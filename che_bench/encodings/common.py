"""Small building blocks shared by several encodings.

Offset convention: ``o = j - i`` (key index minus query index), so ``o < 0`` is a key to
the **left** of the query. A per-offset vector for a sequence of ``T`` tokens has
``2T - 1`` entries, entry ``o + T - 1`` holding offset ``o`` (``-(T-1) .. T-1``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from che_bench.encodings.base import AttentionHook
from che_bench.errors import CheBenchError


def query_positions(rows: slice, length: int, device: torch.device | str) -> torch.Tensor:
    """Indices of the query ``rows`` of a length-``length`` sequence, as a long tensor."""
    return torch.arange(*rows.indices(length), device=device)


def offsets(length: int, device: torch.device | str) -> torch.Tensor:
    """All signed offsets ``-(T-1) .. T-1`` in per-offset order (long)."""
    return torch.arange(-(length - 1), length, device=device)


def offset_index(rows: slice, length: int, device: torch.device | str) -> torch.Tensor:
    """``[R, T]`` index of ``o = j - i`` into a per-offset vector, for query ``rows``."""
    keys = torch.arange(length, device=device)
    return keys[None, :] - query_positions(rows, length, device)[:, None] + (length - 1)


def toeplitz_rows(per_offset: torch.Tensor, rows: slice, length: int) -> torch.Tensor:
    """Expand a per-offset vector ``[..., 2T-1]`` to the query ``rows``: ``[..., R, T]``."""
    return per_offset[..., offset_index(rows, length, per_offset.device)]


def two_sided(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Per-offset vector ``[..., 2T-1]`` from side values ``[..., T-1]`` (entry ``d - 1``:
    the key ``d`` tokens to the left, resp. right, of the query) and 0 at offset 0."""
    zero = left.new_zeros(*left.shape[:-1], 1)
    return torch.cat([left.flip(-1), zero, right], dim=-1)


def sinusoid(positions: torch.Tensor, dim: int, max_time: float) -> torch.Tensor:
    """Block sin|cos features ``[..., dim]`` of (possibly negative) positions, in fp32.

    Feature ``m < dim/2`` is ``sin(p w_m)`` and feature ``dim/2 + m`` is ``cos(p w_m)``,
    with ``w_m = max_time^(-2m/dim)`` (the layout of the randomized-PE code).
    """
    if dim % 2:
        raise CheBenchError(f"sinusoidal features need an even width, got {dim}")
    exponents = torch.arange(dim // 2, device=positions.device, dtype=torch.float32) * (2 / dim)
    angles = positions.float()[..., None] * max_time**-exponents
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def layer_hooks(make: Callable[[], AttentionHook], layers: int, shared: bool) -> nn.ModuleList:
    """The hooks of ``layers`` layers: one module from ``make`` serving every layer when
    ``shared``, else a fresh one per layer."""
    if shared:
        return nn.ModuleList([make()] * layers)
    return nn.ModuleList(make() for _ in range(layers))


def check_choice(option: str, value: str, choices: tuple[str, ...]) -> str:
    """Validate a string option against its allowed values."""
    if value not in choices:
        raise CheBenchError(f"{option} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_positive(option: str, value: float) -> float:
    """Validate a numeric option that must be positive."""
    if not value > 0:
        raise CheBenchError(f"{option} must be positive; got {value!r}")
    return value


class LengthCache:
    """Keeps tensors for one sequence length at a time (evaluation walks lengths in turn,
    so caching every length would grow without bound). ``key`` identifies everything
    else the tensors depend on (device, parameter versions); a new key empties the cache."""

    def __init__(self) -> None:
        self._key: Hashable = None
        self._entries: dict[Hashable, torch.Tensor] = {}

    def get(
        self, key: Hashable, entry: Hashable, build: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        if key != self._key:
            self._key, self._entries = key, {}
        if entry not in self._entries:
            self._entries[entry] = build()
        return self._entries[entry]

    def clear(self) -> None:
        self._key, self._entries = None, {}
