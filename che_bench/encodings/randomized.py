"""Random draws of the randomized positional encodings (Ruoss et al., 2023).

Positions are replaced by a sorted sample of distinct integers from a larger range
``[0, L)`` with ``L = noise_max_length``; relative methods sample sorted distinct
offset magnitudes from ``[1, L)`` instead. Draws come from torch's global CPU RNG (so
``torch.manual_seed`` makes runs reproducible, independently of the device and of the
CUDA RNG that dropout uses) and are shared by every sequence of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from che_bench.errors import CheBenchError

DEFAULT_NOISE_MAX_LENGTH = 2048


def sample_sorted(count: int, limit: int, *, start: int = 0) -> torch.Tensor:
    """``count`` distinct integers from ``[start, limit)``, ascending (long, CPU)."""
    available = limit - start
    if count > available:
        raise CheBenchError(
            f"randomized encoding: cannot draw {count} distinct positions from "
            f"[{start}, {limit}); raise noise_max_length above the longest sequence"
        )
    return torch.randperm(available)[:count].sort().values + start


@dataclass(frozen=True)
class RandomOptions:
    """The switches shared by the randomized encodings."""

    noise_max_length: int = DEFAULT_NOISE_MAX_LENGTH
    #: Also draw in eval mode (the reference does); False uses plain positions at eval.
    randomize_at_eval: bool = True

    def __post_init__(self) -> None:
        if self.noise_max_length < 2:
            raise CheBenchError(f"noise_max_length must be >= 2; got {self.noise_max_length}")

    def active(self, training: bool) -> bool:
        """Whether a forward pass in this mode uses random positions."""
        return training or self.randomize_at_eval


class LayerDraws:
    """Hands random draws to the attention layers of one forward pass.

    Per layer (the reference): every layer draws its own sample. Shared: layer 0 draws
    and the later layers of the same forward pass reuse that sample.
    """

    def __init__(self, per_layer: bool) -> None:
        self.per_layer = per_layer
        self._last: tuple[Any, Any] | None = None

    def draw(self, layer: int, key: Any, make: Callable[[], Any]) -> Any:
        """The sample for ``layer``; ``key`` (e.g. the length) must match to reuse one."""
        if self.per_layer or layer == 0 or self._last is None or self._last[0] != key:
            self._last = (key, make())
        return self._last[1]


def sample_distances(
    length: int, limit: int, both_sides: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomized distances for the offset-sampling variants (relative, ALiBi): sorted
    ``s_1 < ... < s_{T-1}`` from ``[1, limit)`` replace token distances ``1..T-1``. Returns
    (left, right): the same draw mirrored, or two independent draws with ``both_sides``."""
    right = sample_sorted(length - 1, limit, start=1)
    left = sample_sorted(length - 1, limit, start=1) if both_sides else right
    return left, right
