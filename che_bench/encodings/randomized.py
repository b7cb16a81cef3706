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
from typing import Any, ClassVar, TypeVar

import torch

from che_bench.encodings.base import AttentionHook
from che_bench.errors import CheBenchError

Sample = TypeVar("Sample")

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

    def recorded(self) -> dict[str, Any]:
        """These options under their option names, for ``resolved_options``."""
        return {
            "noise_max_length": self.noise_max_length,
            "randomize_at_eval": self.randomize_at_eval,
        }


class RandomPositions:
    """Mixin for an absolute encoding (before it in the bases): ``positions(length)``
    becomes a sorted draw from ``[0, noise_max_length)``, made once per forward pass (all
    layers, all sequences of the batch), whenever ``random`` is active in this mode."""

    randomized: ClassVar[bool] = True
    #: Set by the constructor of the encoding.
    random: RandomOptions
    training: bool

    def positions(self, length: int) -> torch.Tensor:
        if self.random.active(self.training):
            return sample_sorted(length, self.random.noise_max_length)
        return super().positions(length)  # type: ignore[misc]


class LayerDraws:
    """Hands random draws to the attention layers of one forward pass.

    Per layer (the reference): every layer draws its own sample. Shared: layer 0 draws
    and the later layers of the same forward pass reuse that sample.
    """

    def __init__(self, random: RandomOptions, per_layer: bool) -> None:
        self.random, self.per_layer = random, per_layer
        self._last: tuple[Any, Any] | None = None

    def recorded(self) -> dict[str, Any]:
        """The options of the draws under their option names, for ``resolved_options``."""
        return {**self.random.recorded(), "random_per_layer": self.per_layer}

    def draw(self, layer: int, key: Any, make: Callable[[], Any]) -> Any:
        """The sample for ``layer``; ``key`` (e.g. the length) must match to reuse one."""
        if self.per_layer or layer == 0 or self._last is None or self._last[0] != key:
            self._last = (key, make())
        return self._last[1]


class RandomizedHook(AttentionHook):
    """Base of the hooks of relative encodings with a randomized variant (RoPE,
    Transformer-XL, ALiBi); ``draws`` is None in the plain variant."""

    def __init__(self, layer: int, draws: LayerDraws | None) -> None:
        super().__init__()
        self.layer, self.draws = layer, draws

    def draw(self, length: int, sample: Callable[[int, int], Sample]) -> Sample | None:
        """``sample(length, noise_max_length)`` for this layer (or the one layer 0 drew
        when draws are shared), or None when this forward pass uses plain positions."""
        if self.draws is None or not self.draws.random.active(self.training):
            return None
        limit = self.draws.random.noise_max_length
        return self.draws.draw(self.layer, length, lambda: sample(length, limit))


def sample_distances(
    length: int, limit: int, both_sides: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomized distances for the offset-sampling variants (relative, ALiBi): sorted
    ``s_1 < ... < s_{T-1}`` from ``[1, limit)`` replace token distances ``1..T-1``. Returns
    (left, right): the same draw mirrored, or two independent draws with ``both_sides``."""
    right = sample_sorted(length - 1, limit, start=1)
    left = sample_sorted(length - 1, limit, start=1) if both_sides else right
    return left, right
