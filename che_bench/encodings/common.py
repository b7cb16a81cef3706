"""Small building blocks shared by several encodings (``running_sum`` and ``chunk_length`` by
models too).

Offset convention: ``o = j - i`` (key index minus query index), so ``o < 0`` is a key to
the **left** of the query. A per-offset vector for a sequence of ``T`` tokens has
``2T - 1`` entries, entry ``o + T - 1`` holding offset ``o`` (``-(T-1) .. T-1``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable

import torch
from torch import nn

from che_bench.encodings.base import AttentionHook
from che_bench.errors import CheBenchError


def running_sum(values: torch.Tensor, from_the_right: bool) -> torch.Tensor:
    """Cumulative sum of float ``values`` along the last axis (from its end when
    ``from_the_right``). Under torch's deterministic algorithms, a product with a triangular
    matrix of ones instead of ``cumsum``, whose CUDA kernel torch before 2.6 refuses there; on
    any device, so that a deterministic run counts alike on CPU and GPU. It costs ``T`` times
    the work of ``cumsum`` (and runs in TF32 where that is on). CoPE's counts, mLSTM's summed
    log-forget gates and the delta rule's in-chunk gate prefixes use it."""
    if not torch.are_deterministic_algorithms_enabled():
        if from_the_right:
            return values.flip(-1).cumsum(-1).flip(-1)
        return values.cumsum(-1)
    length = values.shape[-1]
    ones = torch.ones(length, length, dtype=values.dtype, device=values.device)
    # column j sums the entries t >= j (from the right) or t <= j
    triangle = ones.tril() if from_the_right else ones.triu()
    with autocast_off(values.device.type):  # counts stay in fp32
        return torch.matmul(values, triangle)


def chunk_length(steps: int, limit: int) -> int:
    """The chunk length that splits ``steps`` into the fewest chunks of at most ``limit`` with
    the least padding (a training batch of 41 tokens is one chunk of 41, not 64; 81 two of 41).
    The delta rule's chunks and PaTH's blocks."""
    chunks = max(1, -(-steps // limit))
    return -(-steps // chunks)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager[object]:
    """Autocast off on ``device_type`` (a device without autocast, such as the meta device
    the tests run the GPU path on, needs nothing; before torch 2.4, which can tell, autocast
    is taken to be the CPU's and CUDA's)."""
    tells = getattr(torch.amp, "is_autocast_available", None)
    has_autocast = tells(device_type) if tells else device_type in ("cpu", "cuda")
    if has_autocast:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


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


#: Floats of a map worked on at a time by the hand-written maps of FoX and stick-breaking
#: (about a core's L2 cache): their passes over a block there, not over the whole map in
#: memory, take about half the time.
CACHE_BLOCK_FLOATS = 1 << 17


def cache_blocks(count: int, floats_each: int) -> list[slice]:
    """``count`` leading indices (of maps of ``floats_each`` floats) in blocks that fit the
    cache (``CACHE_BLOCK_FLOATS``; one map at least)."""
    step = max(1, CACHE_BLOCK_FLOATS // floats_each)
    return [slice(n, min(n + step, count)) for n in range(0, count, step)]


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
